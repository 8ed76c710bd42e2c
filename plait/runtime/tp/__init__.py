"""Tensor parallelism at run time: a stage graph's parameters split, its collectives inserted."""
