"""Run PyTorch's own DCP tests twice, with DCP's file storage and with tsckpt's, and compare.

PyTorch's test files are not part of this repository: fetch
``test/distributed/checkpoint/`` of the pytorch/pytorch release that matches your
torch into a directory of your own, then::

    python tools/pytorch_dcp_suite.py /path/to/pytorch-dcp-tests

Each test file runs on its own (one pytest process per file and mode, with a
per-test ``--timeout``) once per mode:

- ``dcp``: unmodified, DCP's ``FileSystemWriter`` / ``FileSystemReader``;
- ``exact``: those names bound to ``tsckpt.TensorStoreWriter`` / ``TensorStoreReader``
  and called with the arguments exactly as the tests give them;
- ``path`` / ``path-overwrite``: tsckpt's classes built from the path alone
  (plus DCP's resolved ``overwrite``), to see what fails beyond the constructor.

The swap is done by ``tools/dcp_swap/sitecustomize.py`` in every process, spawned
ranks included. GPU-only tests are adapted to CPU in every mode (``--no-cpu``
turns that off). Tests that fail or skip under DCP itself are not rerun under
tsckpt (``--all`` reruns them). The report is a markdown table of pass counts
per file and mode, then every test that fails under tsckpt with a one-line reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SWAP_DIR = Path(__file__).resolve().parent / "dcp_swap"
MODES = ("dcp", "exact", "path", "path-overwrite")
# Paths some of PyTorch's tests write to directly instead of a temp dir; removed
# before each run so a run never sees the previous run's checkpoint.
FIXED_PATHS = ("/tmp/dcp_testing",)
_EXC_LINE = re.compile(r"^\s*((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Timeout))\b(:.*)?$")
_WRAPPER = re.compile(r"Process \d+ (exited|terminated)|^\s*Failed: Timeout")
# The harness's own verdict when a rank exits non-zero: the rank's error is in its stderr.
_EXIT_CODE = re.compile(r"Expected exit code \d+ but got \d+")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One test's result in one mode."""

    status: str  # passed | failed | error | skipped | not run
    reason: str = ""


@dataclasses.dataclass
class FileRun:
    """One test file run in one mode."""

    file: str
    mode: str
    outcomes: dict[str, Outcome]
    seconds: float
    note: str = ""

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes.values())


def _lines(text: str) -> list[str]:
    # pytest prefixes its report lines with "E   "
    return [re.sub(r"^E\s+", "", ln) for ln in text.splitlines()]


def last_exception(text: str) -> str:
    """The innermost exception line of a traceback dump (ranks' tracebacks included), or ''."""
    found = ""
    for line in _lines(text):
        if _EXC_LINE.match(line) and not _WRAPPER.search(line):
            found = line.strip()
    return " ".join(found.split())


def one_line_reason(text: str, limit: int = 240) -> str:
    """Why a test failed, in one line: the failed check, and the innermost exception behind it."""
    lines = _lines(text)
    found = last_exception(text) or next((" ".join(ln.split()) for ln in lines if ln.strip()), "")
    check = next((" ".join(ln.split()) for ln in lines if ln.strip().startswith("AssertionError")), "")
    where = next((ln[1:].strip() for ln in reversed(text.splitlines()) if ln.startswith(">")), "")
    if check and check != found:
        # e.g. assertRaisesRegex: the message did not match, and the exception raised instead
        found = f"{check[:100]} <- {found}"
    elif found.startswith("AssertionError") and where:
        # unittest's messages ("AssertionError not raised") mean little without the check itself
        found = f"{found} [at {where}]"
    return found if len(found) <= limit else found[: limit - 3] + "..."


def parse_junit(path: Path, module: str) -> dict[str, Outcome]:
    """Per-test outcomes from pytest's junit XML, keyed ``Class::test`` (or ``test``).

    ``module`` is the test file's dotted name, which junit puts before the class.
    """
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "").removeprefix(module).lstrip(".")
        name = f"{cls}::{case.get('name')}" if cls else str(case.get("name"))
        status, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = f"{child.get('message', '')}\n{child.text or ''}"
                reason = one_line_reason(text)
                rank_error = last_exception(case.findtext("system-err") or "")
                if _EXIT_CODE.search(text) and rank_error:
                    reason = one_line_reason(rank_error)
                break
        outcomes[name] = Outcome(status, reason)
    return outcomes


def run_file(test_file: Path, root: Path, mode: str, args: argparse.Namespace, workdir: Path,
             deselect: list[str] = ()) -> FileRun:
    rel = str(test_file.relative_to(root))
    tag = re.sub(r"[^\w.]+", "_", rel) + f".{mode}"
    junit, log = workdir / f"{tag}.xml", workdir / f"{tag}.log"
    tmp = workdir / f"{tag}.tmp"
    tmp.mkdir()
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\njunit_logging = system-err\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SWAP_DIR), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TMPDIR"] = str(tmp)
    env.pop("TSCKPT_DCP_SWAP", None)
    if mode != "dcp":
        env["TSCKPT_DCP_SWAP"] = mode
    env["TSCKPT_DCP_CPU"] = "0" if args.no_cpu else "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ini),
           "--rootdir", str(root), f"--timeout={args.timeout}", f"--junitxml={junit}", str(test_file)]
    if args.k:
        cmd += ["-k", args.k]
    for name in deselect:
        cmd += ["--deselect", f"{rel}::{name}"]
    for p in FIXED_PATHS:
        shutil.rmtree(p, ignore_errors=True)
    start = time.monotonic()
    note = ""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=args.file_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            note = f"file timed out after {args.file_timeout}s"
    seconds = time.monotonic() - start
    shutil.rmtree(tmp, ignore_errors=True)
    module = rel.removesuffix(".py").replace(os.sep, ".")
    outcomes = parse_junit(junit, module) if junit.exists() else {}
    if not outcomes and not note:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        note = f"no results (pytest exit {proc.returncode}): {one_line_reason(log.read_text(errors='replace')) or tail[0]}"
    return FileRun(rel, mode, outcomes, seconds, note)


