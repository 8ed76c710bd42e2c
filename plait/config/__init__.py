"""The user's configuration: `Config`, the planner's input, and `plait run`'s options applied to it."""

from plait.config.config import UNPLANNED, Config

__all__ = ["Config", "UNPLANNED"]
