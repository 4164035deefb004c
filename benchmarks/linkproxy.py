"""Emulated node links to an object store: one TCP proxy per rank, with a bandwidth cap and a latency per request.

On a cluster every node reaches the object store through its own network
link: a bandwidth per direction, and a round trip before each answer. On one
machine every rank reaches a loopback server at memory speed, so a client
that makes many small requests pays nothing for them. :class:`Links` puts a
proxy in front of the server for each rank. Each proxy forwards whatever
arrives to the one server, so a rank can use it as its S3 endpoint or as its
HTTP proxy (``http_proxy``: the endpoint stays the server's, and requests
arrive in absolute form, which the server accepts). Either way every byte the
rank sends or gets crosses its own emulated link:

* **bandwidth**: one token bucket per direction per link (the node's NIC),
  shared by all of the rank's connections, refilled at ``mb_per_s`` (10^6
  bytes per second); bytes wait for tokens before they are forwarded;
* **latency**: the proxy holds each HTTP request for ``latency_ms`` before
  forwarding its first byte, as a round trip to a store in another rack would.
  Requests on different connections wait side by side, as they do on a real
  link; opening a connection costs nothing extra;
* **counts**: per rank, the HTTP requests it sent (request lines found by
  following each connection's requests and their ``Content-Length`` or chunked
  bodies), the bytes it sent and the bytes it received (HTTP headers included).

The counts live in a shared-memory array (:func:`counters`), so ranks started
by ``harness.run_ranks`` read their own before and after each operation. The
proxies run on one asyncio event loop in a thread of the process that starts
them; nothing but 127.0.0.1 is reached.

    counts = counters(4)
    with Links(server.port, Link(60, 10), 4, counts) as links:
        links.endpoints[rank]        # http://127.0.0.1:PORT: that rank's endpoint or http_proxy
        read_counts(counts, rank)    # {"requests": .., "sent": .., "received": .., "unparsed": ..}
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

HOST = "127.0.0.1"
#: One slot of each per rank in the shared counters. ``unparsed``: connections whose requests could not be
#: followed (their later requests are forwarded but neither delayed nor counted); 0 with every client here.
FIELDS = ("requests", "sent", "received", "unparsed")
#: Bytes forwarded at a time: small enough that connections sharing a link interleave.
READ_SIZE = 64 * 1024
#: The longest request head (request line and headers) followed; S3 clients send a few KiB.
MAX_HEAD = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Link:
    """A node's link to the store: ``mb_per_s`` each way (10^6 bytes/s), ``latency_ms`` before each request."""

    mb_per_s: float
    latency_ms: float

    @classmethod
    def parse(cls, text: str) -> Link:
        """``"60:10"`` -> 60 MB/s each way and 10 ms per request."""
        rate, sep, latency = text.strip().partition(":")
        try:
            link = cls(float(rate), float(latency if sep else 0))
        except ValueError:
            raise ValueError(f"bad link {text!r}: expected MB_PER_S:LATENCY_MS, e.g. 60:10") from None
        if link.mb_per_s <= 0 or link.latency_ms < 0:
            raise ValueError(f"bad link {text!r}: the bandwidth must be above 0 and the latency at least 0")
        return link

    @property
    def key(self) -> str:
        return f"{self.mb_per_s:g}:{self.latency_ms:g}"

    @property
    def label(self) -> str:
        return f"{self.mb_per_s:g} MB/s, {self.latency_ms:g} ms"


def parse_links(text: str) -> list[Link]:
    """``"60:10,25:30"`` -> two links."""
    return [Link.parse(part) for part in text.split(",") if part.strip()]


def counters(ranks: int) -> Any:
    """Shared counters for ``ranks`` links, passable to ranks started by ``harness.run_ranks``.

    Each slot is written by the proxies' one event loop only; a rank reads its
    own as aligned 8-byte integers, so no lock is needed.
    """
    import multiprocessing

    # harness.run_ranks forks ranks from a forkserver: the array must be one that context can hand over.
    return multiprocessing.get_context("forkserver").RawArray("q", ranks * len(FIELDS))


def read_counts(counts: Any, rank: int) -> dict[str, int]:
    """Rank ``rank``'s counts so far."""
    base = rank * len(FIELDS)
    return {name: int(counts[base + i]) for i, name in enumerate(FIELDS)}


