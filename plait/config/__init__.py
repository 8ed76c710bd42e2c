"""The user's configuration: `Config`, the planner's input, and the choices it accepts."""

from plait.config.config import NONFINITE_ACTIONS, SCHEDULE_NAMES, SEARCH_ORDER, TP_PLACEMENT, TP_STRATEGIES, Config

__all__ = ["Config", "SCHEDULE_NAMES", "SEARCH_ORDER", "NONFINITE_ACTIONS", "TP_STRATEGIES", "TP_PLACEMENT"]
