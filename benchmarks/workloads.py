"""State dicts the benchmarks save and load: shapes per workload, sharded DTensors, checksums.

Three workloads, in a registry keyed by name:

* ``tuned``: a decoder-only transformer whose every dimension divides by the
  world size, with two AdamW moments per parameter;
* ``untuned``: a GPT-2-sized vocabulary (50257, divisible by nothing useful),
  grouped-query attention with small k/v projections and q/k/v biases, an
  ``8h/3`` MLP width, 1-D norms, one momentum buffer per parameter and a 0-d
  ``step`` per parameter, as SGD-with-momentum or Adafactor-style states look;
* ``small``: a few hundred small matrices, for runs with more ranks than cores.

Every tensor is a DTensor sharded on dim 0 (row) or, for destinations of a
resharded load, on dim 1 (column; 1-D tensors stay on dim 0), or replicated on
every rank. Shards follow ``torch.chunk``, as DTensor's ``Shard`` does, so
uneven sizes give uneven (possibly empty) shards.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPT2_VOCAB = 50257


@dataclasses.dataclass(frozen=True)
class Tuned:
    """A decoder-only transformer: embedding, L blocks of attention + MLP + norms, AdamW."""

    hidden: int
    ffn: int
    vocab: int
    layers: int
    name: ClassVar[str] = "tuned"
    moments: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")

    @classmethod
    def for_size(cls, total_bytes: float, itemsize: int) -> Tuned:
        # Parameters plus two Adam moments, all of one dtype: 3 copies of the weights.
        elems = total_bytes / (3 * itemsize)
        # About 12 blocks of 12 h^2 plus a 32 h x h embedding, h a multiple of 256.
        hidden = max(256, round(math.sqrt(elems / 176) / 256) * 256)
        vocab, ffn = 32 * hidden, 4 * hidden
        per_layer = 4 * hidden * hidden + 2 * ffn * hidden + 2 * hidden
        layers = max(1, round((elems - vocab * hidden - hidden) / per_layer))
        return cls(hidden, ffn, vocab, layers)

    def params(self) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden, self.ffn
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes |= {p + "attn_norm.weight": (h,), p + "attn.wq": (h, h), p + "attn.wk": (h, h),
                       p + "attn.wv": (h, h), p + "attn.wo": (h, h), p + "mlp_norm.weight": (h,),
                       p + "mlp.w1": (f, h), p + "mlp.w2": (h, f)}
        return shapes | {"norm.weight": (h,)}

    def describe(self) -> str:
        return (f"hidden {self.hidden}, ffn {self.ffn}, vocab {self.vocab}, {self.layers} layers, "
                f"weights + 2 AdamW moments")


@dataclasses.dataclass(frozen=True)
class Untuned:
    """GQA transformer with a 50257 vocabulary, biases, untied head, one moment and a 0-d step per parameter."""

    hidden: int
    ffn: int
    kv: int
    vocab: int
    layers: int
    name: ClassVar[str] = "untuned"
    moments: ClassVar[tuple[str, ...]] = ("momentum_buffer",)
    LAYERS: ClassVar[int] = 8

    @classmethod
    def for_size(cls, total_bytes: float, itemsize: int) -> Untuned:
        # Weights plus one moment: 2 copies. Per block about (2 + 2/8 + 8) h^2; embedding and head 2 V h.
        elems = total_bytes / (2 * itemsize)
        a, b = 10.25 * cls.LAYERS, 2 * GPT2_VOCAB
        hidden = max(128, round((-b + math.sqrt(b * b + 4 * a * elems)) / (2 * a) / 128) * 128)
        return cls(hidden, 8 * hidden // 3, hidden // 8, GPT2_VOCAB, cls.LAYERS)

    def params(self) -> dict[str, tuple[int, ...]]:
        h, f, kv = self.hidden, self.ffn, self.kv
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes |= {p + "attention_norm.weight": (h,),
                       p + "attention.wq.weight": (h, h), p + "attention.wq.bias": (h,),
                       p + "attention.wk.weight": (kv, h), p + "attention.wk.bias": (kv,),
                       p + "attention.wv.weight": (kv, h), p + "attention.wv.bias": (kv,),
                       p + "attention.wo.weight": (h, h), p + "ffn_norm.weight": (h,),
                       p + "feed_forward.w1.weight": (f, h), p + "feed_forward.w3.weight": (f, h),
                       p + "feed_forward.w2.weight": (h, f)}
        return shapes | {"norm.weight": (h,), "output.weight": (self.vocab, h)}

    def describe(self) -> str:
        return (f"hidden {self.hidden}, ffn {self.ffn}, k/v {self.kv}x{self.hidden}, vocab {self.vocab}, "
                f"{self.layers} layers, biases, weights + 1 moment + a 0-d step each")


@dataclasses.dataclass(frozen=True)
class Small:
    """``count`` small matrices of ``rows`` x ``cols`` with one moment each: many tensors, few bytes."""

    count: int
    rows: int
    cols: int
    name: ClassVar[str] = "small"
    moments: ClassVar[tuple[str, ...]] = ("exp_avg",)

    @classmethod
    def for_size(cls, total_bytes: float, itemsize: int) -> Small:
        count = 150
        side = max(16, round(math.sqrt(total_bytes / (2 * itemsize * count)) / 16) * 16)
        return cls(count, side, side)

    def params(self) -> dict[str, tuple[int, ...]]:
        return {f"blocks.{i}.weight": (self.rows, self.cols) for i in range(self.count)}

    def describe(self) -> str:
        return f"{self.count} matrices of {self.rows}x{self.cols}, weights + 1 moment"


WORKLOADS: dict[str, type[Tuned] | type[Untuned] | type[Small]] = {w.name: w for w in (Tuned, Untuned, Small)}
Workload = Tuned | Untuned | Small


def to_dict(w: Workload) -> dict[str, Any]:
    return {"name": w.name, **dataclasses.asdict(w)}


def from_dict(d: dict[str, Any]) -> Workload:
    fields = dict(d)
    return WORKLOADS[fields.pop("name")](**fields)


def total_bytes(w: Workload, itemsize: int) -> int:
    """Bytes of tensor data in the whole state dict (0-d steps excluded)."""
    return itemsize * (1 + len(w.moments)) * sum(math.prod(s) for s in w.params().values())


def shard_dim(shape: tuple[int, ...], column: bool) -> int:
    return 1 if column and len(shape) > 1 else 0


def local_shape(shape: tuple[int, ...], dim: int, ranks: int, rank: int) -> list[int]:
    """The shape of ``rank``'s shard when ``shape`` is split on ``dim`` the way ``torch.chunk`` does."""
    out = list(shape)
    size = math.ceil(shape[dim] / ranks)
    out[dim] = max(0, min(size, shape[dim] - rank * size))
    return out


