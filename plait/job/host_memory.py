"""Host memory of CPU ranks: glibc's malloc told to keep large freed blocks for the next step.

glibc maps an allocation above its mmap threshold (128 KiB, rising with use to at most 32 MiB)
as pages of its own, unmapped when freed, and gives the heap's free top back to the kernel past
its trim threshold (128 KiB). A training step allocates the same large buffers every time --
gradients, flat gradient buckets, ZeRO's buffers of updated parameters -- so each step faults in
every 4 KiB page of them again: on a 2-core virtual machine a data-parallel ZeRO-1 step of a
134 MB MLP took 517 ms, and 276 ms with large blocks kept for reuse (docs/benchmarks.md,
"Keeping freed host memory"). `keep_freed_memory` raises both thresholds to 2 GiB (mallopt), once
per process: on gloo ranks, with glibc, and not where the user set MALLOC_MMAP_THRESHOLD_ or
MALLOC_TRIM_THRESHOLD_ (theirs wins). The price: memory a rank frees stays with it, for its own
later allocations, rather than going back to the system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any

__all__ = ["keep_freed_memory", "give_back_freed_memory", "USER_SETTINGS"]

log = logging.getLogger("plait")

USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_KEEP = 2**31 - 1  # bytes: the largest value mallopt takes (an int)
_GIVE_BACK = 128 * 1024  # bytes: glibc's default thresholds, held fixed
_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module); True if set now
    or before, False where it does not apply (not glibc, or the user's own settings)."""
    global _done
    if _done:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not (mallopt(_M_MMAP_THRESHOLD, _KEEP) and mallopt(_M_TRIM_THRESHOLD, _KEEP)):
        return False
    log.info("plait: large freed host memory kept for reuse (mallopt; set %s to choose otherwise)", USER_SETTINGS[0])
    _done = True
    return True


def give_back_freed_memory() -> bool:
    """Undo `keep_freed_memory` for this process: large buffers freed go back to the system at once
    (glibc's default thresholds, held fixed), for a rank whose point is its peak memory (zero=3:
    its layers' gathered parameters and gradients come and go, and freed ones kept would pile up).
    False where it does not apply (not glibc, or the user's own settings)."""
    global _done
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _done = False
    return bool(mallopt(_M_MMAP_THRESHOLD, _GIVE_BACK) and mallopt(_M_TRIM_THRESHOLD, _GIVE_BACK))


def _mallopt() -> Any:
    """glibc's mallopt, None where plait leaves malloc alone (the user's own settings, not glibc)."""
    if any(name in os.environ for name in USER_SETTINGS):
        return None
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
