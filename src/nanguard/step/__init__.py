"""The step core: what a `Guard` runs at each optimizer step, as one pipeline.

- `pipeline.StepPipeline`: the hooks and what they call, in step order (start there);
- `before`: what the pre-hook follows (parameters, LR, loaded state) before measuring;
- `judging`: each step read judged (detectors, finding, decisions), before and after the update;
- `keeping`: what a judged step leaves in the record and the state;
- `acting`: the cross-rank agreement, the policy's decision and the effects applied;
- `build`: the settings and the parts, made once (`Parts`), never assigned from outside;
- `state`: what the pipeline carries between steps (`StepState`) and the run's facts
  (`RunFacts`), each one declared dataclass;
- `replays`: where a step's value showed, spikes and re-runs (only on steps that need them);
- `closing`: the run's end (the last reads, the report) and the run log as plain data;
- `failopen`: the one handling that keeps an error of nanguard's own out of training (a
  decorator; the per-step hooks call it from their own `try`).
"""
