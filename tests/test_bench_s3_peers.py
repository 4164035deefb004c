"""The emulated node links of benchmarks/bench_s3_peers.py: latency, bandwidth cap, counts; and a smoke run.

The bounds are loose on purpose (lower bounds on time, counts exact): the
machine may be busy, which only makes transfers slower.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "benchmarks")
sys.path.insert(0, BENCH)
import linkproxy  # noqa: E402
from linkproxy import Link, Links, RequestSplitter  # noqa: E402


class _Upstream(BaseHTTPRequestHandler):
    """GET /N answers N bytes; PUT reads its body and answers how many bytes came."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        body = b"x" * int(self.path.strip("/") or 0)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        got = len(self.rfile.read(int(self.headers["Content-Length"])))
        body = str(got).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _connect(links: Links, rank: int = 0) -> http.client.HTTPConnection:
    port = int(links.endpoints[rank].rsplit(":", 1)[1])
    return http.client.HTTPConnection("127.0.0.1", port, timeout=30)


def test_latency_is_added_before_each_request(upstream: int) -> None:
    with Links(upstream, Link(1000, 50), ranks=2) as links:
        conn = _connect(links, rank=1)
        t0 = time.perf_counter()
        for _ in range(3):
            conn.request("GET", "/10")
            assert conn.getresponse().read() == b"x" * 10
        elapsed = time.perf_counter() - t0
        conn.close()
        counts = links.read(1)
        assert links.read(0)["requests"] == 0  # rank 0's link saw nothing
    assert elapsed >= 3 * 0.05 * 0.95
    assert counts["requests"] == 3 and counts["unparsed"] == 0
    assert counts["received"] > 30 and counts["sent"] > 0


def test_bandwidth_is_capped_each_way(upstream: int) -> None:
    size = 2_000_000
    with Links(upstream, Link(10, 0), ranks=1) as links:
        conn = _connect(links)
        t0 = time.perf_counter()
        conn.request("GET", f"/{size}")
        assert len(conn.getresponse().read()) == size
        down = time.perf_counter() - t0
        t0 = time.perf_counter()
        conn.request("PUT", "/upload", body=(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n" * size)[:size])
        assert conn.getresponse().read() == str(size).encode()
        up = time.perf_counter() - t0
        conn.close()
        counts = links.read(0)
    # 2 MB at 10 MB/s is 0.2 s; the bucket's burst lets about 0.33 MB through at once.
    assert down >= 0.15 and up >= 0.15
    # The PUT body looks like requests; only the two real ones count.
    assert counts["requests"] == 2 and counts["unparsed"] == 0
    assert size < counts["sent"] < size + 2000
    assert size < counts["received"] < size + 2000


def test_splitter_follows_chunked_bodies_and_cut_reads() -> None:
    stream = (b"PUT /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"5\r\nGET /\r\n0\r\nx-trailer: 1\r\n\r\n"
              b"\r\nHEAD /b HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
              b"PUT /c HTTP/1.1\r\ncontent-length: 4\r\n\r\nab\r\n")
    for cut in range(1, 12):  # the same stream read in pieces of every size
        s = RequestSplitter()
        pieces = [p for i in range(0, len(stream), cut) for p in s.split(stream[i:i + cut])]
        assert sum(starts for starts, _ in pieces) == 3, cut
        assert b"".join(p for _, p in pieces) == stream
        assert s.state == "start"


def test_link_settings_parse() -> None:
    assert linkproxy.parse_links("60:10, 25:30,200:2") == [Link(60, 10), Link(25, 30), Link(200, 2)]
    assert Link(60, 10).label == "60 MB/s, 10 ms"
    with pytest.raises(ValueError):
        Link.parse("fast")


@pytest.mark.timeout(900)  # only stops a hang: 40 s here took over 240 s on a machine loaded 15 deep
def test_benchmark_smoke_run(tmp_path: Any) -> None:
    """A tiny run of the benchmark end to end (about 40 s here): checked loads in both groups, table, JSON, figures.

    One peer and two loads keep it short; the 4 -> 2 load covers the second process group.
    """
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    pytest.importorskip("matplotlib")
    out, figures = tmp_path / "out", tmp_path / "figures"
    cmd = [sys.executable, os.path.join(BENCH, "bench_s3_peers.py"), "--gb", "0.002", "--states", "untuned",
           "--links", "1000:0", "--reps", "1", "--layouts", "plain", "--peers", "dcp-fsspec",
           "--phases", "load,reshard_fewer", "--out", str(out), "--plots", str(figures)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "s3_peers.json") as f:
        results = json.load(f)
    (block,) = results["blocks"]
    assert set(block["samples"]) == {"dcp-fsspec", "tsckpt-dcp/plain"}
    for phases in block["samples"].values():
        assert set(phases) == {"save", "load", "reshard_fewer"}
        for (sample,) in phases.values():
            # Every rank's requests crossed its own link, tsckpt's saves included.
            assert sample["seconds"] > 0 and min(sample["requests"]) > 0 and min(sample["needed"]) > 0
    assert "| same-topology load, 4 ranks | tsckpt plain |" in done.stdout
    assert sorted(p.name for p in figures.iterdir()) == ["s3_peers_cpu.png", "s3_peers_links.png",
                                                        "s3_peers_speedups.png", "s3_peers_traffic.png"]
