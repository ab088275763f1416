"""Several optimizers under one Lightning callback: a GAN-style LightningModule with manual
optimization and two Adam optimizers (generator, then discriminator, every batch), on CPU.

The discriminator normalizes each input row by its norm without an eps; a blank (all-zero) real
row makes 0/0 in its forward. The generator's step of that batch comes first and only sees
generated rows, so the non-finite value shows in the discriminator's step `BAD` and reaches the
generator only one step later (through the discriminator's NaN weights): the merged finding must
name optimizer-1, the discriminator, at step `BAD`, although the generator fails too. With the
latent code of one row zeroed instead, the generator's forward makes the NaN (the same
normalization), in its own step `BAD`, before the discriminator's step of that batch sees it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from lightning_rig import pl, trainer  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.integrations.lightning import NanguardCallback  # noqa: E402

QUIET = GuardConfig(record=RecordConfig(summary=False))
BATCH, DIM, LATENT, STEPS, BAD = 8, 6, 4, 8, 3


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)  # no eps: a zero row is 0/0


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(LATENT, 16), nn.Tanh(), nn.Linear(16, DIM))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(_unit(z))


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(_unit(x))


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = Generator()
        self.discriminator = Discriminator()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        fake = self.generator(z)
        g_loss = bce(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        d_loss = (bce(self.discriminator(real), ones)
                  + bce(self.discriminator(fake.detach()), zeros)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3))


def _data(blank: str | None) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    real = torch.randn(BATCH * STEPS, DIM, generator=g) + 2.0
    z = torch.randn(BATCH * STEPS, LATENT, generator=g)
    if blank == "real":
        real[BAD * BATCH + 2] = 0.0
    elif blank == "latent":
        z[BAD * BATCH + 5] = 0.0
    return DataLoader(TensorDataset(real, z), batch_size=BATCH, shuffle=False)


def _fit(tmp_path, blank: str | None, **kw: Any) -> tuple[NanguardCallback, dict[str, Any]]:
    cb, _ = _fit_trainer(tmp_path, blank, **kw)
    return cb, json.loads((tmp_path / "run" / "report.json").read_text())


def _fit_trainer(tmp_path, blank: str | None, **kw: Any) -> tuple[NanguardCallback, Any]:
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET, **kw)
    t = trainer([cb], STEPS * 2)  # max_steps counts the steps of both optimizers
    t.fit(GAN(), _data(blank))
    return cb, t


def test_healthy_gan_watched_per_optimizer(tmp_path):
    cb, report = _fit(tmp_path, None)
    assert [type(g.model).__name__ for g in cb.guards] == ["Generator", "Discriminator"]
    assert report["status"] == "healthy" and report["steps"] == STEPS
    parts = report["run"]["parts"]
    assert {k: (v["module"], v["model"], v["steps"]) for k, v in parts.items()} == {
        "optimizer-0": ("generator", "Generator", STEPS),
        "optimizer-1": ("discriminator", "Discriminator", STEPS)}
    for i in range(2):
        assert (tmp_path / "run" / f"optimizer-{i}" / "report.json").is_file()


@pytest.mark.parametrize(("blank", "part", "module"), [
    ("real", "optimizer-1", "discriminator"), ("latent", "optimizer-0", "generator")])
def test_the_network_that_went_nan_is_named(tmp_path, blank, part, module):
    cb, report = _fit(tmp_path, blank)
    first = report["first_nonfinite"]
    assert report["status"] == "failed"
    assert (first["step"], first["part"]) == (BAD, part), first
    assert report["run"]["parts"][part]["module"] == module
    # both networks end up NaN: the other part failed too, later or in the same batch
    assert {v["status"] for v in report["run"]["parts"].values()} == {"failed"}


def test_skip_keeps_both_networks_finite(tmp_path):
    cb, report = _fit(tmp_path, "real", policy="skip")
    assert [(a["step"], a["action"], a["part"]) for a in report["actions"]] == [
        (BAD, "skip", "optimizer-1")]
    for guard in cb.guards:
        assert all(torch.isfinite(p).all() for p in guard.model.parameters())


def test_state_round_trips_through_a_checkpoint_with_two_optimizers(tmp_path):
    _, t = _fit_trainer(tmp_path, "real", policy="skip")
    ckpt = tmp_path / "gan.ckpt"
    t.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    (state,) = saved.values()
    assert [s["step"] for s in state["guards"]] == [STEPS, STEPS]
    again = NanguardCallback(policy="skip", config=QUIET)  # out: from the checkpoint
    trainer([again], STEPS * 4).fit(GAN(), _data(None), ckpt_path=ckpt)
    assert [g.step for g in again.guards] == [2 * STEPS, 2 * STEPS]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["steps"] == 2 * STEPS
    assert [(a["step"], a["part"]) for a in report["actions"]] == [(BAD, "optimizer-1")]
