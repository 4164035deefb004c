"""Pure planning and metadata logic: no files, no ranks."""

import math

import pytest

from tsckpt import errors
from tsckpt.format import object_values, writers
from tsckpt.format import inner_chunks
from tsckpt.format.grid import ChunkGrid, aligned_chunk_shape, check_tiling
from tsckpt.format.names import escape_name, parent_groups, zarr_path
from tsckpt.format.data_files import DataFiles, RankFiles, Span
from tsckpt.format.metadata import ArrayOptions, CheckpointMetadata, TensorEntry


def rows(*sizes, cols=4):
    out, off = [], 0
    for s in sizes:
        out.append(((off, 0), (s, cols)))
        off += s
    return out


@pytest.mark.parametrize(
    "shape, boxes, chunk",
    [
        ((8, 4), rows(2, 2, 2, 2), (2, 4)),            # even Shard(0)
        ((10, 4), rows(3, 3, 3, 1), (3, 4)),           # torch.chunk uneven: ceil(10/4)
        ((3, 4), rows(1, 1, 1, 0), (1, 4)),            # zero-size shard
        ((10, 4), rows(3, 2, 3, 2), (1, 4)),           # nested Shard(0)+Shard(0): irregular
        ((10, 4), rows(2, 1, 3, 3, 1), (1, 4)),        # enumerable spec, arbitrary boundaries
        ((12, 4), rows(4, 4, 2, 2), (2, 4)),           # irregular but gcd 2
        ((6, 8), [((r, c), (3, 4)) for r in (0, 3) for c in (0, 4)], (3, 4)),  # 2-D mesh
        ((), [((), ())], ()),                          # 0-d
        ((0, 3), [((0, 0), (0, 3))], (1, 3)),          # empty tensor
    ],
)
def test_grid_aligned_to_every_region(shape, boxes, chunk):
    assert aligned_chunk_shape(shape, boxes) == chunk
    check_tiling("t", shape, boxes)
    # Each chunk lies inside exactly one non-empty region: no chunk has two writers.
    owners = {}
    for i, (o, s) in enumerate(boxes):
        for idx in ChunkGrid(shape, chunk).chunks_overlapping([slice(a, a + b) for a, b in zip(o, s)]):
            assert idx not in owners, f"chunk {idx} written by regions {owners[idx]} and {i}"
            owners[idx] = i
            lo = [k * c for k, c in zip(idx, chunk)]
            assert all(o_ <= l and l + c <= o_ + s_ or l + c > n for o_, s_, l, c, n in zip(o, s, lo, chunk, shape))
    assert len(owners) == math.prod(-(-n // c) for n, c in zip(shape, chunk)) or math.prod(shape) == 0


@pytest.mark.parametrize("shape, chunk, offsets, sizes", [
    ((10, 6), (3, 4), (3, 0), (6, 6)),  # interior rows, the edge column chunk
    ((10, 6), (3, 4), (9, 4), (1, 2)),  # the corner chunk, clipped at both edges
    ((7,), (2,), (0,), (7,)),
    ((4, 5, 6), (2, 5, 3), (2, 0, 3), (2, 5, 3)),
    ((), (), (), ()),  # a 0-d array's one chunk
    ((0, 4), (1, 4), (0, 0), (0, 4)),  # no elements: no chunks
])
def test_flat_indices_within_lists_the_chunks_of_chunks_within(shape, chunk, offsets, sizes):
    grid = ChunkGrid(shape, chunk)
    expected = [grid.flat_index(index) for index, _ in grid.chunks_within(offsets, sizes)]
    assert grid.flat_indices_within(offsets, sizes).tolist() == expected


def test_tiling_rejects_overlap_gap_and_out_of_bounds():
    with pytest.raises(errors.PlanError, match="'w'.*overlap|'w'.*exactly once"):
        check_tiling("w", (4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))])
    with pytest.raises(errors.PlanError, match="exactly once"):
        check_tiling("w", (4, 4), [((0, 0), (2, 4))])
    with pytest.raises(errors.PlanError, match="outside"):
        check_tiling("w", (4, 4), [((0, 0), (5, 4))])


