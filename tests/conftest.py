"""Shared test setup: import the package from `src/` when it is not installed, one CPU thread
(the suite runs on small shared machines and tiny models gain nothing from more), and fixtures
that build guards the way most tests want them."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
try:
    import nanguard  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers`

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def quiet_config():
    """A GuardConfig factory with the terminal summary off (tests read the report instead)."""
    from nanguard import GuardConfig, RecordConfig, WatchConfig

    def make(*, out: str | None = None, policy: str = "observe", **watch: object) -> GuardConfig:
        return GuardConfig(
            policy=policy,
            record=RecordConfig(out=out, summary=False),
            watch=WatchConfig(**watch),  # type: ignore[arg-type]
        )

    return make
