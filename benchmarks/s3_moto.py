"""moto's S3 server as the benchmarks run it: ``tests/s3server.py``'s server, answering as S3 does where moto does not.

moto 5.2 answers CompleteMultipartUpload with a ``<CompleteMultipartUploadResponse>``
root element; S3 (and its API model) names it ``<CompleteMultipartUploadResult>``.
The AWS CRT client under s3torchconnector looks for the ETag under the latter,
so every one of its uploads (it uploads even small objects in parts) fails
with ``Header "ETag" not found``. :class:`BenchServer` starts moto through
this module, which renames that element in those answers and changes nothing
else; botocore (s3fs) and TensorStore read the answer either way.

moto 5.2 also answers a ranged GET by reading the whole object into memory
(twice: a read and a copy) and slicing it, so a request for 1 MB of a 300 MB
object costs what reading 600 MB does; S3 charges by the bytes sent.
:func:`ranged_gets` makes a ranged GET read only its range, for every
contender alike (all of them read by range).

    python benchmarks/s3_moto.py -H 127.0.0.1 -p 5000     # moto.server's own arguments
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Iterable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import s3server  # noqa: E402

WRONG, RIGHT = b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult"


class CompleteUploadRoot:
    """WSGI middleware: the root element of CompleteMultipartUpload answers as S3 names it."""

    def __init__(self, app: Callable[..., Iterable[bytes]]):
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "POST" or "uploadId=" not in environ.get("QUERY_STRING", ""):
            return self.app(environ, start_response)
        answer: dict[str, Any] = {}

        def keep(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
            answer["status"], answer["headers"] = status, headers
            return lambda data: None

        parts = self.app(environ, keep)
        try:
            body = b"".join(parts).replace(WRONG, RIGHT)
        finally:
            if hasattr(parts, "close"):
                parts.close()
        headers = [(k, v) for k, v in answer["headers"] if k.lower() != "content-length"]
        start_response(answer["status"], [*headers, ("Content-Length", str(len(body)))])
        return [body]


class BenchServer(s3server.MotoServer):
    """:class:`s3server.MotoServer`, started through this module (so with :class:`CompleteUploadRoot`)."""

    def start(self) -> BenchServer:
        self.port = s3server._free_port()
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "-H", s3server.HOST,
                                       "-p", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}:\n{self._output()}")
            try:
                with s3server._OPENER.open(f"{self.endpoint}/moto-api/", timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto server did not answer on {self.endpoint}:\n{self._output()}")
            time.sleep(0.1)


class _Range:
    """An object's value as a ranged GET uses it: its length, and the slices asked for, read from its buffer."""

    def __init__(self, key: Any):
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(stop - start, 0))

    def __bytes__(self) -> bytes:
        return self[:]


def ranged_gets() -> None:
    """Patch moto so that a GET with a Range header reads its range, not the whole object."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    ranged = threading.local()
    value = FakeKey.value

    def lazy_value(self: Any) -> Any:
        return _Range(self) if getattr(ranged, "on", False) else value.fget(self)

    get_object, key_response = S3Response.get_object, S3Response.key_response

    def get_object_ranged(self: Any) -> Any:
        ranged.on = bool(self.headers.get("range"))
        try:
            return get_object(self)
        finally:
            ranged.on = False

    def key_response_whole(self: Any, *args: Any, **kwargs: Any) -> Any:
        status, headers, body = key_response(self, *args, **kwargs)
        return status, headers, bytes(body) if isinstance(body, _Range) else body  # a range it did not take

    FakeKey.value = property(lazy_value, value.fset)
    S3Response.get_object, S3Response.key_response = get_object_ranged, key_response_whole


def _exit_with_parent() -> None:
    """End this server once the process that started it is gone: a benchmark killed by a timeout or a
    signal cannot stop it, and a server left behind holds its port and memory until someone notices."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main() -> None:
    import moto.server

    _exit_with_parent()
    ranged_gets()

    serve = moto.server.run_simple

    def run_simple(host: str, port: int, app: Any, **kwargs: Any) -> None:
        serve(host, port, CompleteUploadRoot(app), **kwargs)

    moto.server.run_simple = run_simple  # moto.server.main calls it with its app
    moto.server.main(sys.argv[1:])


if __name__ == "__main__":
    main()
