"""The zero-code runner: `nanguard run SCRIPT` watches an unmodified training script.

runner.py orders the parts: run_script.py runs the script in this process and tells how it
ended; discovery.py finds its optimizers, models, losses and batches (root_calls.py: its root
modules and their batches; patches.py: the torch functions wrapped; closures.py:
`step(closure)`; manual.py: hand-written updates; amp_scalers.py: its GradScalers; chains.py:
optimizers rebuilt over the same parameters; held.py: what a forward that raised held);
attach.py makes each optimizer's guard, watched.py is what that guard is given; run_reports.py
closes the guards and writes the run folder; rerun.py and replay.py are the pinpointing re-run
(resume.py: the resume points it starts from; fork_cost.py: what one costs; forks.py: when the
process may fork; resume_child.py: a point's child at work); run_output.py prints the summary
and picks the exit code.
"""