def seeded(name: str, rank: int, shape: Sequence[int]) -> torch.Tensor:
    """The float32 values :func:`build_state_dict` fills rank ``rank``'s shard of tensor ``name`` with."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}@{rank}".encode()))
    return torch.randn(list(shape), generator=gen, dtype=torch.float32)


def build_state_dict(w: Workload, dtype: torch.dtype, mesh: Any, column: bool, fill: bool,
                     replicated: bool = False, moment_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The model + optimizer state dict of ``w``, row- (or column-) sharded over ``mesh``, or replicated on it.

    With ``fill`` every shard holds seeded normal values (a different seed per
    tensor and rank, :func:`seeded`), otherwise uninitialised memory as a load
    destination. Weights are of ``dtype``, optimizer moments of ``moment_dtype``
    (default: ``dtype`` too).
    """
    rank, ranks = dist.get_rank(), mesh.size()

    def tensor(name: str, shape: tuple[int, ...], kind: torch.dtype) -> DTensor:
        dim = shard_dim(shape, column)
        shard = list(shape) if replicated else local_shape(shape, dim, ranks, rank)
        local = torch.empty(shard, dtype=kind)
        if fill:
            local.copy_(seeded(name, rank, shard))
        return DTensor.from_local(local, mesh, [Replicate() if replicated else Shard(dim)], run_check=False,
                                  shape=shape, stride=torch.empty(shape, device="meta").stride())

    model, state = {}, {}
    for name, shape in w.params().items():
        model[name] = tensor(name, shape, dtype)
        state[name] = {m: tensor(f"{name}.{m}", shape, moment_dtype or dtype) for m in w.moments}
        state[name]["step"] = torch.tensor(1000.0)
    groups = [{"lr": 3e-4, "weight_decay": 0.1, "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}, "step": 1000}


def local_tensors(sd: Any) -> Iterator[torch.Tensor]:
    """Every DTensor's local shard, in state dict order (plain tensors are skipped)."""
    if isinstance(sd, dict):
        for v in sd.values():
            yield from local_tensors(v)
    elif isinstance(sd, DTensor):
        yield sd.to_local()


def local_bytes(sd: Any) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(sd))


def checksums(sd: dict[str, Any]) -> list[int]:
    """Order-independent exact checksum per tensor (the sum of its bit patterns), summed over ranks."""
    sums = torch.tensor([int(_bits(t).sum(dtype=torch.int64)) for t in local_tensors(sd)], dtype=torch.int64)
    dist.all_reduce(sums)
    return sums.tolist()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])
