"""Detect: turn each step's statistics into alarms, before the NaN where the signals allow."""

from nanguard.detect.alarm import ALARM_KINDS, Alarm
from nanguard.detect.detectors import (
    CascadeDetector,
    Detector,
    DivergenceDetector,
    ForecastDetector,
    NonFiniteDetector,
    SpikeDetector,
    VanishingDetector,
    default_detectors,
)

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
