"""The torch.distributed.checkpoint integration: planners, storage writer and reader, staging, save/load."""
