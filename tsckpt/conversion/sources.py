"""Checkpoint formats that tsckpt converts between: detection and sources.

A :class:`Source` lists every entry up front (key path, shape and dtype of each tensor; non-tensor values,
which are small, loaded eagerly) and :meth:`Source.read` returns one whole tensor, so a conversion holds about
one tensor in memory. How each format is read, and written (:mod:`tsckpt.conversion.targets`):

- tsckpt: one TensorStore read per tensor; written by :class:`~tsckpt.conversion.builder.CheckpointBuilder`.
- DCP FileSystemWriter: one ``dcp.load`` per key; written by ``dcp.save`` with meta-tensor placeholders whose
  data the planner's ``resolve_data`` reads when the writer asks for it (one file per tensor: FileSystemWriter
  keeps every tensor of a file alive until that file is finished).
- torch.save: ``torch.load(mmap=True)``; written as a skeleton by ``torch.save`` under ``skip_data`` with fake
  tensors, filled in place through a shared mmap one tensor at a time, and the zip CRCs fixed up.
- safetensors: ``safe_open``; written header first, then each tensor's bytes. Sharded HF directories are read
  through ``model.safetensors.index.json`` and written with one.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import CheckpointNotFoundError, ConversionError, OptionError, UnsafeObjectError
from ..commit import protocol as commit
from ..format import dtypes, object_values
from ..storage.box_reader import BoxReader
from ..storage.chunk_source import ChunkSource
from ..storage.store import read_error
from ..format.names import KeyPath

#: safetensors dtype codes (the file format's names) and the torch dtypes they hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
_SAFETENSORS_CODE = {v: k for k, v in SAFETENSORS_DTYPES.items()}
HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """What a source knows about one tensor before reading it."""

    key_path: KeyPath
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Options:
    """Conversion options that targets and sources look at."""

    overwrite: bool = False
    trust_pickle: bool = False
    max_shard_size: int | None = None
    #: The storage layout of a tsckpt target ("plain" or "packed"; None: the default layout).
    layout: str | None = None


class Sink:
    """Where a target reports progress (bytes done) and what it could not hold."""

    def __init__(self, advance: Callable[[int], None] = lambda n: None, warn: Callable[[str], None] = lambda m: None):
        self.advance, self.warn = advance, warn
        #: Entries the target could not hold and left out (after warning about them).
        self.skipped_tensors = self.skipped_objects = 0


class Source:
    """An opened checkpoint: the catalog up front, tensor data one key at a time."""

    format: ClassVar[str]

    def __init__(self, path: Any, *, trust_pickle: bool = False):
        self.path, self.trust_pickle = path, trust_pickle
        self.tensors: dict[str, TensorInfo] = {}
        self.objects: dict[str, tuple[KeyPath, Any]] = {}
        self.header: dict[str, str] = {}  # free-form string metadata (safetensors ``__metadata__``)

    @classmethod
    def detect(cls, path: str) -> bool:
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` as a contiguous CPU tensor."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def key_paths(self) -> dict[str, KeyPath]:
        return {k: i.key_path for k, i in self.tensors.items()} | {k: p for k, (p, _) in self.objects.items()}


class TsckptSource(Source):
    format = "tsckpt"

    def __init__(self, path: Any, *, trust_pickle: bool = False):
        super().__init__(path, trust_pickle=trust_pickle)
        self._store, self.metadata = commit.open_committed(path)
        self._source = ChunkSource.of(self._store, self.metadata)
        self.tensors = {key: TensorInfo(e.key_path, e.shape, dtypes.to_torch_dtype(dtypes.from_zarr(e.dtype)))
                        for key, e in self.metadata.tensors.items()}
        self.objects = {key: (o.key_path, self._object(key, o)) for key, o in self.metadata.objects.items()}
        header = self.metadata.extra.get("source_header")
        if isinstance(header, dict):
            self.header = {str(k): str(v) for k, v in header.items()}

    @classmethod
    def detect(cls, path: str) -> bool:
        return os.path.isfile(os.path.join(path, commit.ROOT))

    def _object(self, key: str, entry: Any) -> Any:
        if entry.encoding == object_values.JSON:
            return object_values.from_json(entry.value)
        return object_values.load_torch_value(self._source.read_blob(key, entry.path), key=key, where=self._store.url,
                                       allow_pickle=self.trust_pickle, opt_in="trust_pickle=True (--trust-pickle)")

    def read(self, key: str) -> torch.Tensor:
        entry = self.metadata.tensors[key]
        try:
            data = BoxReader(self._source, entry, f"tensor {key!r} in {self._store.url}").read(
                (0,) * len(entry.shape), entry.shape)
        except ValueError as e:
            raise read_error(key, self._store.url, e) from None
        # not np.ascontiguousarray: it turns a 0-d array into a 1-d one
        return dtypes.numpy_as_tensor(data if data.flags.c_contiguous else data.copy())


class DcpSource(Source):
    """A DCP FileSystemWriter directory, read one key at a time in this process."""

    format = "dcp"

    def __init__(self, path: Any, *, trust_pickle: bool = False):
        super().__init__(path, trust_pickle=trust_pickle)
        if not trust_pickle:
            raise UnsafeObjectError(
                f"{path} is a DCP FileSystemWriter checkpoint: reading it unpickles {path}/.metadata (and "
                "torch.load's its non-tensor values), which can run code stored in those files; pass "
                "trust_pickle=True (--trust-pickle) only if you trust where it came from")
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        class CachedReader(FileSystemReader):
            # dcp.load re-reads .metadata on every call; one unpickling is enough.
            cached: Any = None

            def read_metadata(self, *a: Any, **k: Any) -> Any:
                if self.cached is None:
                    self.cached = super().read_metadata(*a, **k)
                return self.cached

        self._reader = CachedReader(os.fspath(path))
        md = self._reader.read_metadata()
        paths = md.planner_data if isinstance(md.planner_data, dict) else {}
        values = []
        for fqn, m in md.state_dict_metadata.items():
            key_path = tuple(paths.get(fqn, (fqn,)))
            if isinstance(m, TensorStorageMetadata):
                self.tensors[fqn] = TensorInfo(key_path, tuple(m.size), m.properties.dtype)
            else:
                values.append((fqn, key_path))
        loaded = self._load({fqn: None for fqn, _ in values})
        self.objects = {fqn: (key_path, loaded[fqn]) for fqn, key_path in values}

    @classmethod
    def detect(cls, path: str) -> bool:
        return os.path.isfile(os.path.join(path, ".metadata"))

    def _load(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        if state_dict:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process on purpose
                dcp.load(state_dict, storage_reader=self._reader, planner=DefaultLoadPlanner())
        return state_dict

    def read(self, key: str) -> torch.Tensor:
        info = self.tensors[key]
        return self._load({key: torch.empty(info.shape, dtype=info.dtype)})[key]


def _safetensors_header(path: str) -> dict[str, Any] | None:
    """The JSON header of a safetensors file, or None if ``path`` is not one."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > os.path.getsize(path) - 8 or n > 100 << 20:
                return None
            doc = json.loads(f.read(n))
    except (OSError, struct.error, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class SafetensorsSource(Source):
    format = "safetensors"

    def __init__(self, path: Any, *, trust_pickle: bool = False, files: list[str] | None = None):
        super().__init__(path, trust_pickle=trust_pickle)
        from safetensors import safe_open

        self._handles = [safe_open(f, framework="pt", device="cpu") for f in (files or [os.fspath(path)])]
        self._where: dict[str, Any] = {}
        for h in self._handles:
            self.header |= {str(k): str(v) for k, v in (h.metadata() or {}).items()}
            for key in h.keys():
                sl = h.get_slice(key)
                code = sl.get_dtype()
                if code not in SAFETENSORS_DTYPES:
                    raise ConversionError(f"tensor {key!r} in {path}: safetensors dtype {code!r} is not supported; "
                                      f"expected one of {sorted(SAFETENSORS_DTYPES)}")
                self.tensors[key] = TensorInfo((key,), tuple(sl.get_shape()), SAFETENSORS_DTYPES[code])
                self._where[key] = h

    @classmethod
    def detect(cls, path: str) -> bool:
        return os.path.isfile(path) and _safetensors_header(path) is not None

    def read(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def close(self) -> None:
        self._handles.clear()
        self._where.clear()


class HfShardedSource(SafetensorsSource):
    """A Hugging Face directory of safetensors shards listed by ``*.safetensors.index.json``."""

    format = "hf-sharded"

    def __init__(self, path: Any, *, trust_pickle: bool = False):
        index_path = _hf_index(os.fspath(path))
        assert index_path is not None
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index_path}: no 'weight_map' object mapping tensor names to shard files")
        folder = os.path.dirname(index_path)
        files = [os.path.join(folder, name) for name in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointNotFoundError(f"{index_path} lists shard {missing[0]} which does not exist")
        super().__init__(path, trust_pickle=trust_pickle, files=files)

    @classmethod
    def detect(cls, path: str) -> bool:
        return _hf_index(path) is not None


def _hf_index(path: str) -> str | None:
    if os.path.isfile(path) and path.endswith(".safetensors.index.json"):
        return path
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, HF_INDEX)):
        return os.path.join(path, HF_INDEX)
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
    return os.path.join(path, found[0]) if len(found) == 1 else None


