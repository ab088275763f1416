"""Detect: turn each step's statistics into alarms, before the NaN where the signals allow."""

from nanguard.detect.alarm import ALARM_KINDS, Alarm
from nanguard.detect.base import Detector
from nanguard.detect.cascade import CascadeDetector
from nanguard.detect.detectors import default_detectors
from nanguard.detect.divergence import DivergenceDetector
from nanguard.detect.forecast import ForecastDetector
from nanguard.detect.nonfinite import NonFiniteDetector
from nanguard.detect.spike import SpikeDetector
from nanguard.detect.vanishing import VanishingDetector

__all__ = [
    "ALARM_KINDS",
    "Alarm",
    "CascadeDetector",
    "Detector",
    "DivergenceDetector",
    "ForecastDetector",
    "NonFiniteDetector",
    "SpikeDetector",
    "VanishingDetector",
    "default_detectors",
]
