"""``tsckpt verify PATH``: read every chunk and check it; exit 1 with a report of what is damaged.

The report names each damaged file or object once, with what is wrong with it and how many tensors and values it
holds, rather than every tensor it took down with it; damage inside an intact file is named by tensor and chunk.
Lines are printed as they are, never wrapped at a console width, so a piped report keeps one problem per line.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING

import typer

from ..wording import count
from .base import FOUND, app, failed, flag

if TYPE_CHECKING:
    from ..read.verify_report import EntryReport, VerifyReport

#: Tensors of one file with damage of their own (a failed crc32c) named one line each; more share one line.
_NAMED_PER_FILE = 3


@app.command()
def verify(
    path: str = typer.Argument(..., help="checkpoint directory or file:// URL"),
    progress: bool = flag(None, "--progress/--no-progress",
                          help="progress bar (default: on for large checkpoints in a terminal)"),
    details: bool = flag(False, "--details", help="list every problem of every damaged tensor and value"),
    as_json: bool = flag(False, "--json", help="print the full report as JSON (keys: see tsckpt.cli.summary)"),
) -> None:
    """Check that every tensor's chunks exist, decode and pass their crc32c checksums."""
    from ..errors import TsckptError
    from ..commit.protocol import leftovers
    from ..read.verify import verify as run_verify
    from .summary import verification
    from .clean import leftover_line

    try:
        report = run_verify(path, progress=progress)
        items = leftovers(path)
    except TsckptError as e:
        raise failed(e, "FAILED") from None
    if as_json:
        print(json.dumps(verification(report) | {"leftovers": [i.to_dict() for i in items]}, indent=1))
    else:
        for line in (detail_lines(report) if details else damage_lines(report)):
            print(line)
        print(status_line(report, details))
        left = leftover_line(path, items)
        if left:
            print(f"note: {left}")
    if not report.ok:
        raise typer.Exit(FOUND)


def _holdings(entries: list[EntryReport]) -> str:
    """'40 tensors (40 damaged) and 2 values (1 damaged)' for the entries a file holds."""
    parts = []
    for kind in ("tensor", "value"):
        held = [e for e in entries if e.kind == kind]
        if held or kind == "tensor":
            bad = sum(not e.ok for e in held)
            parts.append(f"{count(len(held), kind)} ({'all' if bad == len(held) and bad > 1 else bad} damaged)")
    return " and ".join(parts)


def damaged_files(report: VerifyReport) -> dict[str, list[str]]:
    """The data files, tables and index found damaged as whole files (missing, cut short, unreadable): problems."""
    found: dict[str, list[str]] = defaultdict(list)
    if report.files is not None:
        for n, problem in enumerate(report.files.problems):
            file = report.files.file_of(n)
            found[file if file is not None else "(data files)"].append(problem)
    return dict(found)


def damage_lines(report: VerifyReport) -> list[str]:
    """One line per damaged file or object, then one per tensor or value with damage of its own."""
    files = damaged_files(report)
    lines = []
    for file, problems in files.items():
        holders = [e for e in report.entries if file in e.stored_in]
        first = problems[0] if file in problems[0] else f"{file}: {problems[0]}"
        more = f" (and {count(len(problems) - 1, 'other problem')})" if len(problems) > 1 else ""
        lines.append(f"{first}{more}; it holds {_holdings(holders)}" if holders else f"{first}{more}")
    # What remains is damage of the entries' own: grouped by the file it is in.
    own: dict[str | None, list[tuple[EntryReport, list[int]]]] = defaultdict(list)
    for entry in report.entries:
        at: dict[str | None, list[int]] = defaultdict(list)
        for n in range(len(entry.problems)):
            if entry.file_of(n) not in files:
                at[entry.file_of(n)].append(n)
        for file, numbers in at.items():
            own[file].append((entry, numbers))
    for file, hits in own.items():
        if file is not None and len(hits) > _NAMED_PER_FILE:
            entry, numbers = hits[0]
            chunks = sum(len(n) for _, n in hits)
            lines.append(f"{file}: {count(chunks, 'problem')} in {len(hits)} tensors and values, the first "
                         f"{entry.key} ({entry.path}): {entry.problems[numbers[0]]}")
            continue
        for entry, numbers in hits:
            where = f" in {file}" if file is not None and file != f"{entry.path}/{_chunk_of(entry, numbers[0])}" else ""
            more = f" (and {count(len(numbers) - 1, 'other problem')})" if len(numbers) > 1 else ""
            lines.append(f"{entry.key} ({entry.path}){where}: {entry.problems[numbers[0]]}{more}")
    return lines


def _chunk_of(entry: EntryReport, n: int) -> str:
    """The chunk key problem ``n`` of ``entry`` starts with ('chunk c.0.0: ...'), or ''."""
    problem = entry.problems[n]
    return problem[len("chunk "):].split(":", 1)[0] if problem.startswith("chunk ") else ""


def detail_lines(report: VerifyReport) -> list[str]:
    """Every problem of every damaged entry (and of the files beside them), each with the file it is about."""
    lines = []
    for entry in report.failed:
        lines.append(f"{entry.key} ({entry.path}): {count(len(entry.problems), 'problem')}")
        for n, problem in enumerate(entry.problems):
            file = entry.file_of(n)
            lines.append(f"  - {problem}" + (f" [{file}]" if file is not None and file not in problem else ""))
    return lines


def status_line(report: VerifyReport, details: bool) -> str:
    checked = f"{len(report.entries)} arrays, {report.chunks} chunks, {report.nbytes} bytes checked"
    if report.ok:
        return f"OK {report.location}: {checked}"
    files = damaged_files(report)
    entries = sum(not e.ok for e in report.entries)
    found = ([count(len(files), "damaged file")] if files else []) + [f"{entries} of {len(report.entries)} "
                                                                       "arrays damaged"]
    hint = "" if details else "; --details lists every problem"
    return f"FAILED {report.location}: {', '.join(found)} ({checked}){hint}"
