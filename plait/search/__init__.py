"""The search: the cuts, widths and strategies that minimise the cost model's step time."""
