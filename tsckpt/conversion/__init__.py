"""Converting between checkpoint formats and comparing checkpoints: sources, targets, builder."""
