"""The plan: how the model is laid out on the ranks, as plain data."""

from plait.plan.mesh import Mesh
from plait.plan.plan import Plan

__all__ = ["Plan", "Mesh"]
