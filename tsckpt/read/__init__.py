"""Reading a checkpoint in any plain process: ``tsckpt.open`` and end-to-end verification."""
