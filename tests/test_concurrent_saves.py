"""Two saves into one S3 location at once, both with overwrite=True (the drop-in writer's default).

The first save runs on a gloo rank whose requests pass through a proxy
(tests/faultproxy.py) that holds some of them: its writes are on their way
while the second save, in this process, goes to the same location. Whatever
each of them reports, the checkpoint committed there is one save's data
entirely, bit for bit, read by tsckpt and by TensorStore's own OCDBT reader,
and nothing of the save that lost is left behind.

* Plain layout: both saves write the same chunk keys, and a write already on
  its way cannot be stopped, so the second save is refused in one line.
* Packed layout: every key a rank writes carries its save id, so the second
  save takes the location over; the first one fails at its commit and removes
  its own data files.
* Packed layout, the first save already committing: the second is refused.

No step waits for a number of seconds: the second save starts once the proxy
holds a write of the first (a first save whose rank ended without writing
fails the test at once), and the first save's outcome is read once its rank
has ended. ``HANG`` only stops a hung run.
"""

from __future__ import annotations

import tensorstore as ts
import torch

import tsckpt
from dist import run_ranks
from faultproxy import Client, FaultProxy
from tsckpt.commit.states import CLAIM
from tsckpt.storage import packed
from tsckpt.storage.location import parse_location

BUCKET = "tsckpt-concurrent"
#: Seconds after which a hung rank is killed: a guard against a hang, never what a step waits for.
HANG = 600


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 48, generator=g), "b": torch.randn(40, generator=g).bfloat16()},
            "step": seed}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(64, 48), "b": torch.zeros(40, dtype=torch.bfloat16)}, "step": None}


def _same(a: dict, b: dict) -> bool:
    return (a["step"] == b["step"] and torch.equal(a["model"]["w"], b["model"]["w"])
            and torch.equal(a["model"]["b"].view(torch.int16), b["model"]["b"].view(torch.int16)))


def _save_on_a_rank(rank: int, world_size: int, location: dict, layout: str, seed: int) -> str:
    try:
        tsckpt.save(_state(seed), location, overwrite=True, layout=layout)
    except tsckpt.TsckptError as e:
        return f"{type(e).__name__}: {e}"
    return "committed"


def _race(s3, name: str, layout: str, held) -> tuple[str, str, dict]:
    """Save 1 on a rank with the requests ``held`` matches kept on their way; meanwhile save 2 here.

    Returns what each save reported and the location.
    """
    location = s3.location(BUCKET, name)
    with FaultProxy(s3.endpoint) as proxy:
        proxy.hold(held)
        rank = Client(lambda: run_ranks(1, _save_on_a_rank, {**location, "endpoint": proxy.endpoint}, layout, 1,
                                        timeout=HANG)[0])
        rank.start()
        try:
            assert rank.wait_for(proxy.holding.is_set), f"the first save never wrote; its rank: {rank.said()}"
            try:
                tsckpt.save(_state(2), location, overwrite=True, layout=layout)
                second = "committed"
            except tsckpt.TsckptError as e:
                second = f"{type(e).__name__}: {e}"
        finally:
            proxy.release()
            rank.join(HANG + 60)
    assert rank.result is not None, f"the first save's rank: {rank.said()}"
    return rank.result, second, location


def _committed_state(location: dict) -> dict:
    """What tsckpt loads from ``location``, checked against what TensorStore reads through the packed manifest."""
    loaded = _empty()
    tsckpt.load(loaded, location)
    base = dict(parse_location(location).spec)
    if ts.KvStore.open(base).result().read(packed.MANIFEST).result().state == "value":
        w = ts.open({"driver": "zarr3", "kvstore": packed.read_kvstore(base, "model/w")}, open=True,
                    context=packed.reader_context(ts.Context())).result()
        assert torch.equal(torch.from_numpy(w.read().result()), loaded["model"]["w"]), \
            "the OCDBT manifest names other data than the committed root"
    return loaded


def _one_saves(location: dict) -> int:
    """Which save's data is committed at ``location``, whole and bit for bit (1 or 2); fails on a mix."""
    state = _committed_state(location)
    which = [seed for seed in (1, 2) if _same(state, _state(seed))]
    assert which, "the committed checkpoint mixes the two saves' data"
    return which[0]


def _data(method: str, path: str) -> bool:
    """A rank's data: every write but the claim's."""
    return method == "PUT" and not path.endswith(CLAIM)


def test_plain_a_second_overwriting_save_is_refused_while_the_first_writes(s3):
    first, second, location = _race(s3, "plain", "plain", _data)
    assert _one_saves(location) == 1
    assert second.startswith("ConcurrentSaveError: ") and "overwrite=True cannot take the location over" in second
    assert "tsckpt clean --force" in second and "\n" not in second
    assert first == "committed"
    assert not [k for k in s3.keys(BUCKET, "plain/") if k.endswith(CLAIM)]


def test_packed_a_second_overwriting_save_takes_over_and_the_first_leaves_nothing(s3):
    first, second, location = _race(s3, "packed", "packed", _data)
    assert _one_saves(location) == 2
    assert second == "committed"
    assert first.startswith("ConcurrentSaveError: ") and "was overtaken" in first
    keys = s3.keys(BUCKET, "packed/")
    saves = {k.split("/d/")[1][:32] for k in keys if "/d/" in k}
    assert len(saves) == 1, f"data files of more than one save: {keys}"
    assert not [k for k in keys if k.endswith(CLAIM)]


def test_packed_a_save_that_is_committing_is_not_taken_over(s3):
    # Held: the first save's manifest, written once its claim says it is committing, before its root document.
    first, second, location = _race(s3, "committing", "packed",
                                    lambda method, path: method == "PUT" and path.endswith("manifest.ocdbt"))
    assert _one_saves(location) == 1
    assert second.startswith("ConcurrentSaveError: ") and "is committing there" in second
    assert first == "committed"
