"""Who saves and loads in the benchmarks: DCP's writers, tsckpt by both call paths and layouts, raw disk.

A contender's name says what a user calls:

* ``dcp-t<N>``: ``dcp.save``/``dcp.load`` with ``FileSystemWriter(thread_count=N)``
  and ``FileSystemReader`` (``dcp-t1`` is DCP's default), or on S3
  ``FsspecWriter``/``FsspecReader`` over s3fs;
* ``tsckpt-dcp/<layout>``: ``dcp.save(sd, storage_writer=TensorStoreWriter(p))``
  and ``dcp.load(sd, storage_reader=TensorStoreReader(p))`` with DCP's default planners;
* ``tsckpt/<layout>``: ``tsckpt.save`` / ``tsckpt.load`` (tsckpt's planners);
* ``tsckpt/<layout>[sync_files=False]``: ``tsckpt.save`` without any fsync, compared
  with torch-checkpointing, which does not sync either;
* ``torch-checkpointing``: meta-pytorch's file-per-rank ``CheckpointManager``, its
  synchronous saver, buffered writes (``use_direct_io=False``); it takes part in
  saves and same-topology loads only: its resharding metadata is all-gathered on CUDA;
* ``raw``: each rank's bytes to one file with fsync, read back with ``numpy.fromfile``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

#: Figures every contender has; the others (async, open, slice) only some.
CALL_PATHS = {"tsckpt-dcp": "dcp.save / dcp.load with TensorStoreWriter / TensorStoreReader, DCP's default planners",
              "tsckpt": "tsckpt.save / tsckpt.load"}


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way to save and load a state dict at a location (a path, or an ``s3://`` URL)."""

    name: str
    save: Callable[[dict[str, Any], str], None]
    load: Callable[[dict[str, Any], str], None]
    async_save: Callable[[dict[str, Any], str], Any] | None = None
    #: A contender that only loads another's checkpoint: that contender's name (its location).
    loads_from: str | None = None
    #: False for a contender that cannot load into another sharding on CPU ranks.
    reshards: bool = True


def layout_options(layout: str) -> dict[str, Any] | None:
    """Writer options selecting ``layout``, or None if the installed tsckpt does not accept it.

    A tsckpt without a ``layout`` option writes only the plain layout.
    """
    from tsckpt import TensorStoreWriter, TsckptError

    if "layout" not in inspect.signature(TensorStoreWriter.__init__).parameters:
        return {} if layout == "plain" else None
    try:
        TensorStoreWriter("unused-by-this-check", layout=layout)
    except (TsckptError, ValueError, TypeError):
        return None
    return {"layout": layout}


def supported_layouts(layouts: list[str]) -> tuple[list[str], list[str]]:
    """Split ``layouts`` into those the installed tsckpt writes and those it refuses."""
    ok = [lay for lay in layouts if layout_options(lay) is not None]
    return ok, [lay for lay in layouts if lay not in ok]


def s3fs_options() -> dict[str, Any]:
    """s3fs arguments reaching ``AWS_ENDPOINT_URL`` with the keys in the environment."""
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": "us-east-1"},
            "skip_instance_cache": True}


def dcp_contender(threads: int = 1, s3: bool = False) -> Contender:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    def writer(path: str) -> Any:
        if s3:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(path, thread_count=threads, **s3fs_options())
        return FileSystemWriter(path, thread_count=threads)

    def reader(path: str) -> Any:
        if s3:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(path, **s3fs_options())
        return FileSystemReader(path)

    def save(sd: dict[str, Any], path: str) -> None:
        dcp.save(sd, storage_writer=writer(path))

    def load(sd: dict[str, Any], path: str) -> None:
        dcp.load(sd, storage_reader=reader(path))

    def async_save(sd: dict[str, Any], path: str) -> Any:
        return dcp.async_save(sd, storage_writer=writer(path))

    return Contender(f"dcp-t{threads}", save, load, async_save)


def tsckpt_via_dcp(layout: str) -> Contender:
    """tsckpt's storage layer under DCP's own entry points and default planners."""
    import torch.distributed.checkpoint as dcp

    from tsckpt import TensorStoreReader, TensorStoreWriter

    options = layout_options(layout) or {}

    def save(sd: dict[str, Any], path: str) -> None:
        dcp.save(sd, storage_writer=TensorStoreWriter(path, **options))

    def load(sd: dict[str, Any], path: str) -> None:
        dcp.load(sd, storage_reader=TensorStoreReader(path))

    return Contender(f"tsckpt-dcp/{layout}", save, load)


def tsckpt_reader_variant(layout: str, **reader_options: Any) -> Contender:
    """``dcp.load`` with ``TensorStoreReader(**reader_options)`` of what :func:`tsckpt_via_dcp` saved."""
    import torch.distributed.checkpoint as dcp

    from tsckpt import TensorStoreReader

    base = tsckpt_via_dcp(layout)

    def load(sd: dict[str, Any], path: str) -> None:
        dcp.load(sd, storage_reader=TensorStoreReader(path, **reader_options))

    extra = ",".join(f"{k}={v!r}" for k, v in reader_options.items())
    return Contender(f"{base.name}[{extra}]", base.save, load, loads_from=base.name)


