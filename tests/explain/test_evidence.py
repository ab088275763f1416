"""The diagnosis follows the evidence: each cause on both sides of what it needs, on real
PyTorch runs where one exists (a resumed checkpoint holding NaN, an LR typed far too large, a
textbook raw-tensor logistic regression, an exploding init), and fixes that fit the run (an LR
that trains, the script's own clip, the zero-code entry point)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard
from nanguard.config import GuardConfig, RecordConfig
from nanguard.explain import Evidence, diagnose
from nanguard.explain import rules as R
from nanguard.explain.context import evidence_from_log
from nanguard.explain.rules.optimizer import _lr_factor
from nanguard.pinpoint import find_origin
from nanguard.step.state import RunFacts


def _causes(ev: Evidence) -> list[str]:
    return [c.cause for c in diagnose(ev)]


def _guard(model: nn.Module, opt: torch.optim.Optimizer, **kw: object) -> nanguard.Guard:
    return nanguard.Guard(model, opt, out="", config=GuardConfig(
        record=RecordConfig(summary=False)), **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- checkpoint


def test_checkpoint_phase_ranks_first_with_tensors_and_load_line() -> None:
    ev = Evidence(
        first_nonfinite={"step": 0, "phase": "checkpoint", "samples": [], "source": "train.py:41",
                         "tensors": ["fc.weight", "optimizer.exp_avg_sq[fc.weight]"]},
        n_batch_tensors=2,
    )
    causes = diagnose(ev)
    assert causes[0].cause == "checkpoint_nonfinite"
    assert "data_nonfinite" not in [c.cause for c in causes]
    assert "`fc.weight`" in causes[0].evidence and "train.py:41" in causes[0].evidence
    assert "nanguard audit" in causes[0].fix and "earlier checkpoint" in causes[0].fix


def test_checkpoint_fix_fits_what_was_loaded() -> None:
    def fix(tensors: list[str]) -> str:
        cause = R.checkpoint_nonfinite(Evidence(first_nonfinite={
            "step": 0, "phase": "checkpoint", "tensors": tensors, "source": None}))
        assert cause is not None
        assert "unknown" in cause.evidence  # no load line: says so
        return cause.fix

    assert "optimizer state fresh" in fix(["optimizer.exp_avg_sq[fc.weight]"])
    assert "reset_running_stats" in fix(["buffer:bn.running_var"])


def test_data_phase_without_batch_evidence_is_not_data_nonfinite() -> None:
    # The old answer for a NaN in a resumed checkpoint: "the batch holds NaN", samples [],
    # with a batch of integer token ids the guard found finite.
    ev = Evidence(first_nonfinite={"step": 0, "phase": "data", "samples": [], "kind": "input"},
                  n_batch_tensors=2, bad_tensors=[])
    assert R.data_nonfinite(ev) is None and R.label_nonfinite(ev) is None
    assert _causes(ev)[0] == "checkpoint_nonfinite"
    later = Evidence(first_nonfinite={"step": 7, "phase": "data", "samples": []})
    assert R.data_nonfinite(later) is None and R.checkpoint_nonfinite(later) is None
    # The guard's checkpoint finding (`tensors`) outranks rows a replay attributed to data.
    replayed = Evidence(first_nonfinite={"step": 0, "phase": "data", "samples": [2],
                                         "kind": "input", "source": "model.py:9",
                                         "tensors": ["buffer:bn.running_var"]})
    assert R.data_nonfinite(replayed) is None
    top = diagnose(replayed)[0]
    assert top.cause == "checkpoint_nonfinite" and top.confidence > 0.95
    assert "model.py:9" not in top.evidence  # the replayed op's line is not the load line
    # The guard's own batch check is enough evidence.
    seen = Evidence(first_nonfinite={"step": 7, "phase": "data", "samples": []},
                    n_batch_tensors=2, bad_tensors=[0])
    assert _causes(seen)[0] == "data_nonfinite"


def _token_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))


def _resume_nan(tmp_path: Path) -> nn.Module:
    """A model resumed from a checkpoint whose `1.weight` holds a NaN."""
    model = _token_model()
    state = model.state_dict()
    state["1.weight"][3, 2] = float("nan")
    torch.save(state, tmp_path / "ckpt.pt")
    model.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    return model


def test_resumed_nan_weight_replayed_at_step_0_is_checkpoint(tmp_path: Path) -> None:
    model = _resume_nan(tmp_path)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))

    def step() -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    origin = find_origin(step, model=model, optimizer=opt, batch=(x, y), step=0)
    assert origin is not None and origin.kind == "state"
    causes = diagnose(Evidence(first_nonfinite=origin.to_dict(), n_batch_tensors=2))
    assert causes[0].cause == "checkpoint_nonfinite", [c.cause for c in causes]
    assert "`1.weight`" in causes[0].evidence
    assert {"data_nonfinite", "exploding_init"}.isdisjoint(c.cause for c in causes)


def test_resumed_nan_weight_through_a_guard_is_checkpoint(tmp_path: Path) -> None:
    model = _resume_nan(tmp_path)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))
    with _guard(model, opt) as guard:
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1))
            guard.watch(loss=loss, batch=(x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.report is not None
    causes = [d["cause"] for d in guard.report.diagnosis]
    assert causes and causes[0] == "checkpoint_nonfinite", guard.report.diagnosis
    assert "data_nonfinite" not in causes


# ---------------------------------------------------------------------- raw tensors


def _logistic(lr: float = 10.0):  # type: ignore[no-untyped-def]
    """The textbook logistic regression on raw tensors (no nn.Module), features of scale 50:
    after one step the sigmoid rounds to exactly 0 or 1 and the hand-written cost takes log(0)."""
    torch.manual_seed(0)
    X = torch.randn(20, 3) * 50
    Y = (X[:, :1] > 0).float()
    W = torch.zeros(3, 1, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([W, b], lr=lr)

    def step() -> torch.Tensor:
        h = torch.sigmoid(X @ W + b)
        cost = -(Y * torch.log(h) + (1 - Y) * torch.log(1 - h)).mean()
        opt.zero_grad()
        cost.backward()
        opt.step()
        return cost.detach()

    return X, Y, opt, step


def test_raw_tensor_log_of_saturated_sigmoid_is_not_data() -> None:
    X, Y, opt, step = _logistic()
    origin = None
    for i in range(5):
        origin = find_origin(step, model=None, optimizer=opt, batch=(X, Y), step=i)
        if origin is not None:
            break
    assert origin is not None and origin.op == "aten.log" and origin.kind == "op"
    assert torch.isfinite(X).all() and torch.isfinite(Y).all()
    assert origin.phase == "loss"  # computed from finite values: never `data`
    causes = _causes(Evidence(first_nonfinite=origin.to_dict(), n_batch_tensors=2))
    assert causes[0] in ("saturated_loss", "log_of_nonpositive"), causes
    assert causes[0] == "saturated_loss"
    assert {"data_nonfinite", "exploding_init"}.isdisjoint(causes)


def test_batch_nan_stays_data_and_preprocessing_is_forward() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.ones(4, 3), torch.ones(4, 1)  # constant columns: std 0

    def step() -> torch.Tensor:
        xn = (x - x.mean(0)) / x.std(0)  # batch preprocessing before the model's forward
        loss = nn.functional.mse_loss(model(xn), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    origin = find_origin(step, model=model, optimizer=opt, batch=(x, y))
    assert origin is not None and origin.op == "aten.div"
    assert (origin.phase, origin.module) == ("forward", None)
    assert _causes(Evidence(first_nonfinite=origin.to_dict(), n_batch_tensors=2))[0] == (
        "division_by_zero")

    bad = x.clone()
    bad[2, 1] = float("nan")
    origin = find_origin(lambda: nn.functional.mse_loss(model(bad), y).backward(), model=model,
                         batch=(bad, y))
    assert origin is not None and (origin.phase, origin.samples) == ("data", [2])


# ---------------------------------------------------------------------- singular vs overflow


def test_singular_gradient_needs_an_input_at_zero() -> None:
    base = {"step": 4, "phase": "backward", "op": "aten.div", "node": "SqrtBackward0"}
    at_zero = [{"dtype": "float32", "min": -0.1, "max": 0.4},
               {"dtype": "float32", "min": 0.0, "max": 4.0, "has_zero": True}]
    tiny = [{"dtype": "float32", "min": -0.1, "max": 0.4},
            {"dtype": "float32", "min": 1e-30, "max": 4.0}]
    away = [{"dtype": "float32", "min": -3e30, "max": 3e30, "has_negative": True},
            {"dtype": "float32", "min": 0.5, "max": 4.0}]
    assert (c := R.singular_gradient(Evidence(first_nonfinite={**base, "inputs": at_zero})))
    assert c.confidence >= 0.9 and "zeros" in c.evidence
    assert R.singular_gradient(Evidence(first_nonfinite={**base, "inputs": tiny}))
    assert R.singular_gradient(Evidence(first_nonfinite={**base, "inputs": away})) is None
    missing = R.singular_gradient(Evidence(first_nonfinite=base))
    assert missing is not None and missing.confidence < 0.5
    assert "not recorded" in missing.evidence


def _lm() -> nn.Module:
    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 32)
            self.fc1 = nn.Linear(32, 64)
            self.ln = nn.LayerNorm(64)
            self.head = nn.Linear(64, 100)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.ln(torch.relu(self.fc1(self.emb(x)))))

    return LM()


def _lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 100, (8, 16), generator=g)
    return x, (x * 7 + 3) % 100


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).reshape(-1, 100), batch[1].reshape(-1))


def _train_lm(lr: float, steps: int, guard_kw: dict | None = None):  # type: ignore[no-untyped-def]
    model = _lm()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    guard = _guard(model, opt, **guard_kw) if guard_kw is not None else None
    for i in range(steps):
        batch = _lm_batch(i)
        loss = _lm_loss(model, batch)
        if guard is not None:
            guard.watch(loss=loss, batch=batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if guard is not None:
        guard.close()
    return guard, losses


def test_lr_typo_is_divergence_not_singular_and_its_lr_fix_trains() -> None:
    # SGD at lr=1e4 (meant 1e-1-ish): the loss goes 4.8 -> 2e5 -> 5e12 in single steps, then
    # LayerNorm's backward overflows huge, finite inputs. No input sits at a singular point.
    model_for_replay: list[nn.Module] = []

    def replay(batch):  # type: ignore[no-untyped-def]
        return _lm_loss(model_for_replay[0], batch)

    model = _lm()
    model_for_replay.append(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e4)
    with _guard(model, opt, replay=replay) as guard:
        for i in range(6):
            batch = _lm_batch(i)
            loss = _lm_loss(model, batch)
            guard.watch(loss=loss, batch=batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = guard.report
    assert report is not None and report.first_nonfinite is not None
    causes = [d["cause"] for d in report.diagnosis]
    assert causes[0] == "optimizer_divergence", report.diagnosis
    assert "singular_gradient" not in causes and "exploding_init" not in causes
    fix = report.diagnosis[0]["fix"]
    new_lr = float(re.search(r"lr=10000 -> lr=([0-9.e+-]+)", fix).group(1))  # type: ignore[union-attr]
    assert new_lr <= 1e3  # strictly below the failing LR, by at least 10x
    _, losses = _train_lm(new_lr, 150)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.5 * losses[0]


def test_huge_backward_inputs_without_history_still_not_singular() -> None:
    first = {"step": 3, "phase": "backward", "op": "aten.native_layer_norm_backward",
             "node": "NativeLayerNormBackward0", "inputs": [
                 {"dtype": "float32", "min": -3e8, "max": 3e8, "has_zero": True},
                 {"dtype": "float32", "min": 0.0, "max": 5.9e23, "has_zero": True}]}
    causes = diagnose(Evidence(first_nonfinite=first, lr=1e4, optimizer="SGD"))
    assert [c.cause for c in causes] == ["optimizer_divergence"]
    assert causes[0].confidence < 0.85  # only the magnitudes, no history: said so
    assert "no alarm or loss history" in causes[0].evidence
    assert R.optimizer_divergence(Evidence(first_nonfinite={**first, "step": 0})) is None


# ---------------------------------------------------------------------- exploding init


def _deep(std: float) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(24):
        lin = nn.Linear(64, 64)
        nn.init.normal_(lin.weight, std=std)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 1))


def _run_once(model: nn.Module, **guard_kw: object) -> list[dict]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 64), torch.randn(8, 1)
    with _guard(model, opt, **guard_kw) as guard:
        for _ in range(2):
            loss = nn.functional.mse_loss(model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.report is not None
    return guard.report.diagnosis


def test_exploding_init_with_measured_activations() -> None:
    diagnosis = _run_once(_deep(10.0), activations=True)
    assert diagnosis[0]["cause"] == "exploding_init", diagnosis
    assert diagnosis[0]["confidence"] >= 0.8 and "activation abs-max" in diagnosis[0]["evidence"]


def test_exploding_init_without_magnitudes_says_what_is_missing() -> None:
    diagnosis = _run_once(_deep(10.0))
    init = [d for d in diagnosis if d["cause"] == "exploding_init"]
    assert init and init[0]["confidence"] <= 0.3
    assert "no magnitude was measured" in init[0]["evidence"]


def test_early_nonfinite_loss_with_ordinary_magnitudes_is_not_init() -> None:
    first = {"step": 1, "phase": "loss", "op": "aten.log",
             "inputs": [{"dtype": "float32", "min": 0.0, "max": 1.0, "has_zero": True}]}
    history = [{"step": 0, "loss": 0.69, "grad_norm": 12.0, "act_max": None, "lr": 10.0}]
    ev = Evidence(first_nonfinite=first, history=history)
    assert R.exploding_init(ev) is None
    assert R.exploding_init(Evidence(first_nonfinite={"step": 1, "phase": "loss"},
                                     history=history)) is None
    loaded = {"step": 0, "phase": "loss", "op": "aten.set_", "kind": "op",
              "tensors": ["h.1.mlp.c_fc.weight"],
              "inputs": [{"dtype": "float32", "min": "nan", "max": "nan", "nonfinite": True}]}
    assert R.exploding_init(Evidence(first_nonfinite=loaded)) is None
    assert R.exploding_init(Evidence(first_nonfinite={**loaded, "tensors": None})) is None
    huge = [{"step": 0, "loss": 1e30, "grad_norm": 1e32, "act_max": 4e18, "lr": 1e-3}]
    cause = R.exploding_init(Evidence(first_nonfinite={"step": 0, "phase": "loss"},
                                      history=huge))
    assert cause is not None and cause.confidence >= 0.8


# ---------------------------------------------------------------------- fixes that fit


def _diverging(**kw: object) -> Evidence:
    """lr=100 diverging from its first update: under an optimizer with no known LR range (a
    hand-written update) unless `optimizer=` names one (SGD: the typo of 1e-2, its default
    1e-3 times 1e5)."""
    history = [{"step": 0, "loss": 4.8, "grad_norm": 0.97, "act_max": 5.0, "lr": 100.0},
               {"step": 1, "loss": 2.3e5, "grad_norm": 2.0e3, "act_max": 7.7e5, "lr": 100.0},
               {"step": 2, "loss": 5.2e12, "grad_norm": math.inf, "act_max": 9e12, "lr": 100.0}]
    kw.setdefault("optimizer", "your hand-written update")
    return Evidence(first_nonfinite={"step": 2, "phase": "backward", "op": "aten.mm"},
                    lr=100.0, history=history, **kw)  # type: ignore[arg-type]


def test_lr_fix_is_derived_from_the_measured_growth() -> None:
    cause = R.optimizer_divergence(_diverging())
    assert cause is not None and cause.confidence >= 0.85
    assert "lr=100 -> lr=0.01" in cause.fix  # growth 2e3 per step: 1e4x smaller
    sgd = R.optimizer_divergence(_diverging(optimizer="SGD"))
    assert sgd is not None and "did you mean lr=1e-2?" in sgd.fix, sgd.fix
    assert "0.97 -> 2e+03" in cause.evidence
    # 3x the healthy 0.97; a hand-written update has no `model`: the call names its tensors
    # (issue 37's second held-out set: makemore's bigram network trains a bare `W`).
    assert "clip_grad_norm_(params, 2.91)` with `params` the tensors your hand-written" in (
        cause.fix)
    assert "model.parameters()" not in cause.fix
    assert "clip_grad_norm_(model.parameters(), 2.91)" in sgd.fix
    assert _lr_factor(2.0) == 10.0 and _lr_factor(150.0) == 1000.0


def test_lr_fix_after_a_healthy_stretch_follows_the_spike() -> None:
    healthy = [{"step": i, "loss": 1.0, "grad_norm": 2.0, "act_max": 3.0, "lr": 0.1}
               for i in range(20)]
    ev = Evidence(
        first_nonfinite={"step": 25, "phase": "backward", "op": "aten.mm"}, lr=0.1,
        healthy_grad_norm=2.0, history=healthy,
        alarms=[{"step": 21, "kind": "spike", "signal": "grad_norm", "value": 800.0}])
    cause = R.optimizer_divergence(ev)
    assert cause is not None and "400x the healthy grad norm 2" in cause.evidence
    assert "lr=0.1 -> lr=0.005" in cause.fix  # sqrt(400) = 20x
    small = R.optimizer_divergence(Evidence(
        first_nonfinite={"step": 25, "phase": "loss"}, lr=0.1, healthy_grad_norm=2.0,
        alarms=[{"step": 21, "kind": "spike", "signal": "grad_norm", "value": 30.0}]))
    assert small is not None and "lr=0.1 -> lr=0.01" in small.fix  # never under 10x


def test_lr_fix_under_a_warm_up_cuts_the_lr_the_growth_began_at() -> None:
    # A warm-up raised the LR from 10 (step 0, where the growth began) to 100 (the failure):
    # both diverged, so the cut is from the smaller, and the note says so for every step.
    ev = _diverging()
    warm = [{**h, "lr": 10.0 * (1 + 4.5 * h["step"])} for h in ev.history]
    cause = R.optimizer_divergence(Evidence(first_nonfinite=ev.first_nonfinite, lr=100.0,
                                            optimizer="SGD", history=warm))
    assert cause is not None
    assert "lr=100 -> lr=0.001" in cause.fix, cause.fix  # 10 / 1e4, not 100 / 1e4
    assert "from 10 at step 0" in cause.fix and "at or below 0.001" in cause.fix
    # The other side: a constant LR gives the plain cut and no schedule note.
    flat = R.optimizer_divergence(_diverging())
    assert flat is not None and "schedule" not in flat.fix


def test_clip_fix_names_the_scripts_own_clip() -> None:
    off = R.optimizer_divergence(_diverging(clip=0.0))
    assert off is not None and "clip is 0" in off.fix and "2.91" in off.fix
    assert off.fix.index("clip") < off.fix.index("lower the LR")  # clipping back on comes first
    loose = R.optimizer_divergence(_diverging(clip=1000.0))
    assert loose is not None and "max_norm 1000" in loose.fix
    unknown = R.optimizer_divergence(_diverging())
    assert unknown is not None and "clip is 0" not in unknown.fix


def test_zero_code_users_get_the_run_flag() -> None:
    api = R.optimizer_divergence(_diverging())
    run = R.optimizer_divergence(_diverging(entry="run"))
    assert api is not None and "Guard(..., policy='rollback')" in api.fix
    assert run is not None and "nanguard run --policy rollback" in run.fix
    assert "Guard(" not in run.fix
    for cause in diagnose(Evidence(first_nonfinite={"step": 3, "phase": "data", "samples": [1]},
                                   entry="run")):
        assert "Guard(" not in cause.fix and "nanguard.audit" not in cause.fix


@pytest.mark.parametrize("entry", ["api", "run"])
def test_context_reads_the_entry_point(entry: str) -> None:
    model = nn.Linear(2, 1)
    guard = _guard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   facts=RunFacts(entry=entry))
    try:
        assert evidence_from_log(guard.run_log()).entry == entry
    finally:
        guard.close()
