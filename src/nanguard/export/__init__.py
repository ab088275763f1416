"""Exporters of a recorded run to experiment trackers, keeping non-finite points visible.

Trackers hide the event nanguard exists for (TensorBoard samples 1000 points per scalar, W&B
line plots drop NaN, MLflow turns +-Inf into +-1.8e308). Each exporter here writes the run's
per-step signals with NaN/Inf kept as they are, a 0/1 `nonfinite` marker series that stays
plottable where the value is not, and a text event for every alarm, action and finding.

One module per tracker; nothing from a tracker is imported until its exporter is used.
"""
