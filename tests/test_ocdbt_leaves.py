"""Leaves encoded from whole-index columns decode to exactly the entries they were built from."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tsckpt.format import ocdbt, ocdbt_keys, ocdbt_leaves, ocdbt_records, ocdbt_tree


def _walk(tree: ocdbt_tree.Tree, ref: ocdbt.Ref, out: list) -> None:
    node = ocdbt.decode_node(tree.nodes[ref.offset:ref.offset + ref.length], "test")
    if node.height:
        for child in node.values:
            _walk(tree, child, out)
    else:
        out += zip(node.keys, node.values)


@pytest.mark.parametrize("node_bytes", [100, 2000, 1 << 20])
def test_a_tree_of_many_files_and_inline_values_reads_back_entry_for_entry(node_bytes):
    rng = random.Random(node_bytes)
    files = [f"d/save-{r}" for r in range(300)]
    keys = sorted({f"m{rng.randrange(50)}/c/{rng.randrange(1000)}/{rng.randrange(3)}".encode() for _ in range(3000)}
                  | {f"m{k}/zarr.json".encode() for k in range(50)})
    values = [rng.randbytes(rng.randrange(0, 40)) if k.endswith(b"zarr.json") or rng.random() < 0.02
              else ocdbt.Ref(rng.choice(files), rng.randrange(1 << 40), rng.randrange(1, 1 << 20)) for k in keys]
    tree = ocdbt_tree.build_tree(ocdbt.Entries.of(keys, values), path="d/index", max_node_bytes=node_bytes)
    found: list = []
    _walk(tree, tree.root, found)
    assert found == list(zip(keys, values))
    assert tree.stats.num_keys == len(keys)
    assert tree.stats.num_indirect_value_bytes == sum(v.length for v in values if isinstance(v, ocdbt.Ref))
    assert tree.height >= 2 if node_bytes < 1 << 20 else tree.height == 0


@pytest.mark.parametrize("spill_bytes", [1, 3000])
def test_a_tree_spilled_as_it_is_built_is_the_same_file(spill_bytes, monkeypatch):
    rng = random.Random(spill_bytes)
    keys = sorted({f"m{rng.randrange(20)}/c/{rng.randrange(500)}".encode() for _ in range(2000)})
    values = [rng.randbytes(8) if rng.random() < 0.05 else ocdbt.Ref("d/s-0", rng.randrange(1 << 30), 64)
              for _ in keys]
    whole = ocdbt_tree.build_tree(ocdbt.Entries.of(keys, values), "d/index", 500, head=b"head")
    monkeypatch.setattr(ocdbt_tree, "_SPILL_BYTES", spill_bytes)
    spilled = bytearray()
    tree = ocdbt_tree.build_tree(ocdbt.Entries.of(keys, values), "d/index", 500, head=b"head",
                                 spill=spilled.extend)
    assert len(spilled) > len(whole.nodes) // 2 and bytes(spilled + tree.nodes) == bytes(whole.nodes)
    assert (tree.root, tree.height, tree.stats) == (whole.root, whole.height, whole.stats) and tree.height >= 2


def test_runs_of_one_grid_make_the_same_columns_as_their_keys_one_by_one():
    tails, order = ocdbt_keys.sorted_tails([f"c/{i}/{j}".encode() for i in range(12) for j in range(3)])
    assert [tails.tails[k] for k in range(len(tails))] == sorted(tails.tails)
    assert sorted(order.tolist()) == list(range(36))
    runs = [ocdbt_keys.KeyRun(b"a/", tails), ocdbt_keys.KeyRun(b"a/zarr.json"), ocdbt_keys.KeyRun(b"b/", tails)]
    whole = [b"a/" + t for t in tails.tails] + [b"a/zarr.json"] + [b"b/" + t for t in tails.tails]
    by_run, one_by_one = ocdbt_keys.SortedKeys(runs), ocdbt_keys.SortedKeys.of(whole)
    for name in ("prefix", "length", "rest", "starts"):
        np.testing.assert_array_equal(getattr(by_run, name), getattr(one_by_one, name))
    assert [by_run.key(k) for k in range(len(whole))] == whole


def test_runs_out_of_order_are_refused():
    tails, _ = ocdbt_keys.sorted_tails([b"c/0", b"c/1"])
    with pytest.raises(ValueError, match="out of order"):
        ocdbt_keys.SortedKeys([ocdbt_keys.KeyRun(b"b/", tails), ocdbt_keys.KeyRun(b"a/", tails)])
    with pytest.raises(ValueError, match="out of order"):
        ocdbt_keys.SortedKeys([ocdbt_keys.KeyRun(b"a/", tails), ocdbt_keys.KeyRun(b"a/c/0")])


@pytest.mark.parametrize("template_keys", [2, ocdbt_leaves.TEMPLATE_KEYS])
@pytest.mark.parametrize("node_bytes", [300, 4000, 1 << 20])
def test_arrays_sharing_a_template_read_back_with_their_own_keys_and_offsets(node_bytes, template_keys,
                                                                             monkeypatch):
    monkeypatch.setattr(ocdbt_leaves, "TEMPLATE_KEYS", template_keys)  # runs of 120 keys: templates or loose
    rng = np.random.default_rng(node_bytes)
    grid = [f"c/{i}/{j}".encode() for i in range(40) for j in range(3)]
    tails, order = ocdbt_keys.sorted_tails(grid)
    files = [f"d/save-{r}" for r in range(40)]
    writers = np.repeat(np.arange(40), 3)[order]  # rank i wrote row i, in the run's (sorted) key order
    runs, values = [], []
    for name, shuffled in (("a", False), ("b", False), ("bb", True), ("c", False)):
        file = rng.permutation(writers) if shuffled else writers
        runs.append(ocdbt_keys.KeyRun(f"{name}/".encode(), tails))
        values += [ocdbt.Ref(files[f], int(o), 6) for f, o in zip(file, rng.integers(0, 1 << 33, len(grid)))]
        runs.append(ocdbt_keys.KeyRun(f"{name}/zarr.json".encode()))
        values.append(b'{"node_type": "array"}')
    keys = ocdbt_keys.SortedKeys(runs)
    whole = [keys.key(k) for k in range(len(keys))]
    inline = {k: v for k, v in enumerate(values) if not isinstance(v, ocdbt.Ref)}
    number = {p: i for i, p in enumerate(files)}
    entries = ocdbt.Entries(keys, inline, np.asarray([number[v.path] if isinstance(v, ocdbt.Ref) else -1 for v in values]),
                            np.asarray([v.offset if isinstance(v, ocdbt.Ref) else 0 for v in values]),
                            np.asarray([v.length if isinstance(v, ocdbt.Ref) else 0 for v in values]), files)
    tree = ocdbt_tree.build_tree(entries, path="d/index", max_node_bytes=node_bytes)
    found: list = []
    _walk(tree, tree.root, found)
    assert found == list(zip(whole, values))
    assert tree.stats.num_keys == len(whole)


@pytest.mark.parametrize("block", [7, 1 << 18])
def test_a_column_of_varints_is_each_value_encoded_alone(monkeypatch, block):
    monkeypatch.setattr(ocdbt_records, "_BLOCK", block)
    rng = np.random.default_rng(block)
    for top in [1, 127, 128, 300, 1 << 14, 1 << 21, 1 << 28, 1 << 35, 1 << 49, 1 << 56, 1 << 63, (1 << 64) - 1]:
        values = [0, top - 1, top, min(top + 1, (1 << 64) - 1)] + rng.integers(0, top, 50, np.uint64, True).tolist()
        alone = [ocdbt_records.varint(v) for v in values]
        columns = [np.asarray(values, np.uint64)] + ([np.asarray(values, np.int64)] if top < 1 << 62 else [])
        for column in columns:
            data, starts = ocdbt_records.varint_column(column)
            assert data.tobytes() == b"".join(alone), top
            assert starts.tolist() == np.cumsum([0] + [len(v) for v in alone]).tolist()
            assert ocdbt_records.Reader(data.tobytes(), "test").varints(len(values)) == values


@pytest.mark.parametrize("block", [7, 1 << 18])
def test_a_column_of_varints_all_as_wide_is_each_value_encoded_alone(monkeypatch, block):
    monkeypatch.setattr(ocdbt_records, "_BLOCK", block)
    rng = np.random.default_rng(block)
    for width in range(2, 9):
        low, high = 1 << (7 * (width - 1)), 1 << (7 * width)
        values = [low, high - 1] + rng.integers(low, high, 50, np.uint64).tolist()
        data, starts = ocdbt_records.varint_column(np.asarray(values, np.uint64))
        assert data.tobytes() == b"".join(ocdbt_records.varint(v) for v in values), width
        assert starts.tolist() == list(range(0, width * (len(values) + 1), width))


@pytest.mark.parametrize("top", [1 << 7, 1 << 20, 1 << 40])
@pytest.mark.parametrize("as_wide", [False, True])
def test_a_runs_leaves_are_byte_for_byte_the_leaves_encoded_key_by_key(top, as_wide):
    rng = np.random.default_rng(top)
    tails, _ = ocdbt_keys.sorted_tails([f"c/{i}/{j}".encode() for i in range(300) for j in range(2)])
    files = [f"d/save-{r}" for r in range(50)]
    file, length = rng.integers(0, len(files), len(tails)), rng.integers(1, 1 << 20, len(tails))
    paths = ocdbt_leaves._Paths(files)
    template = None
    for head in (b"a/", b"b/"):  # the second run is encoded from the first's template
        offset = rng.integers(top // 2 if as_wide else 0, top, len(tails))
        run = ocdbt_keys.KeyRun(head, tails)
        template = template or ocdbt_leaves._RunLeaves(run, file, length, paths, 2000)
        out = bytearray(b"before")
        written = template.write(out, run, offset)
        entries = ocdbt.Entries(ocdbt_keys.SortedKeys([run]), {}, file, offset, length, files)
        expected, firsts = bytearray(b"before"), []
        for leaf in ocdbt_leaves.encode_leaves(entries, template.bounds, paths):
            ocdbt_records.envelope_into(expected, ocdbt.BTREE_MAGIC, leaf.body)
            firsts.append(leaf.first)
        assert len(firsts) > 3 and out == expected
        assert written.first == firsts and sum(written.length) == len(out) - written.at
