"""Configuration of a Guard: nested keyword-only dataclasses, one docstring per field.

Defaults are chosen so that a healthy run never raises an alarm (see tests/test_false_alarms.py)
while the LR/momentum cascade is flagged several steps before its first non-finite value.

One module per section: watch.py (`WatchConfig`), detect.py (`DetectConfig`), record.py
(`RecordConfig`), recover.py (`RecoverConfig`, `ClipConfig`, `HealConfig`, `AmpConfig`) and
guard.py (`GuardConfig`, which nests them and checks them together); strict.py makes every
one refuse a misspelled field. Every name is imported from here, `nanguard.config`.
"""

from nanguard.config.detect import OBJECTIVES, DetectConfig
from nanguard.config.guard import EARLY_WARNINGS, POLICIES, GuardConfig, default_act_on
from nanguard.config.record import IF_EXISTS, RecordConfig
from nanguard.config.recover import AmpConfig, ClipConfig, HealConfig, RecoverConfig
from nanguard.config.watch import WatchConfig

__all__ = [
    "EARLY_WARNINGS",
    "IF_EXISTS",
    "OBJECTIVES",
    "POLICIES",
    "AmpConfig",
    "ClipConfig",
    "DetectConfig",
    "GuardConfig",
    "HealConfig",
    "RecordConfig",
    "RecoverConfig",
    "WatchConfig",
    "default_act_on",
]
