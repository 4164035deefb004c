"""Plain zarr-python and dask read tsckpt's bf16 and float8 arrays on every supported zarr release.

The reader runs in a fresh interpreter that plays a user's script: it imports zarr and dask, never
tsckpt. From zarr 3.4.1 on, zarr loads the ``zarr.data_type`` entry points tsckpt declares, so that
is enough; older releases (3.1 to 3.4.0) collect them but never load them, and the script must
``import tsckpt`` first, as the README says. Each test asserts what the installed zarr must do.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zarr
from packaging.version import Version

import tsckpt

REPO = Path(__file__).resolve().parents[1]
# The first zarr-python whose data-type registry loads entry points on its own.
LOADS_ENTRY_POINTS = Version(zarr.__version__) >= Version("3.4.1")
# zarr's own words when a data type is unknown (zarr/core/dtype/registry.py, 3.1 to 3.4).
UNKNOWN_DTYPE = re.compile(r"^No Zarr data type found that matches '(bfloat16|float8_\w+)'$")

# torch dtype -> the Zarr data_type name tsckpt writes (docs/format.md, section 6).
FLOATS = {
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz",
    torch.float8_e5m2fnuz: "float8_e5m2fnuz",
    torch.float8_e8m0fnu: "float8_e8m0fnu",
}

# The user's script: everything before the read happens without tsckpt unless PRELUDE imports it.
READER = """
import json, os, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import zarr
    import dask.array as da
    {prelude}
    out = {{"tsckpt_imported_by_user": "tsckpt" in sys.modules, "arrays": {{}}}}
    try:
        group = zarr.open_group(sys.argv[1], mode="r")
        for name, path in json.loads(sys.argv[2]).items():
            arr = group[path]
            out["arrays"][name] = {{"dtype": str(arr.dtype), "zarr": arr[...].tobytes().hex(),
                                   "dask": da.from_zarr(arr).compute().tobytes().hex()}}
    except ValueError as e:
        out["error"] = str(e)
out["tsckpt_loaded"] = "tsckpt" in sys.modules  # imported by zarr, through the entry points
here = os.sep + "tsckpt" + os.sep
out["tsckpt_warnings"] = [f"{{w.category.__name__}}: {{w.message}}" for w in caught if here in w.filename]
print(json.dumps(out))
"""


def _bits(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a one-byte type, and a spread of them for bfloat16 (NaNs and infs included)."""
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.uint8).reshape(4, 64).view(dtype)
    g = torch.Generator().manual_seed(14)
    raw = torch.randint(-(2**15), 2**15, (8, 64), dtype=torch.int32, generator=g).to(torch.int16)
    raw[0, :4] = torch.tensor([0x7F80, -0x80, 0x7FC0, -0x7FFF], dtype=torch.int16)  # +inf, -inf, NaN, NaN payload
    return raw.view(dtype)


def _raw(t: torch.Tensor) -> str:
    return t.contiguous().view(torch.uint8).numpy().tobytes().hex()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, dict[str, str], dict[str, str]]:
    """A checkpoint of one tensor per type; returns (path, name -> array path, name -> raw bytes)."""
    tensors = {name: _bits(dt) for dt, name in FLOATS.items()}
    path = tmp_path_factory.mktemp("stacks") / "ckpt"
    tsckpt.save({"dtypes": tensors}, path, layout="plain")  # read below by zarr alone, from files
    doc = json.loads((path / "zarr.json").read_text())["attributes"]["tsckpt"]["tensors"]
    arrays = {}
    for name in tensors:
        entry = doc[f"dtypes.{name}"]
        assert entry["dtype"] == name, entry
        assert json.loads((path / entry["path"] / "zarr.json").read_text())["data_type"] == name
        arrays[name] = entry["path"]
    return path, arrays, {name: _raw(t) for name, t in tensors.items()}


def _read_as_a_user(ckpt, prelude: str = "pass") -> dict:
    path, arrays, _ = ckpt
    script = READER.format(prelude=prelude)
    res = subprocess.run([sys.executable, "-c", script, str(path), json.dumps(arrays)],
                         capture_output=True, text=True, timeout=120, cwd=path.parent)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _assert_read_bit_exactly(ckpt, out: dict) -> None:
    _, _, want = ckpt
    assert "error" not in out, out["error"]
    assert set(out["arrays"]) == set(want)
    for name, got in out["arrays"].items():
        assert got["dtype"] == name, (name, got["dtype"])  # an ml_dtypes type, not raw bytes or a cast
        assert got["zarr"] == want[name], f"zarr-python read {name} wrongly"
        assert got["dask"] == want[name], f"dask read {name} wrongly"


def test_plain_zarr_and_dask_read_bf16_and_float8_with_tsckpt_only_installed(ckpt):
    out = _read_as_a_user(ckpt)
    assert not out["tsckpt_imported_by_user"]
    if LOADS_ENTRY_POINTS:
        _assert_read_bit_exactly(ckpt, out)
        assert out["tsckpt_loaded"], "the types should come from tsckpt's zarr.data_type entry points"
    else:
        # zarr < 3.4.1 never loads entry points: the script fails with zarr's message (the README
        # quotes it next to the fix), and no tsckpt code ran.
        assert UNKNOWN_DTYPE.match(out.get("error", "")), out
        assert not out["tsckpt_loaded"]
    assert out["tsckpt_warnings"] == []


def test_importing_tsckpt_first_reads_them_on_every_zarr_without_warnings(ckpt):
    out = _read_as_a_user(ckpt, prelude="import tsckpt")
    assert out["tsckpt_imported_by_user"]
    _assert_read_bit_exactly(ckpt, out)
    # e.g. zarr 3.4 deprecates the old import path of DataTypeValidationError
    assert out["tsckpt_warnings"] == []


def test_troubleshooting_names_zarr_error_and_its_fix():
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    section = page[page.index("No Zarr data type found"):]
    section = section[:section.find("\n### ") if "\n### " in section else None]
    quoted = re.search(r"No Zarr data type found that matches '[^']+'", page)
    assert quoted and UNKNOWN_DTYPE.match(quoted.group(0)), "the page should quote zarr's error as zarr words it"
    assert "import tsckpt" in section and "3.4.1" in section


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"```bash\n(pip install torch==[^\n]*\[test\][^\n]*)\n```", readme).group(1)
    install, run = (part.strip() for part in command.split("&&"))
    ci = (REPO / ".ci" / "run").read_text()
    assert f"quietly readme-install {install};" in ci
    assert f"tests readme {run} " in ci
