"""Where a checkpoint is stored: a location, parsed into a TensorStore kvstore spec and context resources.

A path or ``file://`` URL, ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``memory://name``, a kvstore spec dict,
a dict ``{"url": ..., **spec_members}``, or either dict as JSON text. A ``"context"`` member holds context
resources, which go into the one context a rank shares across its arrays (a concurrency limit bounds the whole
save). ``s3://`` URLs honour the AWS environment variables for endpoint and region; credentials never come from
the location.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import LocationError

#: Region used with a custom S3 endpoint when none is given: S3-compatible servers accept any in the signature.
DEFAULT_S3_REGION = "us-east-1"


_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_GCS_BUCKET_PART = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$")


def s3_bucket_problem(name: str) -> str | None:
    """Why ``name`` is not a valid S3 bucket name, or None if it is."""
    if not _S3_BUCKET.match(name):
        return "3 to 63 characters: lowercase letters, digits, '.' and '-', starting and ending with a letter or digit"
    if ".." in name or ".-" in name or "-." in name:
        return "no adjacent '.', '.-' or '-.'"
    if _is_ip_address(name):
        return "not formatted as an IP address"
    if name.startswith("xn--") or name.endswith("-s3alias"):
        return "no 'xn--' prefix or '-s3alias' suffix"
    return None


def gcs_bucket_problem(name: str) -> str | None:
    """Why ``name`` is not a valid Google Cloud Storage bucket name, or None if it is."""
    parts = name.split(".")
    limit = 222 if len(parts) > 1 else 63
    if not 3 <= len(name) <= limit or not all(_GCS_BUCKET_PART.match(p) for p in parts):
        return ("3 to 63 characters (222 with dots, 63 per dot-separated part): lowercase letters, digits, "
                "'-', '_' and '.', each part starting and ending with a letter or digit")
    if name.startswith("goog") or _is_ip_address(name):
        return "no 'goog' prefix and not formatted as an IP address"
    return None


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Scheme:
    """How one URL scheme maps onto a TensorStore kvstore driver."""

    name: str
    driver: str
    #: Whether the first URL component is a bucket (object stores) or part of the path.
    has_bucket: bool
    #: Returns why a bucket name is invalid, or None.
    bucket_problem: Callable[[str], str | None] | None = None
    #: The context resource that bounds this driver's concurrent I/O, if any.
    concurrency_resource: str | None = None
    #: Spec members filled in from the environment when a URL does not give them.
    env_defaults: Callable[[], dict[str, Any]] = dict


def _s3_env_defaults() -> dict[str, Any]:
    found = {"endpoint": os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"),
             "aws_region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")}
    return {k: v for k, v in found.items() if v}


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("file", "file", has_bucket=False, concurrency_resource="file_io_concurrency"),
    Scheme("s3", "s3", has_bucket=True, bucket_problem=s3_bucket_problem, concurrency_resource="s3_request_concurrency",
           env_defaults=_s3_env_defaults),
    Scheme("gs", "gcs", has_bucket=True, bucket_problem=gcs_bucket_problem,
           concurrency_resource="gcs_request_concurrency"),
    Scheme("memory", "memory", has_bucket=False),
)}
_BY_DRIVER = {s.driver: s for s in SCHEMES.values()}


def scheme_for_driver(driver: str) -> Scheme | None:
    """The scheme whose kvstore driver is ``driver`` (None for drivers without a URL scheme)."""
    return _BY_DRIVER.get(driver)


@dataclass(frozen=True)
class Location:
    """The root of a checkpoint: a TensorStore kvstore spec, its context resources (given to
    :func:`~tsckpt.storage.context.make_context`), and tsckpt's own members (:data:`TSCKPT_MEMBERS`)."""

    spec: Mapping[str, Any]
    context: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def driver(self) -> str:
        return str(self.spec.get("driver"))

    @property
    def is_object_store(self) -> bool:
        """Whether the location is in a bucket of an object store, where every request costs tens of ms."""
        scheme = _BY_DRIVER.get(self.driver)
        return scheme is not None and scheme.has_bucket

    @property
    def url(self) -> str:
        """A short human-readable name for messages (``s3://bucket/prefix``, a path...)."""
        scheme = _BY_DRIVER.get(self.driver)
        path = str(self.spec.get("path", ""))
        if self.driver == "file":
            return path.rstrip("/")
        name = scheme.name if scheme else self.driver
        if scheme is not None and not scheme.has_bucket:
            return f"{name}://{path}".rstrip("/")
        return f"{name}://{self.spec.get('bucket', '')}/{path}".rstrip("/")

    def child(self, relpath: str) -> dict[str, Any]:
        """The kvstore spec of a sub-directory (an array or group)."""
        return {**self.spec, "path": f"{self.spec.get('path', '')}{relpath.strip('/')}/"}

    def to_dict(self) -> dict[str, Any]:
        """The full kvstore spec, context and tsckpt's members included (what :func:`parse_location` takes)."""
        out = {**self.spec, **self.options}
        return {**out, "context": dict(self.context)} if self.context else out

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Location:
        return parse_location(doc)


