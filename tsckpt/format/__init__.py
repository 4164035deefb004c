"""The on-disk format as data (``docs/format.md``): names, the metadata document, chunk grids, data types,
``zarr.json``, stored chunks, values and the packed layout's index. Modules here encode, decode and check
bytes and documents; none reads or writes storage (:mod:`tsckpt.storage`). Torch-free (torch is
imported lazily where a value needs it)."""
