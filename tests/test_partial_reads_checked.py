"""One flipped byte in a chunk is caught by every read that touches it: resharded loads and small slices too.

A 2-rank, row-sharded float32 checkpoint (default options), one byte flipped
inside one inner chunk; then every way of reading anything of that inner chunk
must raise ``ChecksumError`` (through ``dcp.load``, DCP's wrapper carries its
text), and reads elsewhere must still return the saved values.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import tsckpt
from damage import edit_key, flip_byte
from dist import run_ranks
from tsckpt.errors import ChecksumError
from tsckpt.format import shards

SHAPE = (512, 384)
#: The element whose bytes are damaged: row 1, so `tsckpt show PATH w 0` reads its inner chunk.
AT = (1, 70)
CAUGHT = "does not match its stored crc32c"


def _full() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) / 7


def save_row_sharded(rank, world, path, layout):
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(_full(), mesh, [Shard(0)]),
          "b": distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])}
    tsckpt.save(sd, path, layout=layout)


def load_everywhere(rank, world, path):
    """Each load a 2-rank job can do: the error text it raised, or None when it returned the saved values."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, placement in (("column dcp.load", Shard(1)), ("column tsckpt.load", Shard(1)),
                            ("row dcp.load", Shard(0))):
        sd = {"w": distribute_tensor(torch.zeros(SHAPE), mesh, [placement], src_data_rank=None)}
        try:
            if name.endswith("dcp.load"):
                dcp.load(sd, storage_reader=tsckpt.TensorStoreReader(path))
            else:
                tsckpt.load(sd, path)
            out[name] = None if torch.equal(sd["w"].full_tensor(), _full()) else "wrong values"
        except (ChecksumError, CheckpointException) as e:
            out[name] = str(e)
    return out


@pytest.fixture(scope="module", params=["plain", "packed"])
def saved(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("partial") / "ck"
    run_ranks(2, save_row_sharded, str(path), request.param)
    return path


@pytest.fixture
def damaged(saved, tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    md = tsckpt.open(path).metadata
    entry = md.tensors["w"]
    assert entry.inner_chunk_shape is not None, "the test wants inner chunks"
    fmt = shards.value_format(entry, md.array_options)
    chunk = [a // c for a, c in zip(AT, entry.chunk_shape)]
    local = [a - i * c for a, i, c in zip(AT, chunk, entry.chunk_shape)]
    piece = fmt.positions[np.ravel_multi_index([x // u for x, u in zip(local, fmt.inner)], fmt.grid)]
    within = np.ravel_multi_index([x % u for x, u in zip(local, fmt.inner)], fmt.inner)
    offset = int(piece) * fmt.piece_bytes + int(within) * 4 + 2  # a middle byte of the float
    edit_key(path, f"w/c.{chunk[0]}.{chunk[1]}", lambda data: flip_byte(data, offset, 0x10))
    return path, entry


def _touches(entry, rows: slice, cols: slice) -> bool:
    """Whether a box touches the damaged inner chunk."""
    inner = entry.inner_chunk_shape
    lo = [a // u * u for a, u in zip(AT, inner)]
    return rows.start < lo[0] + inner[0] and lo[0] < rows.stop and cols.start < lo[1] + inner[1] and lo[1] < cols.stop


def test_resharded_and_same_topology_loads_refuse_the_damaged_inner_chunk(damaged):
    path, _ = damaged
    results = run_ranks(2, load_everywhere, str(path))
    for rank, found in enumerate(results):
        for name, error in found.items():
            assert error is not None and CAUGHT in error, (rank, name, error)


def test_every_small_slice_touching_the_byte_is_refused_and_others_read_back(damaged):
    path, entry = damaged
    ck = tsckpt.open(path)
    full = _full().numpy()
    rng = random.Random(0)
    touching = []
    while len(touching) < 160:  # small boxes holding the damaged element
        h, w = rng.randint(1, 4), rng.randint(1, 4)
        r, c = rng.randint(AT[0] - h + 1, AT[0]), rng.randint(AT[1] - w + 1, AT[1])
        if r >= 0 and c >= 0:
            touching.append((slice(r, r + h), slice(c, c + w)))
    for rows, cols in touching:
        with pytest.raises(ChecksumError, match=CAUGHT):
            ck["w"][rows, cols]
    clean = 0
    for _ in range(400):  # and boxes elsewhere, some in the same outer chunk, read back exactly
        r, c = rng.randrange(SHAPE[0] - 4), rng.randrange(SHAPE[1] - 4)
        rows, cols = slice(r, r + rng.randint(1, 4)), slice(c, c + rng.randint(1, 4))
        if _touches(entry, rows, cols):
            with pytest.raises(ChecksumError, match=CAUGHT):
                ck["w"][rows, cols]
        else:
            np.testing.assert_array_equal(ck["w"][rows, cols].numpy(), full[rows, cols])
            clean += 1
    assert clean > 300
    np.testing.assert_array_equal(ck["b"].numpy(), np.arange(12.0, dtype=np.float32).reshape(6, 2))


def _leaves(error: BaseException) -> list[BaseException]:
    """``error`` itself, or every exception an (exception) group of it holds, however nested."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def test_whole_reads_tools_and_zarr_python_refuse_it(damaged, tmp_path):
    path, _ = damaged
    for name, read in {
        "tsckpt.load, one process": lambda: tsckpt.load({"w": torch.zeros(SHAPE), "b": torch.zeros(6, 2)}, path),
        "open numpy": lambda: tsckpt.open(path)["w"].numpy(),
        "one element": lambda: tsckpt.open(path)["w"][AT],
        "to_state_dict": lambda: tsckpt.open(path).to_state_dict(),
        "convert": lambda: tsckpt.convert(path, tmp_path / "out.safetensors"),
        "diff": lambda: tsckpt.diff(path, path),
        "zarr_store slice": lambda: zarr.open_array(tsckpt.zarr_store(path), path="w", mode="r")[0:2, 60:72],
        "zarr_store whole": lambda: zarr.open_array(tsckpt.zarr_store(path), path="w", mode="r")[...],
    }.items():
        with pytest.raises(Exception) as caught:
            read()
            pytest.fail(f"{name} returned")
        # zarr 3.4 and later raise a store's error inside an ExceptionGroup from its coalesced reads.
        # Through zarr_store, zarr-python checks the crc32c codec every chunk carries (format version 4) itself.
        assert any(isinstance(e, ChecksumError) and CAUGHT in str(e)
                   or name.startswith("zarr_store") and "Stored and computed checksum do not match" in str(e)
                   for e in _leaves(caught.value)), f"{name}: {caught.value!r}"
    report = tsckpt.verify(path)
    assert [e.key for e in report.failed] == ["w"] and CAUGHT in report.failed[0].problems[0]
    code = "import sys; from tsckpt.cli import main; sys.argv = ['tsckpt', *sys.argv[1:]]; main()"
    shown = subprocess.run([sys.executable, "-c", code, "show", str(path), "w", "0"], capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode != 0 and CAUGHT in shown.stderr + shown.stdout, shown


def test_a_refused_load_places_no_damaged_value(damaged):
    """Pieces are checked before they are placed: after the error every element is either what the
    destination held before or the saved value, never the damaged one."""
    path, _ = damaged
    sentinel = -1.0
    sd = {"w": torch.full(SHAPE, sentinel), "b": torch.zeros(6, 2)}
    with pytest.raises(ChecksumError, match=CAUGHT):
        tsckpt.load(sd, path)
    got = sd["w"]
    assert bool(((got == sentinel) | (got == _full())).all()), "a damaged value reached the destination"
    assert got[AT] == sentinel
