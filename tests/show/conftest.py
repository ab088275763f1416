"""Fixtures of the HTML report tests: tiny real Guard runs (one failing: a NaN injected into the
batch at step 20 of 40; one healthy), a merged run of two parts, and headless Chromium driven by
Playwright (Debian's `chromium`, never a browser downloaded by `playwright install`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run",
]


def train(out: Path, *, bad_step: int | None, steps: int = 40, seed: int = 0) -> Path:
    """A tiny MLP trained by Adam under a Guard (activations on); a NaN in one input row of
    the batch at `bad_step`."""
    import nanguard
    from nanguard import GuardConfig, RecordConfig

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = nanguard.Guard(model, opt, activations=True,
                           config=GuardConfig(record=RecordConfig(out=str(out), summary=False)))
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = x[:, :1] * 0.5 + 0.1 * torch.randn(16, 1, generator=g)
        if step == bad_step:
            x[3, 2] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    guard.close()
    return out


@pytest.fixture(scope="session")
def failing_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("runs") / "failing", bad_step=20)


@pytest.fixture(scope="session")
def healthy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("runs") / "healthy", bad_step=None, seed=1)


@pytest.fixture(scope="session")
def merged_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A merged run (like a GAN's two optimizers): report.json lists its parts' folders."""
    from nanguard.record.merge import merge_reports
    from nanguard.record.report import load_report

    root = tmp_path_factory.mktemp("merged") / "gan"
    parts = [("gen", train(root / "gen", bad_step=25, seed=2)),
             ("disc", train(root / "disc", bad_step=None, seed=3))]
    merge_reports([(label, load_report(f)) for label, f in parts],
                  run={"folder": str(root)}).write(root)
    return root


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium (Playwright gives every context a fresh profile)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); .ci/run installs "
                    "it, so CI runs these tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A browser page that records console errors, page errors and the URLs it requested."""

    def __init__(self, browser: Any) -> None:
        self.context = browser.new_context(viewport={"width": 1300, "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error"
                     else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.requests: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, url: str) -> Any:
        self.page.goto(url)
        self.page.wait_for_function("window.NANGUARD_READY === true", timeout=30_000)
        return self.page

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()
