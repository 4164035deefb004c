"""Reading a location's kvstore: JSON documents, key listings, and failures as one-line errors that say what
failed, where, and (:func:`hint`, for an object store) which setting to look at, rather than TensorStore's status
with its annotations (request ids, whole HTTP response bodies).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from ..errors import ChecksumError, MetadataError, NotACheckpointError, StorageError, TsckptError
from . import credentials

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
    """What went wrong in a TensorStore I/O error, in a few words: "no space left on device" for an operating-system
    error (the file it names tells a user nothing the tensor's name does not); "gave up after 6 retries
    (SlowDown: ...)" for a request that kept failing; else the error's first line without annotations."""
    text = str(e)
    code = re.search(r"\[os_error_code='?(\d+)'?\]", text)
    # tsckpt's own file calls (byte_writes) raise OSError; TensorStore's name the error code.
    number = e.errno if isinstance(e, OSError) and e.errno is not None else int(code.group(1)) if code else None
    if number is not None:
        reason = os.strerror(number)
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
    """The parsed JSON at ``key``, or None when the key does not exist; ``where`` names the location in messages.

    With ``max_bytes``, a larger value is refused (:class:`~tsckpt.errors.MetadataError`) before it is read. A
    storage failure raises :class:`~tsckpt.errors.StorageError`; bytes that are not strict JSON raise ValueError.
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


#: The ways to point an ``s3://`` location at another S3 server, for messages.
ENDPOINT_SETTINGS = "AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or 'endpoint' in a JSON location"
#: S3's error codes for a request whose signature or identity was refused.
_REFUSED = re.compile(r"\b(AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken|"
                      r"AuthorizationHeaderMalformed)\b")
#: How TensorStore reports HTTP 401 and 403 when the response names no S3 error code (``PERMISSION_DENIED:
#: Unknown``, as for an unsigned request without credentials).
_DENIED = re.compile(r"\b(PERMISSION_DENIED|UNAUTHENTICATED)\b")
#: A local file's refusal (``[os_error_code=13]``): permissions on disk, nothing credentials change.
_OS_ERROR = re.compile(r"os_error_code|OS error")
#: How TensorStore reports a credentials source that gave none (environment variables missing, a metadata
#: service or container endpoint that does not answer).
_NO_CREDENTIALS = re.compile(r"Failed to (get credentials from|create credentials) provider")
#: S3 responses carry Amazon's request-id headers; other stores' (GCS) do not.
_S3_RESPONSE = re.compile(r"x-amzn?-", re.IGNORECASE)


def hint(text: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """What to check, for a failed object-store request whose error text is ``text``; None if nothing specific."""
    host = re.search(r"Could not resolve host: ([^\s;:()\]]+)", text)
    if host:
        where = host.group(1)
        if where.endswith("amazonaws.com"):
            missing = "" if credentials.resolve(environ).source else (
                "; no AWS credentials were found either (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or AWS_PROFILE)")
            return (f"cannot resolve {where}: without an endpoint, s3:// goes to AWS; to reach another S3 "
                    f"server set {ENDPOINT_SETTINGS}{missing}")
        return f"cannot resolve {where}: check the endpoint's host name and the network"
    refused = re.search(r"Failed to connect to (\S+) port (\d+)", text)
    if refused:
        return f"nothing answers at {refused.group(1)}:{refused.group(2)}: check the endpoint ({ENDPOINT_SETTINGS})"
    if _NO_CREDENTIALS.search(text):
        source = credentials.resolve(environ).source or "the source named in the location's context"
        return (f"no AWS credentials from {source}: check them, or name another source as the location's "
                f"context resource aws_credentials")
    denied = _DENIED.search(text) is not None and _OS_ERROR.search(text) is None
    if _REFUSED.search(text) or (denied and _S3_RESPONSE.search(text)):
        source = credentials.resolve(environ).source
        found = f"using {source}" if source else ("none found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                                  "or AWS_PROFILE")
        return f"the store refused the request: check the credentials ({found}) and the endpoint"
    if denied:
        return "the store refused the request: check the credentials and the endpoint"
    return None
