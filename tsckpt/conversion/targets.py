"""Conversion targets: write a :class:`~tsckpt.conversion.sources.Source` one tensor at a time (how each bounds
memory: :mod:`tsckpt.conversion.sources`)."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointExistsError, ConversionError
from ..format import dtypes
from ..format.names import flat_key
from .builder import CheckpointBuilder
from .sources import _SAFETENSORS_CODE, HF_INDEX, Options, Sink, Source, TensorInfo


def _refuse_existing(path: str, opts: Options, marker: str | None = None) -> None:
    probe = os.path.join(path, marker) if marker else path
    if os.path.exists(probe) and not opts.overwrite:
        raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")


def _nested(source: Source, values: dict[str, Any]) -> dict[str, Any]:
    from ..dcp.torch_private import unflatten_state_dict

    key_paths = source.key_paths()
    flats = [flat_key(p) for p in key_paths.values()]
    if len(set(flats)) != len(flats):
        dup = next(f for f in flats if flats.count(f) > 1)
        raise ConversionError(f"two entries of {source.path} flatten to the same key {dup!r}")
    return unflatten_state_dict(values, key_paths)


def write_tsckpt(source: Source, dst: Any, opts: Options, sink: Sink) -> None:
    extra = {"converted_from": {"format": source.format, "path": str(source.path)}}
    if source.header:
        extra["source_header"] = dict(source.header)
    with CheckpointBuilder(dst, overwrite=opts.overwrite, extra=extra, layout=opts.layout) as b:
        for key, info in source.tensors.items():
            b.add_tensor(info.key_path, source.read(key))
            sink.advance(info.nbytes)
        for key_path, value in source.objects.values():
            b.add_object(key_path, value)


def write_dcp(source: Source, dst: Any, opts: Options, sink: Sink) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    dst = os.fspath(dst)
    _refuse_existing(dst, opts, ".metadata")
    by_flat = {flat_key(i.key_path): k for k, i in source.tensors.items()}

    class StreamingPlanner(DefaultSavePlanner):
        # Placeholders are meta tensors; the data is read when the writer asks for it.
        def resolve_data(self, write_item: Any) -> Any:
            key = by_flat.get(write_item.index.fqn)
            if key is None:
                return super().resolve_data(write_item)
            tensor = source.read(key)
            sink.advance(source.tensors[key].nbytes)
            return tensor

    values = {k: torch.empty(i.shape, dtype=i.dtype, device="meta") for k, i in source.tensors.items()}
    values |= {k: v for k, (_, v) in source.objects.items()}
    writer = dcp.FileSystemWriter(dst, single_file_per_rank=False, thread_count=1, overwrite=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_nested(source, values), storage_writer=writer, planner=StreamingPlanner())


def write_torch(source: Source, dst: Any, opts: Options, sink: Sink) -> None:
    from ..dcp.torch_private import FakeTensorMode, get_element

    dst = os.fspath(dst)
    _refuse_existing(dst, opts)
    with FakeTensorMode():
        values = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in source.tensors.items()}
    values |= {k: v for k, (_, v) in source.objects.items()}
    tmp = dst + ".partial"
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(_nested(source, values), tmp)
    del values
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        skeleton = torch.load(tmp, mmap=True, weights_only=not opts.trust_pickle)
    for key, info in source.tensors.items():
        dest = get_element(skeleton, info.key_path)
        if dest.numel():
            dest.copy_(source.read(key))
        sink.advance(info.nbytes)
        del dest
    del skeleton  # unmaps the file; its pages are already in the page cache
    _fix_zip_crcs(tmp)
    os.replace(tmp, dst)


def _fix_zip_crcs(path: str) -> None:
    """Rewrite the CRC-32 of every stored zip record (skip_data leaves them 0)."""
    import zipfile

    with open(path, "r+b") as f, zipfile.ZipFile(path) as z:
        infos = z.infolist()
        start_dir = z.start_dir
        crcs = []
        for info in infos:
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            f.seek(info.header_offset + 30 + name_len + extra_len)
            crc, left = 0, info.file_size
            while left:
                block = f.read(min(left, 64 << 20))
                crc, left = zlib.crc32(block, crc), left - len(block)
            crcs.append(crc)
            f.seek(info.header_offset + 14)
            f.write(struct.pack("<I", crc))
        pos = start_dir
        for crc in crcs:  # central directory entries come in the same order
            f.seek(pos)
            head = f.read(46)
            if head[:4] != b"PK\x01\x02":
                raise ConversionError(f"{path}: unexpected zip central directory layout")
            f.seek(pos + 16)
            f.write(struct.pack("<I", crc))
            pos += 46 + sum(struct.unpack("<HHH", head[28:34]))


def _safetensors_plan(source: Source, sink: Sink) -> list[tuple[str, str, TensorInfo]]:
    """(source key, safetensors name, info) of every tensor safetensors can hold; warns about the rest."""
    dropped = sorted(source.objects)
    if dropped:
        sink.warn(f"safetensors holds no non-tensor values; not written: {', '.join(dropped)}")
    bad = sorted(k for k, i in source.tensors.items() if i.dtype not in _SAFETENSORS_CODE)
    if bad:
        sink.warn(f"safetensors has no dtype for these tensors; not written: {', '.join(bad)}")
    sink.skipped_objects, sink.skipped_tensors = len(dropped), len(bad)
    nested = sorted(k for k, i in source.tensors.items() if len(i.key_path) > 1)
    if nested:
        sink.warn(f"safetensors names are flat: {len(nested)} nested keys are written as dotted names "
                  f"(e.g. {nested[0]!r}), so their nesting is not kept")
    return [(k, flat_key(i.key_path), i) for k, i in source.tensors.items() if k not in bad]


def _write_safetensors_file(path: str, source: Source, items: list[tuple[str, str, TensorInfo]],
                            header: dict[str, str], sink: Sink) -> None:
    doc: dict[str, Any] = {"__metadata__": header} if header else {}
    offset = 0
    for _, name, info in items:
        doc[name] = {"dtype": _SAFETENSORS_CODE[info.dtype], "shape": list(info.shape),
                     "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors itself writes it
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for key, name, info in items:
            tensor = source.read(key)
            if tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
                raise ConversionError(f"tensor {key!r} of {source.path} read as {tensor.dtype}{list(tensor.shape)}, "
                                  f"listed as {info.dtype}{list(info.shape)}")
            if info.nbytes:
                f.write(memoryview(dtypes.tensor_as_numpy(tensor.contiguous()).reshape(-1).view(np.uint8)))
            sink.advance(info.nbytes)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_safetensors(source: Source, dst: Any, opts: Options, sink: Sink) -> None:
    """One ``.safetensors`` file, or (a directory, or ``max_shard_size`` given) HF shards plus an index."""
    dst = os.fspath(dst)
    items = _safetensors_plan(source, sink)
    header = dict(source.header)
    if dst.endswith(".safetensors") and opts.max_shard_size is None:
        _refuse_existing(dst, opts)
        _write_safetensors_file(dst, source, items, header, sink)
        return
    _refuse_existing(dst, opts, HF_INDEX)
    limit = opts.max_shard_size or math.inf
    shards: list[list[tuple[str, str, TensorInfo]]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item[2].nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[2].nbytes
    os.makedirs(dst, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors_file(os.path.join(dst, name), source, shard, header or {"format": "pt"}, sink)
        weight_map |= {n: name for _, n, _ in shard}
    index = {"metadata": {"total_size": sum(i.nbytes for _, _, i in items)}, "weight_map": weight_map}
    with open(os.path.join(dst, HF_INDEX), "w") as f:
        json.dump(index, f, indent=2)


TARGETS: dict[str, Callable[[Source, Any, Options, Sink], None]] = {
    "tsckpt": write_tsckpt,
    "dcp": write_dcp,
    "torch": write_torch,
    "safetensors": write_safetensors,
}