class TorchSaveSource(Source):
    """A ``torch.save`` file of a (nested) state dict, memory-mapped."""

    format = "torch"

    def __init__(self, path: Any, *, trust_pickle: bool = False):
        super().__init__(path, trust_pickle=trust_pickle)
        from ..dcp.torch_private import flatten_state_dict

        try:
            try:
                sd = torch.load(path, map_location="cpu", mmap=True, weights_only=not trust_pickle)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                # Legacy (pre-zip) files cannot be mapped: they are read whole.
                sd = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
        except Exception as e:
            if trust_pickle or "weights_only" not in str(e):
                raise ConversionError(f"torch.load({path}) failed: {e}") from e
            raise UnsafeObjectError(f"{path} holds objects that torch.load(weights_only=True) refuses; pass "
                                    "trust_pickle=True (--trust-pickle) only if you trust this file") from None
        if not isinstance(sd, Mapping):
            raise ConversionError(f"{path} holds a {type(sd).__name__}; expected a (nested) dict state dict")
        flat, mapping = flatten_state_dict(dict(sd))
        self._flat = flat
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                self.tensors[key] = TensorInfo(tuple(mapping[key]), tuple(value.shape), value.dtype)
            else:
                self.objects[key] = (tuple(mapping[key]), value)

    @classmethod
    def detect(cls, path: str) -> bool:
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            head = f.read(4)
        return head == b"PK\x03\x04" or head[:1] == b"\x80"  # zip (torch >= 1.6) or legacy pickle

    def read(self, key: str) -> torch.Tensor:
        return self._flat[key].contiguous()

    def close(self) -> None:
        self._flat = {}


#: Detection order matters: a directory is tsckpt, DCP or HF; a file safetensors before torch.
SOURCES: dict[str, type[Source]] = {
    cls.format: cls for cls in (TsckptSource, DcpSource, HfShardedSource, SafetensorsSource, TorchSaveSource)
}


def detect_format(path: Any) -> str:
    """The source format of ``path`` (one of :data:`SOURCES`), or a clear error."""
    if isinstance(path, Mapping):
        return TsckptSource.format
    text = os.fspath(path)
    if not os.path.exists(text):
        raise CheckpointNotFoundError(f"no checkpoint at {text}: the path does not exist")
    for name, cls in SOURCES.items():
        if cls.detect(text):
            return name
    raise ConversionError(f"cannot tell the format of {text}: expected a tsckpt checkpoint (zarr.json), a DCP "
                      f"directory (.metadata), an HF directory ({HF_INDEX}), a safetensors file or a torch.save file")


def open_source(path: Any, *, format: str | None = None, trust_pickle: bool = False) -> Source:
    name = format or detect_format(path)
    if name not in SOURCES:
        raise OptionError(f"unknown source format {name!r}; expected one of {sorted(SOURCES)}")
    return SOURCES[name](path, trust_pickle=trust_pickle)