class TokenBucket:
    """At most ``rate`` bytes per second on average, with bursts of at most ``burst`` bytes after a pause.

    A taker may overdraw the bucket and then sleeps until the debt is paid, so
    takers queue behind each other and the connections of one link share its
    rate. ``burst`` must exceed what the rate delivers during the event loop's
    oversleep (about a millisecond), or a busy link would run below its rate.
    """

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self._tokens = burst
        self._stamp = time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= n
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)


class RequestSplitter:
    """Follows HTTP/1.1 requests in a client's byte stream: where each one starts.

    Bodies are skipped by ``Content-Length`` or by their chunked framing, so a
    body that happens to hold a request-like line is never counted. A stream
    that cannot be followed (a head over :data:`MAX_HEAD`, a header that does
    not parse) turns ``lost``: the rest is forwarded as it comes.
    """

    def __init__(self) -> None:
        self.state = "start"
        #: Each request's line and Range header (``GET /b/k bytes=0-9``), in order, for whoever keeps them.
        self.heads: list[str] = []
        self._head = bytearray()
        self._line = bytearray()
        self._left = 0  # body or chunk bytes still to come

    @property
    def lost(self) -> bool:
        return self.state == "lost"

    def split(self, data: bytes) -> list[tuple[bool, bytes]]:
        """``data`` cut at request starts: ``(starts_a_request, piece)`` in order."""
        pieces: list[tuple[bool, bytes]] = []
        begin, starts, pos = 0, False, 0
        while pos < len(data):
            if self.state == "lost":
                break
            if self.state == "start":
                if data[pos:pos + 1] in (b"\r", b"\n"):  # stray CRLF between requests (RFC 9112, 2.2)
                    pos += 1
                    continue
                if pos > begin or starts:
                    pieces.append((starts, data[begin:pos]))
                begin, starts = pos, True
                self.state = "head"
            elif self.state == "head":
                pos = self._read_head(data, pos)
            elif self.state in ("body", "chunk_data"):
                step = min(self._left, len(data) - pos)
                pos += step
                self._left -= step
                if self._left == 0:
                    self.state = "start" if self.state == "body" else "chunk_size"
            else:  # chunk_size or trailer: one CRLF-terminated line at a time
                pos = self._read_line(data, pos)
        if len(data) > begin or starts:
            pieces.append((starts, data[begin:]))
        return pieces

    def _read_head(self, data: bytes, pos: int) -> int:
        seen = len(self._head)
        self._head += data[pos:]
        end = self._head.find(b"\r\n\r\n", max(0, seen - 3))
        if end < 0:
            if len(self._head) > MAX_HEAD:
                self.state = "lost"
            return len(data)
        used = end + 4 - seen
        head, self._head = bytes(self._head[:end]), bytearray()
        self._start_body(head)
        return pos + used

    def _start_body(self, head: bytes) -> None:
        headers: dict[str, str] = {}
        lines = head.split(b"\r\n")
        for line in lines[1:]:
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                self.state = "lost"
                return
            headers[name.strip().lower()] = value.strip()
        method, _, rest = lines[0].decode("latin-1").partition(" ")
        self.heads.append(f"{method} {rest.rpartition(' ')[0]} {headers.get('range', '')}".rstrip())
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = "chunk_size"
            return
        try:
            self._left = int(headers.get("content-length", "0"))
        except ValueError:
            self.state = "lost"
            return
        self.state = "body" if self._left > 0 else "start"

    def _read_line(self, data: bytes, pos: int) -> int:
        end = data.find(b"\n", pos)
        if end < 0:
            self._line += data[pos:]
            if len(self._line) > MAX_HEAD:
                self.state = "lost"
            return len(data)
        line, self._line = bytes(self._line + data[pos:end]).rstrip(b"\r"), bytearray()
        if self.state == "trailer":
            if not line:
                self.state = "start"
            return end + 1
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            self.state = "lost"
            return end + 1
        if size == 0:
            self.state = "trailer"
        else:
            self.state, self._left = "chunk_data", size + 2  # the chunk and its CRLF
        return end + 1


