"""Drafters: one module per method; `methods` (the registry) builds them by name."""

from __future__ import annotations

from ..draft import Draft
from .base import Budget, Calibration, Candidates, Drafter, NullDrafter, sized
from .chain import ChainDrafter, ChainGates

__all__ = ["Budget", "Calibration", "Candidates", "ChainDrafter", "ChainGates", "Draft", "Drafter", "NullDrafter",
           "sized"]
