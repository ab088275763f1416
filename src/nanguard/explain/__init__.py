"""Explain: turn the evidence of a run into ranked causes, each with a concrete fix."""

from nanguard.explain.engine import RULES, diagnose
from nanguard.explain.evidence import Cause, Evidence

__all__ = ["RULES", "Cause", "Evidence", "diagnose"]
