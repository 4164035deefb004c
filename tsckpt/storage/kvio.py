"""Reading a location's kvstore: JSON documents, key listings, and failures as one-line errors.

TensorStore reports a failed request with its status, the driver's words and
bracketed annotations (request ids, whole HTTP response bodies). A user needs
one line that says what failed, where, and what to change: a missing bucket,
an endpoint that never answered within the retries, a path through a file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import tensorstore as ts

from ..errors import ChecksumError, MetadataError, NotACheckpointError, StorageError, TsckptError
from .hints import hint

#: The environment variable that sets how often a failed S3 request is retried.
S3_RETRIES_ENV = "TSCKPT_S3_RETRIES"


def storage_error(e: Exception, doing: str) -> TsckptError:
    """One clear line for a TensorStore storage failure; ``doing`` says what failed and where."""
    text = str(e)
    remedy = hint(text)
    if remedy:  # waiting longer would not help: say what to change
        return StorageError(f"{doing}: {problem(text)}; {remedy}")
    if _RETRIES.search(text):
        return StorageError(f"{doing}: {problem(text)}; on S3, set {S3_RETRIES_ENV} or the location's context "
                            f"'s3_request_retries' to wait longer")
    if "DATA_LOSS" in text:  # a checksum TensorStore checks itself failed (an OCDBT manifest or B+tree node)
        return ChecksumError(f"{doing}: the stored data is damaged ({one_line(text)})")
    if "NoSuchBucket" in text:
        return StorageError(f"{doing}: the bucket does not exist")
    if "non-directory" in text or "Not a directory" in text:
        return NotACheckpointError(f"{doing}: a part of the path is a file, not a directory")
    return StorageError(f"{doing}: {one_line(text)}")


_RETRIES = re.compile(r"All (\d+) retry attempts failed: ")


def problem(e: Exception | str) -> str:
    """What went wrong in a TensorStore I/O error, in a few words.

    "no space left on device" for an operating-system error (the file it names
    is a chunk of a save's staging area, which tells a user nothing the tensor's
    name does not); "gave up after 6 retries (SlowDown: ...)" for a request
    that kept failing; else the error's first line without annotations.
    """
    if isinstance(e, OSError) and e.errno is not None:  # tsckpt's own file calls (byte_writes)
        reason = os.strerror(e.errno)
        return reason[:1].lower() + reason[1:]
    text = str(e)
    code = re.search(r"\[os_error_code='?(\d+)'?\]", text)
    if code:
        reason = os.strerror(int(code.group(1)))
        return reason[:1].lower() + reason[1:]
    retries = _RETRIES.search(text)
    if retries:
        n = int(retries.group(1))
        last = one_line(text[retries.end():])
        status = re.search(r"\[http_response_code='?(\d+)'?\]", text)
        if status and last in ("", "Unknown"):
            last = f"HTTP {status.group(1)}"
        return f"gave up after {n} retr{'y' if n == 1 else 'ies'} ({last})"
    return one_line(text)


def one_line(e: Exception | str) -> str:
    """TensorStore's error text without its bracketed annotations (request ids, response bodies...)."""
    text = re.split(r" \[[a-z_]+=", str(e), maxsplit=1)[0]
    return " ".join(text.split())


def read_json(kv: ts.KvStore, key: str, *, where: str | None = None, max_bytes: int | None = None) -> Any | None:
    """The parsed JSON at ``key``, or None when the key does not exist.

    ``where`` names the location in messages. With ``max_bytes``, a larger
    value is refused (:class:`~tsckpt.errors.MetadataError`) before it is read.
    A storage failure (missing bucket, refused credentials, unreachable
    endpoint) raises :class:`~tsckpt.errors.StorageError`; bytes that are not
    strict JSON (NaN and Infinity included) raise ``ValueError``.
    """
    where = where if where is not None else kv_name(kv)
    try:
        if max_bytes is not None and _longer_than(kv, key, max_bytes):
            raise MetadataError(f"{where}/{key} is larger than {max_bytes} bytes, the most a reader accepts")
        result = kv.read(key).result()
    except ValueError as e:
        raise storage_error(e, f"cannot read {key!r} at {where}") from None
    if result.state != "value":
        return None
    return json.loads(result.value, parse_constant=_not_json)


def _longer_than(kv: ts.KvStore, key: str, size: int) -> bool:
    """Whether the value at ``key`` holds more than ``size`` bytes, reading one byte at most."""
    try:
        return kv.read(key, byte_range=slice(size, size + 1)).result().state == "value"
    except ValueError as e:
        if "OUT_OF_RANGE" in str(e):
            return False
        raise


def _not_json(token: str) -> Any:
    raise ValueError(f"{token} is not valid JSON")


def list_keys(kv: ts.KvStore, where: str) -> list[bytes]:
    """Every key under ``kv``, or a :class:`~tsckpt.errors.StorageError` naming ``where``."""
    try:
        return list(kv.list().result())
    except ValueError as e:
        raise storage_error(e, f"cannot list {where}") from None


def kv_name(kv: ts.KvStore) -> str:
    try:
        return kv.url
    except Exception:  # noqa: BLE001 - some drivers (s3 with a custom endpoint) have no URL form
        return repr(kv.spec().to_json())


def encode_json(doc: Any) -> bytes:
    # Compact: the root document of a large save is megabytes, read by every rank.
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """The range of keys starting with ``prefix`` (every key when it is empty)."""
    if not prefix:
        return ts.KvStore.KeyRange()
    # UTF-8 keeps code point order, so bumping the last character bounds every key under the prefix.
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
