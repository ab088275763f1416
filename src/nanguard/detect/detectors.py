"""The default detector set, pre-step ones first (each detector lives in a module of its own)."""

from __future__ import annotations

from nanguard.config import DetectConfig
from nanguard.detect.base import Detector
from nanguard.detect.cascade import CascadeDetector
from nanguard.detect.divergence import DivergenceDetector
from nanguard.detect.forecast import ForecastDetector
from nanguard.detect.nonfinite import NonFiniteDetector
from nanguard.detect.spike import SpikeDetector
from nanguard.detect.vanishing import VanishingDetector

__all__ = [
    "CascadeDetector",
    "Detector",
    "DivergenceDetector",
    "ForecastDetector",
    "NonFiniteDetector",
    "SpikeDetector",
    "VanishingDetector",
    "default_detectors",
]


def default_detectors(config: DetectConfig, act_limit: float | None = None) -> list[Detector]:
    """The detectors every guard runs, pre-step ones first."""
    limits = {"act_max": act_limit} if act_limit else None
    return [
        NonFiniteDetector(config, "pre"),
        SpikeDetector(config),
        NonFiniteDetector(config, "post"),
        CascadeDetector(config),
        ForecastDetector(config, limits),
        DivergenceDetector(config),
        VanishingDetector(config),
    ]