class _RankLink:
    """One rank's proxy: its listening server, its two token buckets, its slots in the counters."""

    def __init__(self, owner: Links, rank: int):
        self.owner, self.rank = owner, rank
        rate = owner.link.mb_per_s * 1e6
        # A burst of 5 ms of the link (at least 4 reads): the loop's oversleep is refilled, nothing more.
        burst = max(4 * READ_SIZE, rate * 0.005)
        self.up, self.down = TokenBucket(rate, burst), TokenBucket(rate, burst)
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        # asyncio holds a connection's task only while the client's side is open, and the server's reader only
        # weakly: a client that hangs up before the server would leave the task to the garbage collector.
        self.connections: set[asyncio.Task[None]] = set()

    def add(self, field: str, n: int) -> None:
        self.owner.counts[self.rank * len(FIELDS) + FIELDS.index(field)] += n

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.serve, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def serve(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            await self._forward(client_in, client_out)
        finally:
            self.connections.discard(task)

    async def _forward(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            server_in, server_out = await asyncio.open_connection(HOST, self.owner.upstream_port)
        except OSError:
            client_out.close()
            return
        writers = (client_out, server_out)
        try:
            await asyncio.gather(self.uplink(client_in, server_out, writers),
                                 self.downlink(server_in, client_out, writers))
        except asyncio.CancelledError:  # Links.stop: end quietly, the loop is going away
            _close(writers)

    async def uplink(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                     writers: Sequence[asyncio.StreamWriter]) -> None:
        """Client to server: each request held for the latency and counted, every byte through the bucket."""
        requests = RequestSplitter()
        delay = self.owner.link.latency_ms / 1000
        try:
            while data := await src.read(READ_SIZE):
                was_lost = requests.lost
                for starts, piece in requests.split(data):
                    if starts:
                        self.add("requests", 1)
                        if delay:
                            await asyncio.sleep(delay)
                    if piece:
                        await self.up.take(len(piece))
                        self.add("sent", len(piece))
                        dst.write(piece)
                        await dst.drain()
                if requests.lost and not was_lost:
                    self.add("unparsed", 1)
                if self.owner.heads is not None:
                    self.owner.heads[self.rank].extend(requests.heads)
                requests.heads.clear()
            if dst.can_write_eof():
                dst.write_eof()
        except (OSError, asyncio.IncompleteReadError):
            _close(writers)

    async def downlink(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       writers: Sequence[asyncio.StreamWriter]) -> None:
        """Server to client: every byte through the bucket."""
        try:
            while data := await src.read(READ_SIZE):
                await self.down.take(len(data))
                self.add("received", len(data))
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        _close(writers)


def _close(writers: Sequence[asyncio.StreamWriter]) -> None:
    for w in writers:
        try:
            w.close()
        except (OSError, RuntimeError):
            pass


class Links:
    """One proxy per rank in front of the server at ``HOST:upstream_port``, each an emulated ``link``.

    ``counts`` (from :func:`counters`) receives each rank's counts; one is made
    if not given. A context manager: the proxies serve from ``__enter__`` until
    ``__exit__``, on an event loop in a daemon thread of this process.
    """

    def __init__(self, upstream_port: int, link: Link, ranks: int, counts: Any = None, heads: bool = False):
        self.upstream_port, self.link, self.ranks = upstream_port, link, ranks
        #: With ``heads``, each rank's requests as :attr:`RequestSplitter.heads` words them, in order (to see
        #: what a client asked for, not only how often).
        self.heads: list[list[str]] | None = [[] for _ in range(ranks)] if heads else None
        self.counts = counts if counts is not None else counters(ranks)
        if len(self.counts) < ranks * len(FIELDS):
            raise ValueError(f"counters for {len(self.counts) // len(FIELDS)} ranks, {ranks} links asked for")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._links: list[_RankLink] = []

    @property
    def endpoints(self) -> list[str]:
        """Each rank's proxy, ``http://127.0.0.1:PORT``: its S3 endpoint, or its HTTP proxy."""
        return [f"http://{HOST}:{r.port}" for r in self._links]

    def read(self, rank: int) -> dict[str, int]:
        return read_counts(self.counts, rank)

    def start(self) -> Links:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="link-proxies", daemon=True)
        self._thread.start()
        self._links = [_RankLink(self, r) for r in range(self.ranks)]

        async def start_all() -> None:
            for r in self._links:
                await r.start()

        asyncio.run_coroutine_threadsafe(start_all(), loop).result(timeout=30)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def stop_all() -> None:
            for r in self._links:
                if r.server is not None:
                    r.server.close()
            # Connections accepted just before the close start tasks of their own: repeat until none is left.
            for _ in range(100):
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                if not tasks:
                    return
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.sleep(0.01)

        asyncio.run_coroutine_threadsafe(stop_all(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        loop.close()
        self._loop = None

    def __enter__(self) -> Links:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
