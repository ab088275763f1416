"""Watch: device-side statistics of each training step, read by the host at most once a step."""

from nanguard.watch.activations import ActivationProbe
from nanguard.watch.fingerprint import sample_fingerprints
from nanguard.watch.probe import StepProbe
from nanguard.watch.stats import StepStats

__all__ = ["ActivationProbe", "StepProbe", "StepStats", "sample_fingerprints"]