LocationLike = str | os.PathLike[str] | Mapping[str, Any] | Location

#: Members of a location dict that are tsckpt's own, not TensorStore's: how reads are planned.
TSCKPT_MEMBERS = ("read_cost",)


def parse_location(location: LocationLike) -> Location:
    """Turn a path, URL, kvstore spec or ``{"url": ..., **members}`` dict into a :class:`Location`; raises
    :class:`~tsckpt.errors.LocationError` for an unknown scheme, a missing or invalid bucket name, or none."""
    if isinstance(location, Location):
        return location
    if isinstance(location, Mapping):
        members = dict(location)
        options = {k: members.pop(k) for k in TSCKPT_MEMBERS if k in members}
        if options:
            found = parse_location(members)
            return Location(found.spec, found.context, {**found.options, **options})
        context = members.pop("context", None) or {}
        if not isinstance(context, Mapping):
            raise LocationError(f"kvstore spec {location!r}: 'context' must be a dict of context resources")
        if "url" in members:
            url = members.pop("url")
            if "driver" in members:
                raise LocationError(f"location {location!r}: give either 'url' or 'driver', not both")
            base = parse_location(url)
            spec = {**base.spec, **members, "path": base.spec["path"]}
            return _checked(spec, {**base.context, **context}, str(url))
        if "driver" not in members:
            raise LocationError(f"kvstore spec {location!r} has neither 'driver' nor 'url'")
        members["path"] = _as_prefix(str(members.get("path", "")))
        return _checked(members, dict(context), repr(location))
    try:
        text = os.fspath(location)
    except TypeError:
        raise LocationError(f"checkpoint location {location!r} is not a path, URL or kvstore spec") from None
    if not isinstance(text, str):
        raise LocationError(f"checkpoint location {location!r} is not a path, URL or kvstore spec")
    if not text:
        raise LocationError("checkpoint location is empty")
    if text.lstrip().startswith("{"):
        # A spec dict given as JSON text, as the command line passes one.
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise LocationError(f"checkpoint location {text!r} starts with '{{' but is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise LocationError(f"checkpoint location {text!r}: expected a JSON object")
        return parse_location(doc)
    name, sep, rest = text.partition("://")
    if not sep:
        return Location({"driver": "file", "path": _as_prefix(os.path.abspath(text))})
    scheme = SCHEMES.get(name.lower())
    if scheme is None:
        raise LocationError(f"unsupported checkpoint location {text!r}: scheme {name!r} is not one of "
                            + ", ".join(f"{s}://" for s in SCHEMES) + " (or pass a TensorStore kvstore spec dict)")
    if scheme.driver == "file":
        if not rest:
            raise LocationError(f"checkpoint location {text!r} has no path")
        return Location({"driver": "file", "path": _as_prefix(os.path.abspath(rest))})
    if scheme.has_bucket:
        bucket, _, path = rest.partition("/")
        spec: dict[str, Any] = {**scheme.env_defaults(), "driver": scheme.driver, "bucket": bucket,
                                "path": _as_prefix(path.strip("/"))}
    else:
        if not rest.strip("/"):
            raise LocationError(f"checkpoint location {text!r} has no name: expected {name}://NAME")
        spec = {"driver": scheme.driver, "path": _as_prefix(rest.strip("/"))}
    return _checked(spec, {}, text)


def _checked(spec: dict[str, Any], context: dict[str, Any], shown: str) -> Location:
    """Validate what TensorStore would only reject at the first request, with a clearer message."""
    scheme = _BY_DRIVER.get(str(spec.get("driver")))
    if scheme is not None and scheme.has_bucket:
        bucket = spec.get("bucket")
        if not isinstance(bucket, str) or not bucket:
            raise LocationError(f"checkpoint location {shown}: no bucket name (expected {scheme.name}://BUCKET/PREFIX)")
        problem = scheme.bucket_problem(bucket) if scheme.bucket_problem else None
        if problem:
            raise LocationError(f"checkpoint location {shown}: {bucket!r} is not a valid {scheme.name} bucket name "
                              f"(expected {problem})")
    if spec.get("driver") == "s3" and spec.get("endpoint") and not spec.get("aws_region"):
        spec["aws_region"] = DEFAULT_S3_REGION
    endpoint = spec.get("endpoint")
    if endpoint is not None and not re.match(r"^https?://[^/]+", str(endpoint)):
        raise LocationError(f"checkpoint location {shown}: endpoint {endpoint!r} must be an http:// or https:// URL")
    return Location(spec, context)


def _as_prefix(path: str) -> str:
    return path if path == "" or path.endswith("/") else path + "/"
