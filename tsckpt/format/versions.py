"""The format's name and version, and what a reader says of a checkpoint in another version.

Until 1.0 tsckpt reads only the version it writes (``docs/format.md``,
section 9): one reader, checked against the one writer, instead of a reader
per version no release still writes. A checkpoint of an older version names
the release that reads it, whose ``tsckpt convert`` turns it into a
safetensors file this one converts back.

* versions 1 to 5: read by tsckpt 0.1, which wrote version 5;
* version 6 records which rank saved each chunk (``writers``) and keeps each rank's chunk table
  (:mod:`tsckpt.format.chunk_table`) beside its data, so a reader reads the metadata of the chunks it
  reads, not the whole index; ``data_files.index`` names the index's root node.
"""

from __future__ import annotations

FORMAT = "tsckpt"
FORMAT_VERSION = 6
#: The release that reads every version before :data:`FORMAT_VERSION`.
OLDER_VERSIONS_READER = "tsckpt 0.1"


def refusal(version: int) -> str:
    """Why a document of format ``version`` (not :data:`FORMAT_VERSION`) is not read, and what reads it."""
    said = f"format version {version} is not supported by this tsckpt (it reads version {FORMAT_VERSION} only)"
    if version > FORMAT_VERSION:
        return f"{said}; a newer tsckpt reads it"
    if version >= 1:
        return (f"{said}; {OLDER_VERSIONS_READER} reads it: there, `tsckpt convert CKPT out.safetensors`, then "
                f"here `tsckpt convert out.safetensors NEW`")
    return said
