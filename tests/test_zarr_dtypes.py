"""zarr-python reads every array of a 4-rank checkpoint, bf16 and float8 included."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import dask.array as da
import ml_dtypes
import numpy as np
import pytest
import zarr

import torch

import tsckpt
import tsckpt.format.zarr_dtypes as zd
from damage import layout_of
import zoo
from tsckpt.format import dtypes
from tsckpt.format.names import zarr_path


def _array_path(name: str) -> str:
    parts = name.split(".", 1) if name.startswith("dtypes.") else ["model", name]
    return zarr_path(parts)


def _group(path: str) -> zarr.Group:
    """zarr-python's view: of the directory itself (plain), or through tsckpt's store (packed)."""
    return zarr.open_group(path if layout_of(path) == "plain" else tsckpt.zarr_store(path), mode="r")


def test_zarr_python_reads_every_array_bit_exactly(zoo_ckpt, capsys):
    group = _group(zoo_ckpt)
    tree = str(group.tree())
    for name, want in zoo.expected_all().items():
        path = _array_path(name)
        assert path.rsplit("/", 1)[-1] in tree, path
        arr = group[path]
        got = arr[...]
        ref = dtypes.tensor_as_numpy(want.contiguous())
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert got.tobytes() == ref.tobytes(), name


def test_array_attributes_say_what_each_array_is(zoo_ckpt):
    group = _group(zoo_ckpt)
    attrs = group["model/mesh2d"].attrs["tsckpt"]
    assert attrs["kind"] == "tensor" and attrs["key"] == "model.mesh2d"
    assert attrs["torch_dtype"] == "torch.float32"
    assert attrs["placement"]["placements"] == [{"type": "shard", "dim": 0}, {"type": "shard", "dim": 1}]
    assert group["dtypes/bfloat16"].attrs["tsckpt"]["torch_dtype"] == "torch.bfloat16"
    # zarr's .info summary lists the data type by our class, not an unknown name
    assert "BFloat16" in repr(group["dtypes/bfloat16"].info)
    assert "Float8E4M3FN" in repr(group["dtypes/float8_e4m3fn"].info)


def test_dask_reads_a_bf16_array_chunk_by_chunk(zoo_ckpt):
    arr = _group(zoo_ckpt)["model/uneven"]
    lazy = da.from_zarr(arr)
    assert lazy.dtype == np.dtype(ml_dtypes.bfloat16) and lazy.chunks == ((3, 3, 3, 1), (3,))
    want = dtypes.tensor_as_numpy(zoo.expected_all()["uneven"])
    assert lazy.compute().tobytes() == want.tobytes()
    assert float(lazy.astype(np.float32).sum().compute()) == pytest.approx(float(want.astype(np.float32).sum()))


def test_entry_points_are_declared_and_load_in_a_fresh_process(tmp_path):
    path = str(tmp_path / "c")
    tsckpt.save({"dtypes": {"bfloat16": torch.ones(8, 3, dtype=torch.bfloat16)}}, path, layout="plain")  # zarr alone
    declared = {e.name: e.value for e in entry_points(group="zarr.data_type")}
    for cls in zd.DATA_TYPES:
        assert declared.get(cls._zarr_v3_name) == f"tsckpt.format.zarr_dtypes:{cls.__name__}"
    # The process imports only zarr; the types come from the installed entry points.
    code = textwrap.dedent(f"""
        import sys, zarr
        from zarr.core.dtype import data_type_registry
        assert "tsckpt" not in sys.modules
        data_type_registry._lazy_load()  # zarr 3.1 collects entry points but leaves loading to callers
        a = zarr.open_group({path!r}, mode="r")["dtypes/bfloat16"][:]
        print(a.dtype, a.shape)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "bfloat16 (8, 3)"


@pytest.mark.parametrize("cls", zd.DATA_TYPES, ids=lambda c: c._zarr_v3_name)
def test_data_type_json_round_trip(cls):
    native = np.dtype(getattr(ml_dtypes, cls._zarr_v3_name))
    dt = zarr.core.dtype.get_data_type_from_json(cls._zarr_v3_name, zarr_format=3)
    assert isinstance(dt, cls) and dt.to_native_dtype() == native
    assert dt.to_json(3) == cls._zarr_v3_name
    assert zarr.core.dtype.parse_dtype(native, zarr_format=3) == dt
    assert hasattr(dt, "endianness") == (native.itemsize > 1)
    for value in (1.5, "NaN", 0.0):
        scalar = dt.from_json_scalar(value, zarr_format=3)
        back = dt.from_json_scalar(dt.to_json_scalar(scalar, zarr_format=3), zarr_format=3)
        assert scalar.tobytes() == back.tobytes()
    hex_one = "0x" + np.array(1.0, dtype=native).tobytes()[::-1].hex()
    assert float(dt.from_json_scalar(hex_one, zarr_format=3)) == 1.0


def test_zarr_python_writes_and_reads_bf16(tmp_path):
    data = np.linspace(-3, 3, 24, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(4, 6)
    arr = zarr.create_array(str(tmp_path / "a"), shape=data.shape, chunks=(2, 3), dtype=data.dtype, fill_value=0)
    arr[...] = data
    doc = (tmp_path / "a" / "zarr.json").read_text()
    assert '"data_type": "bfloat16"' in doc
    assert zarr.open_array(str(tmp_path / "a"), mode="r")[...].tobytes() == data.tobytes()


def test_import_tsckpt_registers_through_zarrs_registry_and_keeps_a_type_zarr_has():
    code = textwrap.dedent("""
        import sys, zarr
        from zarr.dtype import data_type_registry
        from zarr.dtype import Float16

        class Theirs(Float16):
            _zarr_v3_name = "bfloat16"

        data_type_registry.register("bfloat16", Theirs)
        import tsckpt.format.zarr_dtypes as zd
        print(data_type_registry.get("bfloat16").__name__, data_type_registry.get("float8_e5m2") is zd.Float8E5M2)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    theirs, ours = res.stdout.split()
    assert ours == "True"
    # zarr 3.4 loads the installed packages' data-type entry points itself when a name is looked up, and they
    # replace what was registered by hand; before 3.4 only tsckpt registers, and it keeps zarr's.
    if tuple(int(p) for p in zarr.__version__.split(".")[:2]) < (3, 4):
        assert theirs == "Theirs"


def test_the_six_types_are_one_definition():
    assert {cls.__module__ for cls in zd.DATA_TYPES} == {"tsckpt.format.zarr_dtypes"}
    own = {name for cls in zd.DATA_TYPES for name, value in vars(cls).items()
           if inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod, property))}
    assert own == set(), own  # every method is the one definition's
