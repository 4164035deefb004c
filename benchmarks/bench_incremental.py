"""Incremental saves against full saves of the same state: bytes newly allocated, save time, load time.

Two states, every tensor row-sharded (DTensor ``Shard(0)``) over 2-4 gloo ranks:

* ``lora``: a frozen bf16 base (about 91% of the bytes: one ``H x H`` weight per
  layer) plus fp32 LoRA adapters (``r x H`` and ``H x r``) and their AdamW
  moments; a step changes the adapters and the moments.
* ``lora-7b``: the same, with layers shaped as a 7B decoder's (hidden 4096,
  MLP 11008: seven frozen bf16 matrices and two norms per layer) and LoRA on
  q, k, v and o: about 30 tensors per 0.4 GB where ``lora`` has about 330, so
  per-tensor costs weigh less against the bytes not written;
* ``rows``: one large frozen bf16 weight (half the bytes, an embedding) and
  frozen layers; a step changes 4 rows of the large weight.

Each repetition saves step ``k`` in full (the base), then step ``k+1`` three
ways, in an order that rotates: in full; incrementally against the base while
the base's files are in the page cache (a save right after the previous one);
and incrementally after evicting the base's files (the previous save long
gone from memory: the base's chunks are read back from disk to be checked).
A fourth save, for reference, writes only the tensors that differ from step
``k`` (no base): the least any save of the step could write, whatever it knew
in advance, so an incremental save can be no faster than it. Then each of the
step ``k+1`` checkpoints is loaded from a cold cache.
Reported, as medians over repetitions:

* bytes newly allocated on disk: ``st_blocks`` of every inode below the new
  checkpoint, each inode once, leaving out inodes shared with the base;
* save time and load time (slowest rank, between barriers).

Usage::

    python -m benchmarks incremental --gb 1 --ranks 4 --reps 5 --layouts plain packed
    python -m benchmarks incremental --gb 0.1 --ranks 2 --reps 1      # a quick check that it works

Targets (issue 22): an adapter-only step allocates <= 25% of a full save's bytes
and saves >= 3x faster; loads as fast as from a full checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import dcp_ranks as ranks  # noqa: E402
import harness  # noqa: E402

MODES = ["full", "incremental", "incremental, base evicted", "changed tensors only"]
#: Checkpoints of the whole state, loaded and compared; "changed tensors only" is a reference, not a checkpoint of it.
LOADED = MODES[:3]


# --- states -------------------------------------------------------------------

def _lora(gb: float, step: int) -> dict[str, torch.Tensor]:
    hidden, rank = 2048, 16
    layers = max(2, round(gb * 1e9 / (2 * hidden * hidden + 3 * 2 * rank * hidden * 4)))
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        out[f"model.{i}.weight"] = torch.randn(hidden, hidden, generator=g).to(torch.bfloat16)
        _adapter(out, str(i), hidden, rank, step, g)
    return out


def _lora_7b(gb: float, step: int) -> dict[str, torch.Tensor]:
    """Layers shaped as a 7B decoder's (hidden 4096, MLP 11008), frozen in bf16, LoRA (r 16) on q, k, v, o."""
    hidden, ffn, rank = 4096, 11008, 16
    per_layer = 2 * (4 * hidden * hidden + 3 * ffn * hidden + 2 * hidden)
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(max(1, math.ceil(gb * 1e9 / per_layer))):
        for name, shape in (("q", (hidden, hidden)), ("k", (hidden, hidden)), ("v", (hidden, hidden)),
                            ("o", (hidden, hidden)), ("gate", (ffn, hidden)), ("up", (ffn, hidden)),
                            ("down", (hidden, ffn)), ("norm1", (hidden,)), ("norm2", (hidden,))):
            out[f"model.{i}.{name}.weight"] = torch.randn(*shape, generator=g).to(torch.bfloat16)
        for proj in ("q", "k", "v", "o"):
            _adapter(out, f"{i}.{proj}", hidden, rank, step, g)
    return out


def _adapter(out: dict[str, torch.Tensor], at: str, hidden: int, rank: int, step: int, g: torch.Generator) -> None:
    """LoRA factors ``at.lora_a`` (r x H) and ``at.lora_b`` (H x r) in fp32, and their AdamW moments: all change with ``step``."""
    for name, shape in ((f"{at}.lora_a", (rank, hidden)), (f"{at}.lora_b", (hidden, rank))):
        out[f"model.{name}"] = torch.randn(*shape, generator=g) + step
        out[f"optim.{name}.exp_avg"] = torch.randn(*shape, generator=g) * (step + 1)
        out[f"optim.{name}.exp_avg_sq"] = torch.rand(*shape, generator=g) * (step + 1)


