"""The documentation covers the public API, and the README stays short and keeps its set-up commands.

Read from the sources under docs/ without building the site (CI builds it with warnings as
errors: .ci/run).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import tsckpt
import tsckpt.errors
import tsckpt.steps

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"

#: The set-up commands of the README, which CI runs verbatim on a fresh machine.
SETUP_COMMANDS = (
    "pip install torch==2.13.0 -e . && tsckpt demo",
    'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q',
)

# ".. autoclass:: tsckpt.TensorStoreWriter" inside {eval-rst} blocks, or "```{autofunction} tsckpt.save".
_DIRECTIVE = re.compile(r"^(?:\.\. (auto\w+)::|```\{(auto\w+)\})[ \t]+(\S+)(.*(?:\n[ \t]+:.*)*)", re.M)


def _directives() -> list[tuple[str, str, str]]:
    """(directive, target, options) of every autodoc directive in the API reference's pages."""
    found = []
    for page in sorted(API.glob("*.md")):
        for m in _DIRECTIVE.finditer(page.read_text()):
            found.append((m.group(1) or m.group(2), m.group(3), m.group(4)))
    return found


def _documented() -> set[str]:
    """Public names the reference documents: each directive's target, and a module's members when listed."""
    names = set()
    for directive, target, options in _directives():
        if directive == "automodule" and ":members:" in options:
            module = __import__(target, fromlist=["_"])
            names |= {n for n, v in vars(module).items()
                      if not n.startswith("_") and getattr(v, "__module__", None) == target}
        elif target.startswith("tsckpt."):
            names.add(target.rsplit(".", 1)[1])
    return names


def test_the_api_reference_names_every_public_name():
    missing = sorted(set(tsckpt.__all__) - _documented())
    assert not missing, f"docs/api/ documents none of {missing}: add them to a page there"


def test_the_api_reference_documents_the_step_functions():
    public = {n for n, v in vars(tsckpt.steps).items()
              if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == "tsckpt.steps"}
    assert {"scan", "latest", "prune"} <= public
    targets = {target for _, target, _ in _directives()}
    for name in sorted(public):
        assert f"tsckpt.steps.{name}" in targets or f"tsckpt.{name}" in targets, name


def test_every_exception_class_is_documented():
    classes = {n for n, v in vars(tsckpt.errors).items()
               if inspect.isclass(v) and issubclass(v, BaseException) and v.__module__ == "tsckpt.errors"}
    assert "TsckptError" in classes
    assert not classes - _documented()


def test_the_site_includes_the_specification_pages_where_they_are():
    index = (DOCS / "index.md").read_text()
    for page in ("format", "publication"):
        assert (DOCS / f"{page}.md").is_file()
        assert re.search(rf"^{page}$", index, re.M), f"docs/index.md's toctree should list {page}"


def test_the_readme_is_short_and_keeps_both_setup_commands_verbatim():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    for command in SETUP_COMMANDS:
        assert command in blocks, f"the README should show {command!r} alone in a bash block"


def test_the_readme_links_only_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link
