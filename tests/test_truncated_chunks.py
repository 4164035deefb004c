"""A chunk cut short is refused on every read, a partial read of its intact start included, on a local disk
and on S3, in both layouts.

On a local disk each file's size is known (the root document records the packed data files'; a plain chunk
file has the size its encoding gives). On S3 a packed data part must be the object generation (ETag) its
rank wrote, and a partial read of a plain chunk object reads its index, at its end, with the pieces.
"""

from __future__ import annotations

import os

import pytest
import tensorstore as ts
import torch

import tsckpt
from tsckpt.errors import TsckptError

BUCKET = "tsckpt-truncated"
LAYOUTS = ["plain", "packed"]


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 64, generator=g), "step": 3}


def _victim(keys: list[str], layout: str) -> str:
    """The key to cut short: the chunk of ``w`` (plain) or rank 0's data file (packed)."""
    if layout == "plain":
        return next(k for k in keys if k.endswith("w/c.0.0"))
    return next(k for k in keys if "/d/" in f"/{k}" and not k.endswith(".index"))


def _refused_everywhere(location) -> None:
    ck = tsckpt.open(location)
    with pytest.raises(TsckptError, match="'w'"):
        ck["w"][0:2]  # the first rows: bytes the cut left intact
    with pytest.raises(TsckptError, match="'w'"):
        tsckpt.load({"w": torch.zeros(256, 64), "step": 0}, location)
    assert not tsckpt.verify(location).ok


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_local_chunk_cut_short_is_refused_on_every_read(tmp_path, layout):
    path = tmp_path / "ck"
    tsckpt.save(_state(), path, layout=layout)
    assert torch.equal(tsckpt.open(path)["w"][0:2], _state()["w"][0:2])
    keys = [os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs]
    victim = path / _victim(keys, layout)
    os.truncate(victim, victim.stat().st_size // 2)
    _refused_everywhere(path)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_s3_object_cut_short_is_refused_on_every_read(s3, layout):
    location = s3.location(BUCKET, f"cut-{layout}")
    tsckpt.save(_state(), location, layout=layout)
    assert torch.equal(tsckpt.open(location)["w"][0:2], _state()["w"][0:2])
    keys = [k.removeprefix(f"cut-{layout}/") for k in s3.keys(BUCKET, f"cut-{layout}/")]
    kv = ts.KvStore.open({"driver": "s3", "bucket": BUCKET, "endpoint": s3.endpoint, "aws_region": "us-east-1",
                          "path": f"cut-{layout}/"}).result()
    victim = _victim(keys, layout)
    data = kv.read(victim).result().value
    kv.write(victim, data[:len(data) // 2]).result()
    _refused_everywhere(location)