def _torch_chunk(n, k):
    size = -(-n // k)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


@pytest.mark.parametrize("shape, world, meets", [
    ((50257, 1280), 4, False), ((3413, 1280), 4, True), ((1280, 3413), 4, True), ((4096, 4096), 8, True),
    ((4096, 14336), 8, True), ((128256, 4096), 8, True),
    ((50257, 384), 4, False), ((1280, 3413), 3, False), ((384, 1024), 4, False), ((1000, 1000), 1, False),
    ((12569, 64), 2, False)])
@pytest.mark.parametrize("bands", [False, True], ids=["local", "banded"])
def test_inner_chunks_keep_every_split_near_what_it_needs(shape, world, meets, bands):
    """Loads into 2, 3, 4 or 8 ranks along either dimension fetch at most 1.2x per rank, where the floor allows.

    They do not where 16 KiB inner chunks are too coarse for 8-way splits (tensors of a few MB),
    where a tensor's 1024 inner chunks at most are (a [50257, 384] vocabulary), or where the save's
    rank boundaries leave the outer chunk only large prime factors (3413 rows on 3 ranks: 1138 = 2 x 569);
    those still fetch well under what whole outer chunks would.
    """
    boxes = [((a, 0), (b - a, shape[1])) for a, b in _torch_chunk(shape[0], world)]
    chunk = aligned_chunk_shape(shape, boxes)
    outer, inner = inner_chunks.choose(shape, chunk, 2, min_bytes=16 << 10, max_bytes=16 << 20, bands=bands)
    assert inner is not None and all(o % i == 0 for o, i in zip(outer, inner))
    # A dimension ranks cut keeps its aligned chunk. One they do not is, with bands, one inner chunk wide where
    # another dimension is cut (bands of a rank's region, of 4 KiB at least), else rounded up to whole inner
    # chunks.
    band = math.prod(c if c < n else i for c, n, i in zip(chunk, shape, inner)) * 2
    banded = bands and any(c < n for c, n in zip(chunk, shape)) and band >= inner_chunks.MIN_BAND_BYTES
    assert all(o == c if c < n else (o == i if banded else n <= o < n + i)
               for o, c, n, i in zip(outer, chunk, shape, inner))
    floor = min(16 << 10, max(inner_chunks.MIN_PIECE_BYTES, math.prod(chunk) * 2 // inner_chunks.SMALL_PIECES))
    assert floor <= math.prod(inner) * 2 <= 16 << 20
    assert math.prod(-(-n // i) for n, i in zip(shape, inner)) <= max(inner_chunks.MAX_PER_TENSOR,
                                                                     math.prod(-(-n // c) for n, c in zip(shape, chunk)))
    fine = [inner_chunks.over_read(n, i) for n, i in zip(shape, inner)]
    if meets:
        assert max(fine) <= inner_chunks.TARGET_RATIO, (inner, fine)
    else:
        assert max(fine) < 0.5 * max(inner_chunks.over_read(n, c) for n, c in zip(shape, chunk)), (inner, fine)
    # Check over_read itself against a direct count for one split.
    for k in inner_chunks.SPLITS:
        for a, b in _torch_chunk(shape[1], k):
            got = inner_chunks.fetched(shape[1], inner[1], a, b)
            assert got == (min(-(-b // inner[1]) * inner[1], shape[1]) - a // inner[1] * inner[1])
            assert got / (b - a) <= inner_chunks.over_read(shape[1], inner[1]) + 1e-12


def test_small_chunks_stay_whole_and_prime_dimensions_are_still_cut():
    assert inner_chunks.choose((8, 16), (8, 16), 4, min_bytes=16 << 10) == ((8, 16), None)  # 512 bytes
    outer, inner = inner_chunks.choose((96, 384), (24, 384), 2, min_bytes=16 << 10)  # a small shard: 18 KiB
    assert inner is not None and math.prod(inner) * 2 >= 18 << 10 >> 4 and outer[0] == 24
    assert inner_chunks.choose((512, 512), (128, 512), 4, min_bytes=0) == ((128, 512), None)  # 0 disables
    outer, inner = inner_chunks.choose((3, 40999), (3, 40999), 4, min_bytes=4096)
    assert inner is not None and inner[1] < 40999 and outer[1] % inner[1] == 0 and outer[1] >= 40999
    assert inner_chunks.over_read(40999, inner[1]) <= inner_chunks.TARGET_RATIO


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "/abs", "zarr.json", "__x", "%", "ü", "a\\b", ".hidden"])
def test_escaped_names_are_single_safe_components(name):
    out = escape_name(name)
    assert out not in ("", ".", "..", "zarr.json") and "/" not in out and "\\" not in out
    assert not out.startswith(("__", "."))
    assert all(ch.isascii() for ch in out)


def test_escaping_is_injective_and_paths_nest():
    names = ["a", "A", "a%2F", "a/", "%", "%25", "..", "%2E%2E", "x y"]
    assert len({escape_name(n) for n in names}) == len(names)
    assert zarr_path(("model", "layers.0.w")) == "model/layers.0.w"
    assert zarr_path(("optim", "state", 0, "exp_avg")) == "optim/state/0/exp_avg"
    assert parent_groups(["a/b/c", "a/d", "e"]) == ["", "a", "a/b"]


@pytest.mark.parametrize("value", [
    None, True, 3, -2.5, "s", [1, [2, 3]], (0.9, 0.999), {"lr": 0.1, "betas": (0.9, 0.99)},
    {1: "x", 2: [3]}, {"$x": 1}, float("inf"), [float("nan")], {(1, 2): "tuple key"},
])
def test_json_values_round_trip_exactly(value):
    back = object_values.from_json(object_values.to_json(value))
    if value == value and not (isinstance(value, list) and value and value[0] != value[0]):
        assert back == value and type(back) is type(value)
    else:
        assert repr(back) == repr(value)


def test_non_json_values_are_refused_by_the_json_encoding():
    assert object_values.encode(object())[0] == object_values.TORCH
    assert object_values.encode({"a": {1, 2}})[0] == object_values.TORCH
    assert object_values.encode({"a": (1, 2)}) == (object_values.JSON, {"a": {"$tuple": [1, 2]}})


def entry(**kw):
    base = dict(key_path=("m", "w"), path="m/w", shape=(4, 2), dtype="float32", chunk_shape=(2, 2),
                inner_chunk_shape=None, placement=None, writers=writers.encode([0, 1]))
    return TensorEntry(**(base | kw))


def _metadata(**kw) -> CheckpointMetadata:
    """A document of the current version, two ranks: plain layout, each rank with a chunk table of its own."""
    ranks = tuple(RankFiles((), Span(f"d/{'0' * 32}-{r}.table", 0, 40)) for r in range(2))
    return CheckpointMetadata(world_size=2, tensors={"m.w": entry()}, objects={}, data_files=DataFiles(None, ranks),
                              array_options=ArrayOptions(crc32c_codec=True), **kw)


def test_metadata_round_trips_through_json():
    md = _metadata()
    assert CheckpointMetadata.from_dict(md.to_dict()) == md


@pytest.mark.parametrize("bad, message", [
    (dict(path="../w"), "safe relative path"),
    (dict(path="m/x"), "does not match key path"),
    (dict(dtype="float99"), "unknown data type"),
    (dict(chunk_shape=(2,)), "wrong rank"),
    (dict(chunk_shape=(8, 2)), "larger than shape"),
    (dict(inner_chunk_shape=(3, 2)), "larger than chunk_shape"),
])
def test_metadata_validation_names_the_tensor(bad, message):
    doc = _metadata().to_dict()
    doc["tensors"]["m.w"] = entry(**bad).to_dict()
    with pytest.raises(errors.TsckptError, match=message) as info:
        CheckpointMetadata.from_dict(doc)
    assert "m.w" in str(info.value) or "checkpoint metadata" in str(info.value)


def test_metadata_refuses_the_per_chunk_tables_of_older_versions():
    doc = _metadata().to_dict()
    doc["tensors"]["m.w"]["checksums"] = "A" * 8  # versions 2 and 3 kept a crc32c table per tensor here
    with pytest.raises(errors.MetadataError, match="tensor 'm.w': holds per-chunk tables"):
        CheckpointMetadata.from_dict(doc)


def test_metadata_refuses_newer_format_versions():
    doc = CheckpointMetadata(world_size=1, tensors={}, objects={}).to_dict()
    doc["version"] = 99
    with pytest.raises(errors.MetadataError, match="version 99"):
        CheckpointMetadata.from_dict(doc)


#: The examples of docs/format.md, section 5: (shape, dtype, boxes, bands) -> (chunk_shape, inner_chunk_shape).
FORMAT_EXAMPLES = [
    ((250, 128), "float32", [((a, 0), (b - a, 128)) for a, b in [(0, 63), (63, 126), (126, 189), (189, 250)]],
     False, (63, 128), (21, 32)),
    ((4096, 4096), "bfloat16", [((0, a), (4096, 512)) for a in range(0, 4096, 512)], False, (4096, 512), (256, 256)),
    ((4096, 4096), "bfloat16", [((0, a), (4096, 512)) for a in range(0, 4096, 512)], True, (256, 512), (256, 256)),
    ((1024, 1024), "bfloat16", [((i, j), (512, 512)) for i in (0, 512) for j in (0, 512)], False, (512, 512),
     (64, 128)),
    ((50257, 256), "bfloat16", [((0, 0), (50257, 256))], False, (50266, 256), (1226, 16)),
    ((4, 10), "float32", [((0, a), (4, b - a)) for a, b in [(0, 3), (3, 6), (6, 9), (9, 10)]], False, (4, 3), None),
    ((1024, 1024), "bfloat16", [((a, 0), (16, 1024)) for a in range(0, 1024, 16)], True, (16, 1024), (16, 64)),
]


@pytest.mark.parametrize("shape, dtype, boxes, bands, chunk, inner", FORMAT_EXAMPLES)
def test_the_chunk_shapes_format_md_shows_are_the_ones_written(shape, dtype, boxes, bands, chunk, inner):
    from tsckpt.format.plan import plan_tensor

    entry = plan_tensor("t", ("t",), shape, dtype, boxes, bands=bands)
    assert (entry.chunk_shape, entry.inner_chunk_shape) == (chunk, inner)
