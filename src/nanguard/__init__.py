"""nanguard: keeps PyTorch training numerically healthy.

Watch every step at near-zero cost, warn before the NaN, pinpoint the op that produced it,
explain it, recover when asked, and record the run.
"""

__version__ = "0.1.0"

from nanguard.audit.preflight import preflight  # noqa: E402
from nanguard.config import (  # noqa: E402
    AmpConfig,
    ClipConfig,
    DetectConfig,
    GuardConfig,
    RecordConfig,
    RecoverConfig,
    WatchConfig,
)
from nanguard.detect.alarm import Alarm  # noqa: E402
from nanguard.errors import NanguardError  # noqa: E402
from nanguard.guard import Guard  # noqa: E402
from nanguard.record.report import Report, load_report  # noqa: E402

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
]
