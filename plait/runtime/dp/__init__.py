"""Data parallelism at run time: gradients summed over replicas, optimizer state sharded (ZeRO)."""