def _rows(gb: float, step: int) -> dict[str, torch.Tensor]:
    hidden = 2048
    g = torch.Generator().manual_seed(0)
    vocab = max(64, int(gb * 1e9 / 2 / (2 * hidden)))
    embed = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
    changed = torch.arange(4) * (vocab // 4) + step % (vocab // 4)
    embed[changed] += 1
    out = {"model.embed": embed}
    for i in range(max(1, round(gb * 1e9 / 2 / (2 * hidden * hidden)))):
        out[f"model.{i}.weight"] = torch.randn(hidden, hidden, generator=g).to(torch.bfloat16)
    return out


STATES = {"lora": _lora, "lora-7b": _lora_7b, "rows": _rows}


def _sharded(state: dict[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in state.items()}


def _changed(state: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The tensors of ``state`` that differ from ``before`` on any rank (every rank gets the same keys)."""
    flags = torch.tensor([not torch.equal(v.to_local(), before[k].to_local()) for k, v in state.items()],
                         dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return {k: v for (k, v), flag in zip(state.items(), flags.tolist()) if flag}


def _frozen_share(state: dict[str, torch.Tensor]) -> float:
    frozen = sum(v.nbytes for k, v in state.items() if v.dtype == torch.bfloat16)
    return frozen / sum(v.nbytes for v in state.values())


# --- on disk ------------------------------------------------------------------

def allocated(path: str) -> dict[int, int]:
    """Bytes allocated on disk by each inode below ``path``."""
    out = {}
    for folder, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(folder, f))
            out[st.st_ino] = st.st_blocks * 512
    return out


def new_bytes(path: str, base: str | None) -> int:
    """Bytes allocated by the inodes below ``path`` that ``base`` does not share."""
    shared = set(allocated(base)) if base else set()
    return sum(n for ino, n in allocated(path).items() if ino not in shared)


# --- ranks --------------------------------------------------------------------

def phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    import tsckpt

    mesh = ranks.mesh(world)
    result: dict[str, Any] = {"share": _frozen_share(STATES[cfg["state"]](cfg["gb"], 0)), "reps": []}
    for rep in range(cfg["reps"]):
        root = os.path.join(cfg["root"], f"rep{rep}")
        base = os.path.join(root, "base")
        options = {"layout": cfg["layout"], "overwrite": True}
        before = _sharded(STATES[cfg["state"]](cfg["gb"], rep), mesh)
        tsckpt.save(before, base, **options)
        state = _sharded(STATES[cfg["state"]](cfg["gb"], rep + 1), mesh)
        changed = _changed(state, before)
        del before  # each rank holds one state while it saves, as before this reference existed
        figures: dict[str, dict[str, float]] = {}
        for mode in ranks.rotated(MODES, rep):
            path = os.path.join(root, mode.replace(", ", "-").replace(" ", "-"))
            extra = {"base": base} if mode.startswith("incremental") else {}
            saved = changed if mode == "changed tensors only" else state
            ranks.settle(0.5)
            if mode == "incremental, base evicted" and rank == 0:
                harness.evict(base)
            dist.barrier()
            seconds = ranks.timed(lambda: tsckpt.save(saved, path, **options, **extra))
            figures[mode] = {"save_s": seconds, "new_bytes": new_bytes(path, base if extra else None)}
        for mode in ranks.rotated(LOADED, rep + 1):
            path = os.path.join(root, mode.replace(", ", "-").replace(" ", "-"))
            ranks.settle(0.5)
            if rank == 0:
                harness.evict(root)
            dist.barrier()
            target = {k: torch.empty_like(v) for k, v in state.items()}
            figures[mode]["load_s"] = ranks.timed(lambda: tsckpt.load(target, path))
            assert all(torch.equal(target[k].to_local().view(torch.uint8), v.to_local().view(torch.uint8))
                       for k, v in state.items()), f"{mode}: loaded data differs"
        result["reps"].append(figures)
        # Each repetition makes new states: drop this one's before the next is made.
        del state, changed
        target.clear()
        gc.collect()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root)
    return ranks.rank0(result)


# --- report -------------------------------------------------------------------

def _row(state: str, layout: str, mode: str, reps: list[dict[str, dict[str, float]]]) -> str:
    def med(key: str, m: str = mode) -> float:
        return statistics.median(r[m][key] for r in reps)

    ratio_bytes = statistics.median(r[mode]["new_bytes"] / r["full"]["new_bytes"] for r in reps)
    speedup = statistics.median(r["full"]["save_s"] / r[mode]["save_s"] for r in reps)
    if mode not in LOADED:
        return (f"| {state} | {layout} | {mode} | {med('new_bytes') / 1e6:.1f} | {ratio_bytes:.3f} | "
                f"{med('save_s'):.3f} | {speedup:.2f}x | - | - |")
    load = statistics.median(r[mode]["load_s"] / r["full"]["load_s"] for r in reps)
    return (f"| {state} | {layout} | {mode} | {med('new_bytes') / 1e6:.1f} | {ratio_bytes:.3f} | "
            f"{med('save_s'):.3f} | {speedup:.2f}x | {med('load_s'):.3f} | {load:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="bytes of state, in GB")
    parser.add_argument("--ranks", type=int, default=4, choices=[2, 3, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layouts", nargs="+", default=["plain", "packed"], choices=["plain", "packed"])
    parser.add_argument("--states", nargs="+", default=list(STATES), choices=list(STATES))
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_incremental_", dir=args.dir)
    print(f"{args.gb} GB of state, {args.ranks} ranks, {args.reps} repetitions, in {tmp}\n")
    print("| state | layout | save | MB newly allocated | vs full | save s | faster than full | load s "
          "| load time vs full |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for state in args.states:
            for layout in args.layouts:
                cfg = {"state": state, "layout": layout, "gb": args.gb, "reps": args.reps,
                       "root": os.path.join(tmp, f"{state}-{layout}")}
                result = harness.run_ranks(args.ranks, phase, cfg)[0]
                for mode in MODES:
                    print(_row(f"{state} ({result['share']:.0%} frozen)", layout, mode, result["reps"]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
