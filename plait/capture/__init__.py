"""Capturing an nn.Module into a graph of layers and cutting it into stage modules."""