def tsckpt_api(layout: str, **writer_options: Any) -> Contender:
    """``tsckpt.save`` / ``tsckpt.load`` / ``tsckpt.async_save``, with extra ``writer_options`` if given."""
    import tsckpt

    options = (layout_options(layout) or {}) | writer_options
    extra = f"[{','.join(f'{k}={v!r}' for k, v in writer_options.items())}]" if writer_options else ""

    def save(sd: dict[str, Any], path: str) -> None:
        tsckpt.save(sd, path, **options)

    def load(sd: dict[str, Any], path: str) -> None:
        tsckpt.load(sd, path)

    def async_save(sd: dict[str, Any], path: str) -> Any:
        return tsckpt.async_save(sd, path, **options)

    return Contender(f"tsckpt/{layout}{extra}", save, load, async_save)


def _raw_save(sd: dict[str, Any], path: str) -> None:
    import torch
    import torch.distributed as dist

    from workloads import local_tensors

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"rank{dist.get_rank()}.bin"), "wb") as f:
        for t in local_tensors(sd):
            f.write(t.contiguous().view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def _raw_load(sd: dict[str, Any], path: str) -> None:
    import numpy as np
    import torch.distributed as dist

    np.fromfile(os.path.join(path, f"rank{dist.get_rank()}.bin"), dtype=np.uint8)


RAW = Contender("raw", _raw_save, _raw_load)


TORCH_CHECKPOINTING = "torch-checkpointing"
#: The writer option of the tsckpt contender compared with torch-checkpointing: neither syncs.
UNSYNCED = {"sync_files": False}


def torch_checkpointing() -> Contender:
    """torch-checkpointing's ``CheckpointManager`` with its synchronous saver, one file per item and rank.

    ``use_direct_io=False``: its O_DIRECT default fails on ext4 with unaligned
    writes. No resharder is declared, so a load reads each rank's own files back
    into the same shards; declaring one makes its metadata all-gather allocate on
    CUDA, which CPU ranks do not have.
    """
    # One manager for every save and load of the phase, made at the first, as a
    # training job keeps one: its set-up is billed to a job's first save only.
    made: list[Any] = []

    def manager() -> Any:
        if not made:
            from torch_checkpointing import CheckpointManager
            from torch_checkpointing.config import SyncCheckpointSaverConfig
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

            storage = LocalFileSystemStorageConfig(use_direct_io=False)
            made.append(CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(),
                                                                   storage_config=storage)))
        return made[0]

    def save(sd: dict[str, Any], path: str) -> None:
        manager().save(path, sd)

    def load(sd: dict[str, Any], path: str) -> None:
        manager().load(path, into=sd)

    return Contender(TORCH_CHECKPOINTING, save, load, reshards=False)


#: Optional peers: contender name -> (module it needs, package that provides it).
OPTIONAL = {TORCH_CHECKPOINTING: ("torch_checkpointing", "torch-checkpointing==0.1.1")}


def missing_peers(names: Sequence[str]) -> dict[str, str]:
    """Of ``names``, the optional peers whose package is not installed: name -> why it is skipped."""
    import importlib.util

    return {n: f"{OPTIONAL[n][1]} is not installed (pip install {OPTIONAL[n][1]!r}, or the bench extra)"
            for n in names if importlib.util.find_spec(OPTIONAL[n][0]) is None}


def unsynced_contenders(layout: str, peers: Sequence[str]) -> list[Contender]:
    """``tsckpt.save`` with :data:`UNSYNCED`, then the peers in ``peers`` that do not sync either.

    Its ``async_save`` is left out: the async figures are times until durable.
    """
    ours = dataclasses.replace(tsckpt_api(layout, **UNSYNCED), async_save=None)
    make = {TORCH_CHECKPOINTING: torch_checkpointing}
    return [ours, *(make[p]() for p in peers)]


PATHS = ("dcp", "api")


def tsckpt_contenders(layouts: list[str], variants: list[dict[str, Any]] = (),
                      paths: Sequence[str] = PATHS) -> list[Contender]:
    """The call paths asked for (``dcp.save``/``dcp.load``, ``tsckpt.save``/``tsckpt.load``) for each layout,
    then ``tsckpt.save`` with each variant's extra writer options."""
    make = {"dcp": tsckpt_via_dcp, "api": tsckpt_api}
    out = [make[p](lay) for lay in layouts for p in PATHS if p in paths]
    return out + [tsckpt_api(layouts[0], **v) for v in variants]


def contenders(cfg: dict[str, Any], *, raw: bool, s3: bool = False) -> list[Contender]:
    """Everyone taking part in a phase described by ``cfg`` (``dcp_threads``, ``layouts``; with ``unsynced``,
    the contenders that do not sync, and the optional peers named in ``peers``)."""
    out = [RAW] if raw else []
    out += [dcp_contender(t, s3) for t in cfg["dcp_threads"]]
    out += tsckpt_contenders(cfg["layouts"], cfg.get("variants", []), cfg.get("paths", PATHS))
    if cfg.get("unsynced"):
        out += unsynced_contenders(cfg["layouts"][0], cfg.get("peers", []))
    named: dict[str, Contender] = {}
    for c in out:  # --variants sync_files=False names the unsynced contender again: the later one stays
        named[c.name] = c
    return list(named.values())
