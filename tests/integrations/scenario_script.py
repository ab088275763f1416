"""A scenario of the pinpoint suite as a plain training script, for `nanguard run`:
`python scenario_script.py NAME` builds it (training up to its failing step where it has one)
and runs the failing step. Nothing in it knows about nanguard."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `scenarios`

from scenarios import load  # noqa: E402

if __name__ == "__main__":
    built = load(sys.argv[1]).build()
    if built.skip:
        print(f"skip: {built.skip}")
        raise SystemExit(0)
    built.step()
