"""Deprecated home of `init_process_group`: use `plait.init_process_group` (it lives in `plait.job`)."""

from __future__ import annotations

import warnings

from plait.job.process_group import init_process_group

__all__ = ["init_process_group"]

warnings.warn("plait.runtime.process_group is deprecated: use plait.init_process_group",
              DeprecationWarning, stacklevel=2)
