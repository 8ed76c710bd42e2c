"""The `plait` command and its subcommands, and the demo with its datasets."""

from plait.cli.main import main

__all__ = ["main"]
