"""How a save becomes a visible checkpoint: targets, publication, the commit protocol, checkpoint states."""
