"""A real S3-compatible HTTP server (moto) on loopback, for tests and benchmarks.

``MotoServer`` starts ``python -m moto.server`` bound to 127.0.0.1 on a free
port, waits until it answers, creates buckets with plain unsigned HTTP
requests (moto accepts them) and stops the process it started. It never
talks to any address other than 127.0.0.1.

    with MotoServer() as s3:
        s3.create_bucket("ckpt")
        tsckpt.save(sd, s3.location("ckpt", "run-1"))
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from xml.etree import ElementTree
from typing import Any

HOST = "127.0.0.1"
#: Dummy credentials: moto accepts any, TensorStore and s3fs refuse to sign without some.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REGION = "us-east-1"
# Loopback only: never route these requests through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class MotoServer:
    """One moto S3 server process on 127.0.0.1; a context manager."""

    def __init__(self, startup_timeout: float = 60.0):
        self.startup_timeout = startup_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> MotoServer:
        self.port = _free_port()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}:\n{self._output()}")
            try:
                with _OPENER.open(f"{self.endpoint}/moto-api/", timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto server did not answer on {self.endpoint} within "
                                   f"{self.startup_timeout}s:\n{self._output()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def _output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self._log.close()

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with _OPENER.open(req, timeout=10) as resp:
            if resp.status != 200:
                raise RuntimeError(f"creating bucket {name!r} on {self.endpoint}: HTTP {resp.status}")

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object name in ``bucket`` that starts with ``prefix``, listed by the server itself (ListObjectsV2)."""
        return list(self.sizes(bucket, prefix))

    def sizes(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """The size of every object in ``bucket`` that starts with ``prefix``, by name, as the server lists them."""
        found: dict[str, int] = {}
        token = None
        while True:
            query = {"list-type": "2", "prefix": prefix} | ({"continuation-token": token} if token else {})
            url = f"{self.endpoint}/{bucket}?{urllib.parse.urlencode(query)}"
            with _OPENER.open(url, timeout=30) as resp:
                root = ElementTree.fromstring(resp.read())
            ns = {"s3": root.tag.partition("}")[0].lstrip("{")} if root.tag.startswith("{") else {"s3": ""}
            for entry in root.iterfind("s3:Contents", ns):
                found[entry.findtext("s3:Key", "", ns)] = int(entry.findtext("s3:Size", "0", ns))
            token = root.findtext("s3:NextContinuationToken", namespaces=ns)
            if root.findtext("s3:IsTruncated", namespaces=ns) != "true" or not token:
                return found

    def location(self, bucket: str, prefix: str) -> dict[str, Any]:
        """A tsckpt location for ``s3://bucket/prefix`` on this server."""
        return {"url": f"s3://{bucket}/{prefix}", "endpoint": self.endpoint, "aws_region": REGION}

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options reaching this server (for zarr-python's FsspecStore)."""
        return {
            "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
        }


def set_credentials(environ: Any = os.environ) -> dict[str, str | None]:
    """Put dummy AWS keys in ``environ`` (inherited by spawned ranks); returns the previous values."""
    previous = {k: environ.get(k) for k in CREDENTIALS}
    environ.update(CREDENTIALS)
    return previous


def restore_credentials(previous: dict[str, str | None], environ: Any = os.environ) -> None:
    for key, value in previous.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
