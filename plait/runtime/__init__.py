"""Running per-rank pipeline programs on torch.distributed."""
