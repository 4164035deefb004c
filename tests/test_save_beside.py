"""A save published into a local directory that holds other files: killed anywhere, it is finished or undone.

Such a directory is never renamed or exchanged: the save moves the
checkpoint it replaces aside and its own files in, under a claim
(``tsckpt/commit/merge.py``). A save process is killed (SIGKILL, by its own
profiler, at a named step of that publication) and then ``tsckpt clean`` or
the next save runs: the directory must load as the old checkpoint (killed
before the claim) or the new one (after), hold exactly that checkpoint's
files and the other files byte for byte, and nothing may be left beside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import tsckpt
from tsckpt.commit.protocol import leftovers
from tsckpt.commit.states import ROOT, checkpoint_keys

OTHERS = {"config.yaml": b"lr: 0.1\n", "logs/events.txt": b"step 1\n", "w/notes.txt": b"beside an array\n"}


def _state(v: int) -> dict:
    state = {"w": torch.full((64, 64), float(v)), "step": v, f"only_{v}": torch.full((8,), float(v))}
    return state


def _run_dir(tmp_path, layout: str):
    run = tmp_path / "runs" / "exp1"
    for key, data in OTHERS.items():
        (run / key).parent.mkdir(parents=True, exist_ok=True)
        (run / key).write_bytes(data)
    tsckpt.save(_state(1), str(run), layout=layout)
    return run


def _loaded(path) -> int:
    sd = {"w": torch.zeros(64, 64), "step": 0}
    tsckpt.load(sd, str(path), allow_partial_load=True)
    assert torch.equal(sd["w"], torch.full((64, 64), float(sd["step"])))
    return sd["step"]


def _exactly(run, step: int) -> None:
    """The run directory holds the other files as they were, checkpoint ``step``'s files, and nothing else."""
    for key, data in OTHERS.items():
        assert (run / key).read_bytes() == data, key
    assert _loaded(run) == step
    own = checkpoint_keys((run / ROOT).read_bytes())
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    stray = [k for k in files if k not in OTHERS and k != ROOT and not own(k)]
    assert stray == [], stray
    assert not [k for k in files if k.startswith(f"only_{3 - step}")], files  # the other checkpoint's array
    assert tsckpt.verify(str(run)).ok
    assert leftovers(str(run)) == [] and os.listdir(run.parent) == ["exp1"]


#: Where the save kills itself: a function of tsckpt/commit/staged.py or merge.py and the profiler event, or the n-th rename
#: the publication makes.
POINTS = [
    ("commit_root", "call"),  # the checkpoint is complete in its staging directory: not published
    ("_move_aside", "call"),  # the claim is down, nothing moved yet
    ("rename", 2),  # the old root is aside (the old checkpoint is un-committed), its files not yet
    ("_move_aside", "return"),  # the old checkpoint is all aside; the claim does not say so yet
    ("_move_in", "call"),  # the claim says so; nothing of the new one is in
    ("_move_in", "return"),  # everything but the new root is in
]

SAVE = """
    import os, signal, sys, torch, tsckpt
    from test_save_beside import _state
    where, event = sys.argv[2], sys.argv[3]
    renames = [0]

    def kill(frame, what, arg):
        code = frame.f_code
        if not code.co_filename.endswith(("tsckpt/commit/staged.py", "tsckpt/commit/merge.py")):
            return
        if where == "rename" and what == "c_call" and arg is os.rename and code.co_name == "_move_aside":
            renames[0] += 1
            if renames[0] == int(event):
                os.kill(os.getpid(), signal.SIGKILL)
        elif code.co_name == where and what == event:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.setprofile(kill)
    tsckpt.save(_state(2), sys.argv[1], overwrite=True, layout=sys.argv[4])
    """


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}


def _killed_save(run, point: tuple[str, object], layout: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SAVE), str(run), str(point[0]), str(point[1]),
                             layout], env=_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == -signal.SIGKILL, result.stderr


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("point", POINTS, ids=[f"{p[0]}-{p[1]}" for p in POINTS])
def test_a_save_killed_while_publishing_beside_other_files_is_finished_by_clean(tmp_path, layout, point):
    run = _run_dir(tmp_path, layout)
    _killed_save(run, point, layout)
    for key, data in OTHERS.items():
        assert (run / key).read_bytes() == data, key
    tsckpt.clean(str(run))
    _exactly(run, 1 if point[0] == "commit_root" else 2)


@pytest.mark.parametrize("point", [POINTS[2], POINTS[4]], ids=["rename-2", "_move_in-call"])
def test_the_next_save_finishes_it_first(tmp_path, point):
    run = _run_dir(tmp_path, "plain")
    _killed_save(run, point, "plain")
    with pytest.raises(tsckpt.CheckpointExistsError):  # the killed save's checkpoint, published first
        tsckpt.save(_state(1), str(run))
    _exactly(run, 2)
    tsckpt.save(_state(1), str(run), overwrite=True)
    _exactly(run, 1)


def test_a_file_where_the_save_puts_a_directory_refuses_its_publication_before_anything_moves(tmp_path):
    run = _run_dir(tmp_path, "plain")
    (run / "only_2").write_bytes(b"a file named as an array of the next save\n")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with pytest.raises(tsckpt.ForeignContentError, match="holds 'only_2' where save [0-9a-f]+ writes its own files"):
        tsckpt.save(_state(2), str(run), overwrite=True, layout="plain")  # plain: a directory per array
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert _loaded(run) == 1 and os.listdir(run.parent) == ["exp1"]


def test_two_saves_into_a_run_directory_at_once_publish_in_turn(tmp_path):
    run = _run_dir(tmp_path, "plain")
    code = textwrap.dedent("""
        import sys, tsckpt
        from test_save_beside import _state
        tsckpt.save(_state(int(sys.argv[2])), sys.argv[1], overwrite=True)
        """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(run), str(v)], env=_env(), stderr=subprocess.PIPE,
                              text=True) for v in (2, 2)]
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stderr.read()
    _exactly(run, 2)