def report(runs: dict[str, dict[str, FileRun]], modes: list[str]) -> str:
    """Markdown: pass counts per file and mode, then what fails under tsckpt."""
    swapped = [m for m in modes if m != "dcp"]
    head = ["file", "tests"] + [f"passed ({m})" for m in modes] + ["skipped", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    totals = [0] * (len(modes) + 1)
    for file, by_mode in runs.items():
        names = set().union(*(r.outcomes for r in by_mode.values()))
        counts = [by_mode[m].count("passed") for m in modes]
        skipped = max(r.count("skipped") for r in by_mode.values())
        secs = " / ".join(f"{by_mode[m].seconds:.0f}" for m in modes)
        notes = "; ".join(f"{m}: {r.note}" for m, r in by_mode.items() if r.note)
        lines.append(f"| {file} | {len(names)} | " + " | ".join(map(str, counts))
                     + f" | {skipped} | {secs} |" + (f" {notes}" if notes else ""))
        totals = [t + c for t, c in zip(totals, [len(names), *counts])]
    lines.append("| **total** | " + " | ".join(f"**{t}**" for t in totals) + " | | |")
    if "dcp" in modes:
        lines += ["", "### Failing under DCP itself (not counted as differences)", ""]
        for file, by_mode in runs.items():
            lines += [f"- `{file}::{name}`: {o.reason}" for name, o in sorted(by_mode["dcp"].outcomes.items())
                      if o.status in ("failed", "error")]
    for mode in swapped:
        lines += ["", f"### Failing under tsckpt ({mode})", ""]
        any_failure = False
        for file, by_mode in runs.items():
            base, run = by_mode["dcp"].outcomes if "dcp" in by_mode else {}, by_mode[mode]
            for name, outcome in sorted(run.outcomes.items()):
                if outcome.status not in ("failed", "error"):
                    continue
                any_failure = True
                also = base.get(name, Outcome("missing")).status
                flag = "" if also == "passed" else f" (DCP: {also})"
                lines.append(f"- `{file}::{name}`{flag}: {outcome.reason}")
        if not any_failure:
            lines.append("none")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tests", type=Path, help="directory holding PyTorch's test/distributed/checkpoint files")
    ap.add_argument("files", nargs="*", help="test files relative to TESTS (default: every test_*.py under it)")
    ap.add_argument("--modes", default="dcp,exact", help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds")
    ap.add_argument("--file-timeout", type=int, default=1800, help="per-file, per-mode wall-clock limit")
    ap.add_argument("-k", help="pytest -k expression applied to every file")
    ap.add_argument("--no-cpu", action="store_true", help="do not adapt GPU-only tests to CPU")
    ap.add_argument("--all", action="store_true",
                    help="also run, under tsckpt, the tests that fail or are skipped under DCP")
    ap.add_argument("--json", type=Path, help="also write every outcome as JSON here")
    ap.add_argument("--workdir", type=Path, help="where logs and junit files go (default: a new temp dir)")
    args = ap.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    root = args.tests.resolve()
    if not root.is_dir():
        ap.error(f"{root} is not a directory")
    files = [root / f for f in args.files] if args.files else sorted(root.rglob("test_*.py"))
    missing = [str(f) for f in files if not f.is_file()]
    files = [f for f in files if f.is_file()]
    for f in missing:
        print(f"skipping {f}: no such file", file=sys.stderr)
    if not files:
        ap.error(f"no test files found under {root}")
    for module in ("expecttest", "pytest_timeout"):
        try:
            __import__(module)
        except ImportError:
            ap.error(f"PyTorch's tests need {module!r} installed (pip install {module.replace('_', '-')})")
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="pytorch-dcp-suite-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    runs: dict[str, dict[str, FileRun]] = {}
    for f in files:
        for mode in modes:
            base = runs.get(str(f.relative_to(root)), {}).get("dcp")
            # A test DCP itself fails says nothing about tsckpt: by default it is not rerun.
            skip = [] if args.all or base is None else [n for n, o in base.outcomes.items() if o.status != "passed"]
            run = run_file(f, root, mode, args, workdir, skip)
            for name in skip:
                run.outcomes.setdefault(name, Outcome("not run", "fails or is skipped under DCP"))
            runs.setdefault(run.file, {})[mode] = run
            print(f"{run.file} [{mode}]: {run.count('passed')} passed, {run.count('failed') + run.count('error')} "
                  f"failed, {run.count('skipped')} skipped in {run.seconds:.0f}s {run.note}", file=sys.stderr, flush=True)
    text = report(runs, modes)
    print(text)
    print(f"\nlogs: {workdir}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(
            {file: {m: {"seconds": r.seconds, "note": r.note,
                        "outcomes": {n: dataclasses.asdict(o) for n, o in r.outcomes.items()}}
                    for m, r in by_mode.items()} for file, by_mode in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
