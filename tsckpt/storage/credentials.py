"""Which AWS credentials an ``s3://`` location is opened with: one source, named to TensorStore.

Left to itself, TensorStore's S3 driver asks the AWS SDK's default chain, whose every empty source logs an error
line to stderr (9 per store opened on a machine without credentials). :func:`resolve` finds the source that chain
would settle on, in its order (docs/object-storage.md), from the environment and local files alone.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SYSFS = "/sys"  # where Linux shows the machine's firmware: an EC2 instance's names Amazon


@dataclass(frozen=True)
class Credentials:
    """The ``aws_credentials`` context resource to open S3 with, and where it takes keys from, in words."""

    spec: dict[str, Any]
    #: For messages ("AWS_ACCESS_KEY_ID from the environment"...); None where none were found (anonymous requests).
    source: str | None


def resolve(environ: Mapping[str, str] = os.environ, sysfs: str = SYSFS) -> Credentials:
    """The one credentials source an S3 store is opened with here (see the module docstring)."""
    if environ.get("AWS_ACCESS_KEY_ID"):
        return Credentials({"type": "environment"}, "AWS_ACCESS_KEY_ID from the environment")
    named = environ.get("AWS_PROFILE")
    profile = named or "default"
    files = _shared_files(environ)
    found = _profile_keys(profile, *files)
    existing = [f for f in files if os.path.isfile(f)]
    if found is not None or named or existing:
        where = f"profile {profile!r} (AWS_PROFILE)" if named else \
            f"the default profile of {found[2] if found is not None else existing[0]}"
        if found is not None:  # both files named: TensorStore 0.1.86 does not find the default ones itself
            return Credentials({"type": "profile", "profile": profile, "credentials_file": found[0],
                                "config_file": found[1]}, where)
        # Keys from a role, a process or SSO: the SDK's chain knows how to get them.
        return Credentials({"type": "default", "profile": profile}, where)
    if environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return Credentials({"type": "default"}, "a web identity token (AWS_WEB_IDENTITY_TOKEN_FILE)")
    if environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or environ.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return Credentials({"type": "ecs"}, "the container's credentials endpoint")
    if environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() != "true" and on_ec2(sysfs):
        return Credentials({"type": "imds"}, "the EC2 instance's role (its metadata service)")
    return Credentials({"type": "anonymous"}, None)


def _shared_files(environ: Mapping[str, str]) -> tuple[str, str]:
    """The shared credentials file and config file, where the AWS SDK looks for them."""
    home = environ.get("HOME") or os.path.expanduser("~")
    out = []
    for name, default in (("AWS_SHARED_CREDENTIALS_FILE", "credentials"), ("AWS_CONFIG_FILE", "config")):
        given = environ.get(name)
        path = given.replace("~", home, 1) if given and given.startswith("~") else given
        out.append(path or os.path.join(home, ".aws", default))
    return out[0], out[1]


def _profile_keys(profile: str, credentials: str, config: str) -> tuple[str, str, str] | None:
    """(credentials file, config file, the file that holds the keys) when ``profile`` has its keys written out;
    a file that is not there is named as ``os.devnull`` (TensorStore's profile source fails on a path it cannot
    open, and reads an empty file as no profiles)."""
    in_config = ["default", "profile default"] if profile == "default" else [f"profile {profile}"]
    for path, sections in ((credentials, [profile]), (config, in_config)):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError):
            continue  # the SDK cannot read it either
        if any(parser.has_option(s, "aws_access_key_id") and parser.has_option(s, "aws_secret_access_key")
               for s in sections):
            present = [p if os.path.isfile(p) else os.devnull for p in (credentials, config)]
            return present[0], present[1], path
    return None


def on_ec2(sysfs: str = SYSFS) -> bool:
    """Whether this machine is an EC2 instance, by what its firmware says (Nitro and Xen instances alike)."""
    for name in ("devices/virtual/dmi/id/sys_vendor", "devices/virtual/dmi/id/bios_vendor",
                 "devices/virtual/dmi/id/bios_version"):
        if "amazon" in _read(os.path.join(sysfs, name)).lower():
            return True
    return _read(os.path.join(sysfs, "hypervisor/uuid")).lower().startswith("ec2")


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(256)
    except OSError:
        return ""
