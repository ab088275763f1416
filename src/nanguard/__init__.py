"""nanguard: keeps PyTorch training numerically healthy.

Watch every step at near-zero cost, warn before the NaN, record the run, and act on a policy.
"""

__version__ = "0.1.0"

from nanguard.audit.preflight import preflight  # noqa: E402
from nanguard.config import DetectConfig, GuardConfig, RecordConfig, WatchConfig  # noqa: E402
from nanguard.detect.alarm import Alarm  # noqa: E402
from nanguard.errors import NanguardError  # noqa: E402
from nanguard.guard import Guard  # noqa: E402
from nanguard.record.report import Report, load_report  # noqa: E402

__all__ = [
    "Alarm",
    "DetectConfig",
    "Guard",
    "GuardConfig",
    "NanguardError",
    "RecordConfig",
    "Report",
    "WatchConfig",
    "load_report",
    "preflight",
]
