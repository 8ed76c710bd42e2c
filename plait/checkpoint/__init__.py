"""Checkpoints: the disk format, tensor files, a rank's train state, where a resumed fit starts, the checkpointer, and named weights."""
