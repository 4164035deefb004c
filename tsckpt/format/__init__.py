"""The on-disk format: names, metadata document, chunk grids, data types, zarr.json, values, commit, publication.

Torch-free: everything here works with numpy and TensorStore alone (torch is
imported lazily where a value needs ``torch.save``/``torch.load``).
See ``docs/format.md`` for the specification these modules implement.
"""
