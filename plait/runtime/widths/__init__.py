"""Stages of different widths: the ranks of each stage and the crossings between them."""
