"""A rank's chunk table and a tensor's writers, as bytes: what a reader finds, reads and refuses."""

from __future__ import annotations

import numpy as np
import pytest

from tsckpt.errors import ChecksumError, MetadataError
from tsckpt.format import chunk_table, writers
from tsckpt.format.chunk_table import ChunkTable, TableReader, array_key, look_up


def _table(arrays: int, per: int, hashed: bool = True) -> bytes:
    paths, chunks, where, digests = [], [], [], []
    for i in range(arrays):
        for c in range(per):
            paths.append(f"model/layers.{i}.w")
            chunks.append(c)
            where.append((i % 2, 1000 * i + c, 10 + c))
            digests.append(bytes([i % 256, c % 256]) * 8)
    return ChunkTable.of(paths, chunks, files=["d/x-0", "d/y-0"], where=where,
                         digests=digests if hashed else None).encode()


def _reader(data: bytes, whole_up_to: int = 0) -> tuple[TableReader, list[list[tuple[int, int]]], object]:
    raw = np.frombuffer(data, np.uint8)
    calls: list[list[tuple[int, int]]] = []

    def read(spans):
        calls.append([(o, n) for _, o, n in spans])
        return [raw[o:o + n] for _, o, n in spans]

    return TableReader(len(data), "rank 0's table", whole_up_to), calls, read


def test_a_few_keys_read_the_front_and_their_blocks_only():
    data = _table(3000, 2)
    table, calls, read = _reader(data)
    key = (array_key("model/layers.1234.w"), 1)
    rows = look_up({table: [key]}, read)[table]
    row = rows.get("model/layers.1234.w", 1)
    assert (rows.files[int(row["file"])], int(row["offset"]), int(row["length"])) == ("d/x-0", 1234001, 11)
    assert row["digest"].tobytes() == bytes([1234 % 256, 1]) * 8
    assert rows.get("model/layers.1234.w", 2) is None and rows.get("model/other", 0) is None
    # The front (64 KiB, which may hold the block), then the block: never the whole table.
    assert len(calls) <= 2 and table.bytes_read < len(data) // 3


def test_a_small_table_is_read_whole_in_one_request():
    data = _table(20, 3)
    table, calls, read = _reader(data, whole_up_to=1 << 20)
    rows = look_up({table: [(array_key(f"model/layers.{i}.w"), 2) for i in range(20)]}, read)[table]
    assert calls == [[(0, len(data))]]
    assert all(rows.get(f"model/layers.{i}.w", 2) is not None for i in range(20))


def test_every_row_comes_back_sorted_and_a_table_without_digests_or_places_reads_too():
    data = _table(300, 4, hashed=False)
    table, _, read = _reader(data)
    look_up({table: ()}, read)
    rows = look_up({table: table.every_key()}, read)[table].records
    assert len(rows) == 1200 and not ChunkTable((), False, rows).hashed
    keys = list(zip(rows["array"].tolist(), rows["chunk"].tolist()))
    assert keys == sorted(keys)
    plain = ChunkTable.of(["a", "b"], [0, 3], digests=[bytes(16), bytes(16)]).encode()
    table, _, read = _reader(plain)
    rows = look_up({table: [(array_key("b"), 3)]}, read)[table]
    assert rows.get("b", 3) is not None and rows.files == ()


def test_a_flipped_byte_in_a_block_or_the_directory_is_refused():
    data = bytearray(_table(3000, 2))
    last = len(data) - 5  # inside the last block
    data[last] ^= 1
    table, _, read = _reader(bytes(data))
    look_up({table: ()}, read)
    with pytest.raises(ChecksumError, match="block .* does not match its crc32c"):
        look_up({table: table.every_key()}, read)
    data[last] ^= 1
    data[40] ^= 1  # in the header or directory
    table, _, read = _reader(bytes(data))
    with pytest.raises((ChecksumError, MetadataError)):
        look_up({table: [(array_key("model/layers.0.w"), 0)]}, read)


def test_a_table_cut_short_is_refused():
    data = _table(300, 2)
    table, _, read = _reader(data[:-100])
    with pytest.raises(MetadataError, match="another number of rows"):
        look_up({table: [(array_key("model/layers.0.w"), 0)]}, read)


def test_one_rank_cannot_hold_two_values_of_one_key():
    with pytest.raises(MetadataError, match="share the key"):
        ChunkTable.of(["a", "a"], [1, 1])


def test_writers_round_trip_compactly_and_refuse_what_does_not_fit():
    banded = np.repeat(np.arange(10000), 3)
    field = writers.encode(banded)
    assert len(field) < 1000  # 30,000 chunks of 10,000 ranks: a few hundred bytes
    assert np.array_equal(writers.decode(field, 30000, 10000, "w"), banded)
    with pytest.raises(MetadataError, match="one rank for each of the array's 29999 chunks"):
        writers.decode(field, 29999, 10000, "w")
    with pytest.raises(MetadataError, match="outside the 9999 that saved"):
        writers.decode(field, 30000, 9999, "w")
    with pytest.raises(MetadataError, match="not base64 of a zlib stream"):
        writers.decode("not base64!", 1, 1, "w")
    assert chunk_table.array_key("a") != chunk_table.array_key("b")
