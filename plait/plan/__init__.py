"""The plan: which layers go on which stage, as plain data."""

from plait.plan.partition import balance, check_partition
from plait.plan.plan import Plan

__all__ = ["Plan", "balance", "check_partition"]
