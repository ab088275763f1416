"""nanguard: keeps PyTorch training numerically healthy.

Watch every step at near-zero cost, warn before the NaN, pinpoint the op that produced it,
explain it, recover when asked, and record the run.
"""

from nanguard._version import __version__  # noqa: F401 - the public version
from nanguard.audit.preflight import preflight
from nanguard.audit.save import save
from nanguard.config import (
    AmpConfig,
    ClipConfig,
    DetectConfig,
    GuardConfig,
    RecordConfig,
    RecoverConfig,
    WatchConfig,
)
from nanguard.detect.alarm import Alarm
from nanguard.errors import NanguardError
from nanguard.guard import Guard
from nanguard.record.report import Report, load_report

__all__ = [
    "Alarm",
    "AmpConfig",
    "ClipConfig",
    "DetectConfig",
    "Guard",
    "GuardConfig",
    "NanguardError",
    "RecordConfig",
    "RecoverConfig",
    "Report",
    "WatchConfig",
    "load_report",
    "preflight",
    "save",
]
