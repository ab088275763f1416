"""nanguard: keeps PyTorch training numerically healthy.

Watch every step at near-zero cost, warn before the NaN, pinpoint the op that produced it,
explain it, recover when asked, and record the run.

The public names are imported on first use (PEP 562), not here: `import nanguard` stays free
of torch, so `nanguard --help`, `--version` and `lint` answer at once and a tool that only
reads `nanguard.__version__` does not pay for torch's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The one source of the version is nanguard/_version.py (pyproject.toml reads it through
# tool.setuptools.dynamic; the guard imports it from there without importing this package).
from nanguard._version import __version__
from nanguard.lazy import lazy_names

if TYPE_CHECKING:
    from nanguard.audit.load import CheckpointMismatch, load
    from nanguard.audit.preflight import preflight
    from nanguard.audit.save import save
    from nanguard.config import (
        AmpConfig,
        ClipConfig,
        DetectConfig,
        GuardConfig,
        HealConfig,
        RecordConfig,
        RecoverConfig,
        WatchConfig,
    )
    from nanguard.detect.alarm import Alarm
    from nanguard.errors import NanguardError
    from nanguard.guard import Guard
    from nanguard.record.report import Report, load_report

# Public name -> the module that defines it.
_LAZY: dict[str, str] = {
    "CheckpointMismatch": "nanguard.audit.load",
    "load": "nanguard.audit.load",
    "preflight": "nanguard.audit.preflight",
    "save": "nanguard.audit.save",
    "AmpConfig": "nanguard.config",
    "ClipConfig": "nanguard.config",
    "DetectConfig": "nanguard.config",
    "GuardConfig": "nanguard.config",
    "HealConfig": "nanguard.config",
    "RecordConfig": "nanguard.config",
    "RecoverConfig": "nanguard.config",
    "WatchConfig": "nanguard.config",
    "Alarm": "nanguard.detect.alarm",
    "NanguardError": "nanguard.errors",
    "Guard": "nanguard.guard",
    "Report": "nanguard.record.report",
    "load_report": "nanguard.record.report",
}

__all__ = [
    "Alarm",
    "AmpConfig",
    "CheckpointMismatch",
    "ClipConfig",
    "DetectConfig",
    "Guard",
    "GuardConfig",
    "HealConfig",
    "NanguardError",
    "RecordConfig",
    "RecoverConfig",
    "Report",
    "WatchConfig",
    "__version__",
    "load",
    "load_report",
    "preflight",
    "save",
]


__getattr__, __dir__ = lazy_names("nanguard", _LAZY, globals(), __all__)
