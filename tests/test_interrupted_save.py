"""Ctrl-C during a save: one line that says what is left where, and what the save staged is removed.

The interrupt is a real SIGINT, sent by the saving process to itself while
its rank is writing (:mod:`ctrl_c`), with chunk writes still running in the
background: the coordinator waits for them before removing the staging
directory, so nothing they write lands after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import torch

import dist
import tsckpt
from cli_run import run_cli
from ctrl_c import ARMED, CtrlC
from tsckpt.cli.base import INTERRUPTED
from tsckpt.commit.staging_dirs import staging_dirs

HERE = os.path.dirname(__file__)
BUCKET = "tsckpt-interrupted"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
#: Chunk files of 1 MiB and more go through the write threads: these are still being written at the interrupt.
STATE = "{f'w{i}': torch.full((256, 1024), float(i)) for i in range(12)}"


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, ARMED: "1", "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, timeout=240)


def test_ctrl_c_during_tsckpt_save_is_one_line_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "run" / "step_2"
    result = _python(f"""
        import sys, torch, tsckpt
        from ctrl_c import CtrlC
        state = {STATE}
        state["z"] = CtrlC()  # last: the tensors' writes are under way when it is saved
        tsckpt.save(state, sys.argv[1])
        """, str(target))
    # Still Ctrl-C to the shell: the interpreter ends by SIGINT, as for any uncaught KeyboardInterrupt.
    assert result.returncode == -signal.SIGINT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (f"KeyboardInterrupt: save to {target} was interrupted (Ctrl-C on rank 0); "
                         f"nothing was committed; what it had staged was removed"), result.stderr
    frames = [line for line in lines if line.startswith("  File ")]
    assert len(frames) <= 2, result.stderr  # the caller's frame and tsckpt.save's, not DCP's or the writer's
    assert os.listdir(tmp_path / "run") == [] and not staging_dirs(str(target))


def test_ctrl_c_during_a_save_to_s3_removes_what_it_wrote(s3):
    location = s3.location(BUCKET, "run/step_2")
    result = _python(f"""
        import json, sys, torch, tsckpt
        from ctrl_c import CtrlC
        state = {STATE}
        state["z"] = CtrlC()
        tsckpt.save(state, json.loads(sys.argv[1]))
        """, json.dumps(location))
    assert result.returncode == -signal.SIGINT, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"KeyboardInterrupt: save to s3://{BUCKET}/run/step_2 was interrupted (Ctrl-C on rank 0); "
        f"nothing was committed; what it had staged was removed"), result.stderr
    # Every key went, the claim last: nothing is left that no save claims and tsckpt could no longer remove.
    assert s3.keys(BUCKET, "run/") == []


def _interrupt_rank_1(rank: int, world_size: int, path: str) -> tuple[str, str]:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ[ARMED] = "1"
    state = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(6)}
    if rank == 1:
        state["z"] = CtrlC()
    try:
        tsckpt.save(state, path)
    except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt is what is tested
        return type(e).__name__, str(e)
    return "ok", ""


def test_ctrl_c_on_one_rank_stops_every_rank_with_the_same_line(tmp_path):
    target = tmp_path / "step_7"
    results = dist.run_ranks(2, _interrupt_rank_1, str(target), timeout=120)
    line = (f"save to {target} was interrupted (Ctrl-C on rank 1); nothing was committed; "
            f"what it had staged was removed")
    # The coordinator removed it and every rank says so; the rank that was interrupted stays interrupted.
    assert results == [("SaveFailedError", line), ("KeyboardInterrupt", line)], results
    assert os.listdir(tmp_path) == [] and not staging_dirs(str(target))


def test_ctrl_c_during_convert_is_one_line_and_leaves_nothing_behind(tmp_path):
    source = tmp_path / "a.pt"
    torch.save({**{f"w{i}": torch.full((256, 1024), float(i)) for i in range(12)}, "z": CtrlC()}, source)
    target = tmp_path / "run" / "step_3"
    result = run_cli("convert", "--trust-pickle", "-q", str(source), str(target),
                     env={ARMED: "1", "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == INTERRUPTED, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"interrupted: convert to {target} was interrupted (Ctrl-C); nothing was committed, "
        f"and what it had staged was removed"], result.stderr
    assert os.listdir(tmp_path / "run") == []


def test_ls_names_the_command_that_removes_what_an_interrupted_save_left(tmp_path):
    tsckpt.save({"w": torch.ones(4)}, str(tmp_path / "step_1"))
    # What a save killed outright (SIGKILL, a lost node) leaves: its hidden staging directory and nothing else.
    for name in ("step_1", "step_2"):
        staged = tmp_path / f".{name}.tsckpt-{'0' * 31}{name[-1]}"
        (staged / "w").mkdir(parents=True)
        (staged / "w" / "c.0").write_bytes(b"\0" * 3000)
    result = run_cli("ls", str(tmp_path), env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "incomplete" in out, out  # step_2: nothing but its staging directory
    assert (f"step_1: 1 leftover(s) (2.9 KiB) from aborted saves: remove with `tsckpt clean {tmp_path}/step_1`"
            in out), out
    assert (f"step_2: 1 leftover(s) (2.9 KiB) from aborted saves: remove with `tsckpt clean {tmp_path}/step_2`"
            in out), out
