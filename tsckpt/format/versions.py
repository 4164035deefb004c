"""The format's name and version, and what a reader says of a checkpoint in another version: until 1.0 tsckpt
reads only the version it writes (``docs/format.md``, section 9); tsckpt 0.1 reads versions 1 to 5."""

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
