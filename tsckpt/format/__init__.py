"""The on-disk format as data: names, the metadata document, chunk grids and inner chunks, data types,
``zarr.json``, stored chunks (sharding layout, checksums, content hashes, compression), values, and the
OCDBT index of the packed layout.

Modules here encode, decode and check bytes and documents; none of them reads or writes storage (that
is :mod:`tsckpt.storage`), and how a save becomes a checkpoint is :mod:`tsckpt.commit`. Torch-free:
numpy alone (torch is imported lazily where a value needs ``torch.save``/``torch.load`` or a torch
dtype is named). See ``docs/format.md`` for the specification these modules implement.
"""
