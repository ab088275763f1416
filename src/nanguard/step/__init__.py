"""The step core: what a `Guard` runs at each optimizer step, as one pipeline.

- `pipeline.StepPipeline`: the hooks and what they call, in step order (start there);
- `build`: the settings and the parts, made once (`Parts`), never assigned from outside;
- `state`: what the pipeline carries between steps (`StepState`) and the run's facts
  (`RunFacts`), each one declared dataclass;
- `replays`: where a step's value showed, spikes and re-runs (only on steps that need them);
- `closing`: the run's end (the last reads, the report) and the run log as plain data;
- `failopen`: the one wrapper that keeps an error of nanguard's own out of training.
"""
