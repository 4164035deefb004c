"""The format's name and versions: what each version changed, and the first version of each change.

A reader refuses a version above :data:`FORMAT_VERSION` and reads every lower
one (``docs/format.md``, section 9). Each constant below names the first
version with one change, so code that reads older checkpoints asks
``version >= X`` rather than comparing numbers of its own.

* version 1 recorded every rank's region;
* version 2 records one checksum table per tensor instead, so the document grows with tensors, not ranks;
* version 3 checksums every inner chunk (the piece a read fetches) instead of every outer chunk;
* version 4 keeps each inner chunk's crc32c beside it (Zarr's crc32c codec) and each rank's content
  hashes in a table of its own, so the document grows with tensors and ranks, not chunks;
* version 5 stores a chunk's inner chunks with the dimensions no chunk boundary cuts slowest
  (:attr:`tsckpt.format.shards.ShardFormat.order`), so a column block of a row-sharded save is one
  byte range per chunk.
"""

from __future__ import annotations

FORMAT = "tsckpt"
FORMAT_VERSION = 5
#: The first version whose checksum tables cover inner chunks.
INNER_CHECKSUMS_VERSION = 3
#: The first version whose chunks carry their own crc32c and whose root document holds no per-chunk table.
CODEC_CHECKSUMS_VERSION = 4
#: The first version whose chunks store the dimensions no chunk boundary cuts slowest.
UNCUT_FIRST_VERSION = 5
