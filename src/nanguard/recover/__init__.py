"""Recover: rollback to the last good state, NaN-safe adaptive clipping, GradScaler awareness."""

from nanguard.recover.amp import ScalerWatch
from nanguard.recover.clip import AdaptiveClipper
from nanguard.recover.rollback import Rollback
from nanguard.recover.snapshot import HostSnapshot

__all__ = ["AdaptiveClipper", "HostSnapshot", "Rollback", "ScalerWatch"]
