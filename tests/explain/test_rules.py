"""Diagnosis rules: each cause fires on its evidence and stays quiet otherwise; end-to-end, the
right cause is ranked first for real failing runs (bad row, bad label, Adam eps=0, the cascade)
and a healthy run gets no diagnosis."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard
from nanguard.config import GuardConfig, RecordConfig
from nanguard.explain import Evidence, diagnose
from nanguard.explain import rules as R
from nanguard.scenarios import train_cascade


def _ev(**first: object) -> Evidence:
    return Evidence(first_nonfinite={"step": 5, **first})


_ZERO_DEN = [{"dtype": "float32", "min": -1.0, "max": 1.0},
             {"dtype": "float32", "min": 0.0, "max": 2.0, "has_zero": True}]
_HUGE_IN = [{"dtype": "float32", "min": -3e30, "max": 3e30, "has_negative": True},
            {"dtype": "float32", "min": 1e20, "max": 6e23}]

# (rule, evidence it needs, the closest evidence that rules it out)
CASES = [
    (
        R.checkpoint_nonfinite,
        _ev(phase="checkpoint", step=0, tensors=["fc.weight"], source="train.py:12"),
        _ev(phase="data", step=0, samples=[3]),
    ),
    (
        R.init_nonfinite,
        Evidence(first_nonfinite={"step": 0, "phase": "checkpoint", "tensors": ["fc.weight"]},
                 loaded=False),
        Evidence(first_nonfinite={"step": 0, "phase": "checkpoint", "tensors": ["fc.weight"]},
                 loaded=True),
    ),
    (
        R.data_nonfinite,
        _ev(phase="data", samples=[3]),
        _ev(phase="data", samples=[]),  # no evidence the batch holds it
    ),
    (
        R.label_nonfinite,
        Evidence(first_nonfinite={"step": 1, "phase": "data"}, bad_tensors=[1], n_batch_tensors=2),
        Evidence(first_nonfinite={"step": 1, "phase": "data"}, bad_tensors=[0], n_batch_tensors=2),
    ),
    (
        R.log_of_nonpositive,
        _ev(phase="forward", op="aten.log", inputs=[{"has_zero": True}]),
        _ev(phase="forward", op="aten.log", inputs=[{"min": 0.5, "max": 2.0}]),
    ),
    (
        R.saturated_loss,
        _ev(phase="loss", op="aten.log",
            inputs=[{"min": 0.0, "max": 1.0, "has_zero": True}]),
        _ev(phase="loss", op="aten.log", inputs=[{"min": -2.0, "max": 3.0, "has_zero": True,
                                                  "has_negative": True}]),
    ),
    (
        R.division_by_zero,
        _ev(phase="forward", op="aten.div", inputs=_ZERO_DEN),
        _ev(phase="forward", op="aten.div",
            inputs=[{"min": -1e30, "max": 1e30}, {"min": 0.5, "max": 2.0}]),
    ),
    (
        R.singular_gradient,
        _ev(phase="backward", op="aten.div", node="SqrtBackward0", inputs=_ZERO_DEN),
        _ev(phase="backward", op="aten.native_layer_norm_backward",
            node="NativeLayerNormBackward0", inputs=_HUGE_IN),
    ),
    (
        R.masked_softmax,
        _ev(phase="forward", op="aten._softmax", inputs=[{"min": "-inf", "max": 0.2}]),
        _ev(phase="forward", op="aten._softmax", inputs=[{"min": -3.0, "max": 0.2}]),
    ),
    (
        R.exp_overflow,
        _ev(phase="forward", op="aten.exp", inputs=[{"dtype": "float32", "min": 0, "max": 200}]),
        _ev(phase="forward", op="aten.exp", inputs=[{"dtype": "float32", "min": 0, "max": 20}]),
    ),
    (
        R.low_precision_overflow,
        Evidence(
            first_nonfinite={"step": 3, "phase": "forward", "op": "aten.mm"}, dtype="torch.float16"
        ),
        Evidence(
            first_nonfinite={"step": 3, "phase": "forward", "op": "aten.mm"}, dtype="torch.float32"
        ),
    ),
    (
        R.optimizer_state_nonfinite,
        Evidence(first_nonfinite={"step": 9, "phase": "optimizer"}, eps=0.0, optimizer="Adam"),
        Evidence(first_nonfinite={"step": 9, "phase": "backward"}, eps=0.0, optimizer="Adam"),
    ),
    (
        R.optimizer_divergence,
        Evidence(
            first_nonfinite={"step": 20, "phase": "loss"},
            lr=0.05,
            healthy_grad_norm=1.0,
            alarms=[{"step": 15, "kind": "spike", "signal": "grad_norm", "value": 300.0}],
        ),
        Evidence(
            first_nonfinite={"step": 20, "phase": "loss"},
            alarms=[{"step": 1, "kind": "spike", "signal": "grad_norm", "value": 300.0}],
        ),
    ),
    (
        R.exploding_init,
        _ev(phase="forward", op="aten.addmm", step=0,
            inputs=[{"dtype": "float32", "min": 0.0, "max": 1e37, "has_zero": True}]),
        _ev(phase="forward", op="aten.addmm", step=0,
            inputs=[{"dtype": "float32", "min": -3.0, "max": 3.0}]),
    ),
    (
        R.bad_batch,
        Evidence(alarms=[{"step": 7, "kind": "spike", "signal": "grad_norm", "value": 99.0}]),
        Evidence(),
    ),
    (
        R.lr_jump,
        Evidence(alarms=[
            {"step": 100, "kind": "lr_jump", "signal": "lr", "value": 10.0,
             "message": "the LR went 10x at step 100 (0.001 -> 0.01) without warm-up: ..."},
            {"step": 104, "kind": "spike", "signal": "grad_norm", "value": 40.0}]),
        # The same jump with trouble only before it (a warm restart the run took in stride).
        Evidence(alarms=[
            {"step": 90, "kind": "spike", "signal": "grad_norm", "value": 40.0},
            {"step": 100, "kind": "lr_jump", "signal": "lr", "value": 10.0,
             "message": "the LR went 10x at step 100 (0.001 -> 0.01) without warm-up: ..."}]),
    ),
    (
        R.vanishing_gradients,
        Evidence(
            alarms=[
                {
                    "step": 7,
                    "kind": "vanishing",
                    "signal": "grad_norm",
                    "value": 0.0,
                    "message": "grad norm tiny",
                }
            ]
        ),
        Evidence(),
    ),
    (
        R.replica_divergence,
        Evidence(
            alarms=[
                {
                    "step": 7,
                    "kind": "replica_divergence",
                    "signal": "param_fingerprint",
                    "value": 1.0,
                    "message": "parameters differ bit for bit between replicas after step 7: "
                    "rank 1 in 0.weight (reference: rank(s) 0)",
                }
            ]
        ),
        Evidence(),
    ),
    (
        R.domain_error,
        _ev(phase="forward", op="aten.sqrt", inputs=[{"min": -0.5, "max": 2.0}]),
        _ev(phase="forward", op="aten.sqrt", inputs=[{"min": 0.0, "max": 2.0}]),
    ),
    (
        R.cast_overflow,
        _ev(phase="data", op="aten._to_copy", output={"dtype": "float32", "inf": True},
            inputs=[{"dtype": "float64", "min": 1.0, "max": 1e40}]),
        _ev(phase="data", op="aten._to_copy", output={"dtype": "float32", "inf": True},
            inputs=[{"dtype": "float64", "min": 1.0, "max": "inf", "nonfinite": True}]),
    ),
    (
        R.inf_arithmetic,
        _ev(phase="forward", op="aten.mul", output={"nan": True},
            inputs=[{"min": "-inf", "max": 0.0, "nonfinite": True},
                    {"min": 0.0, "max": 1.0, "has_zero": True}]),
        _ev(phase="forward", op="aten.mul", output={"nan": True},
            inputs=[{"min": -1.0, "max": 0.0}, {"min": 0.0, "max": 1.0, "has_zero": True}]),
    ),
    (
        R.arithmetic_overflow,
        _ev(phase="forward", op="aten.mm", inputs=[{"min": -1e20, "max": 3e20}]),
        _ev(phase="forward", op="aten.mm",
            inputs=[{"min": -1e20, "max": "inf", "nonfinite": True}]),
    ),
    (R.nondeterministic, Evidence(reproduced=False), Evidence(reproduced=True)),
    (
        R.checkpoint_corrupt,
        Evidence(alarms=[{"step": 0, "kind": "checkpoint_mismatch", "signal": "checkpoint",
                          "value": 1.0, "message": "ckpt.pt (loaded at train.py:12) differs "
                          "from its manifest in 1 tensor(s): model.fc.weight"}]),
        Evidence(alarms=[{"step": 0, "kind": "spike", "signal": "grad_norm", "value": 9.0,
                          "message": "grad norm 9 is 30x its recent median"}]),
    ),
]


@pytest.mark.parametrize(
    ("rule", "positive", "negative"), CASES, ids=lambda x: getattr(x, "__name__", "")
)
def test_rule_fires_only_on_its_evidence(rule, positive, negative) -> None:
    cause = rule(positive)
    assert cause is not None and cause.cause == rule.__name__
    assert 0 < cause.confidence <= 1 and cause.evidence and cause.fix
    assert rule(negative) is None


@pytest.mark.parametrize("rule", R.RULES, ids=lambda r: r.__name__)
def test_every_rule_states_its_evidence(rule) -> None:
    doc = rule.__doc__ or ""
    assert "Needs" in doc and "Ruled out" in doc, rule.__name__


def test_every_rule_is_registered_and_covered() -> None:
    assert {c[0] for c in CASES} == set(R.RULES)


def test_a_batch_the_guard_saw_hold_the_value_is_data_whichever_op_read_it() -> None:
    """The origin was put on the first op that read the batch (an `addmm` in the forward, a
    collate `stack` in the loss phase): the guard's own batch check is the evidence."""
    for phase, op in (("forward", "aten.addmm"), ("loss", "aten.stack")):
        ev = Evidence(first_nonfinite={"step": 3, "phase": phase, "op": op, "samples": [2]},
                      bad_tensors=[0], n_batch_tensors=2)
        causes = diagnose(ev)
        assert causes and causes[0].cause == "data_nonfinite", causes
        assert "only the first op to read it" in causes[0].evidence
        ev.bad_tensors = [1]
        assert diagnose(ev)[0].cause == "label_nonfinite"
    # Not without the guard's batch check: rows alone, outside `data`, are an op's output rows.
    assert R.data_nonfinite(_ev(phase="forward", op="aten.addmm", samples=[2])) is None
    # Nor for a value the guard found in the loaded state.
    loaded = Evidence(first_nonfinite={"step": 0, "phase": "forward", "op": "aten.addmm",
                                       "tensors": ["fc.weight"]}, bad_tensors=[0])
    assert R.data_nonfinite(loaded) is None


def test_a_model_input_computed_in_the_step_is_not_data() -> None:
    """`x = (x - x.mean(0)) / x.std(0)` on a constant column: the model input the guard
    checked holds NaN, but the checker saw the division make it from finite inputs, one a
    zero: the loaded batch never held it (data_nonfinite would say "repair those rows at load
    time", and `nanguard scan` would find nothing)."""
    inputs = [{"index": 0, "min": -1.0, "max": 1.0, "has_zero": False, "nonfinite": False},
              {"index": 1, "min": 0.0, "max": 2.0, "has_zero": True, "nonfinite": False}]
    ev = Evidence(first_nonfinite={"step": 5, "phase": "forward", "op": "aten.div",
                                   "kind": "op", "samples": [0, 1], "inputs": inputs},
                  bad_tensors=[0], n_batch_tensors=2)
    assert R.data_nonfinite(ev) is None
    assert diagnose(ev)[0].cause == "division_by_zero"
    # The same op READING a non-finite input: the batch held it, whichever op read it first.
    ev.first_nonfinite["inputs"] = [{**inputs[0], "nonfinite": True}, inputs[1]]
    assert diagnose(ev)[0].cause == "data_nonfinite"


def test_checkpoint_nonfinite_needs_a_load() -> None:
    """No `torch.load` / `load_state_dict` anywhere in a `nanguard run` script: never a
    checkpoint, in any of its forms; unknown (a Guard created after a load): still one."""
    forms = [
        {"step": 0, "phase": "checkpoint", "tensors": ["buffer:bn.running_mean"]},
        {"step": 0, "phase": "optimizer", "kind": "state", "param": "fc.weight"},
        {"step": 0, "phase": "data", "samples": []},
    ]
    for first in forms:
        assert R.checkpoint_nonfinite(Evidence(first_nonfinite=first, loaded=False)) is None
        for loaded in (True, None):
            cause = R.checkpoint_nonfinite(Evidence(first_nonfinite=first, loaded=loaded))
            assert cause is not None, (first, loaded)
    # Without a load, the named state is the script's own init; an unnamed value is not.
    causes = diagnose(Evidence(first_nonfinite=forms[1], loaded=False, entry="run"))
    assert causes[0].cause == "init_nonfinite" and "--preflight-only" in causes[0].fix
    assert R.init_nonfinite(Evidence(first_nonfinite=forms[2], loaded=False)) is None


def test_a_nan_made_from_an_empty_input_is_division_by_zero() -> None:
    """A mean (or a loss averaged) over an empty selection: 0 / 0. Not an empty input whose
    output is finite (a sum: 0) or Inf, nor an op whose inputs all have elements."""
    empty = [{"index": 0, "shape": [0, 2], "dtype": "float32", "min": None, "max": None}]
    nan = {"shape": [], "dtype": "float32", "nan": True, "inf": False}
    ev = _ev(phase="loss", op="aten.nll_loss_forward", inputs=empty, output=nan)
    cause = R.division_by_zero(ev)
    assert cause is not None and "input shape [0, 2] (0 rows)" in cause.evidence
    assert diagnose(ev)[0].cause == "division_by_zero"
    inf = {**nan, "nan": False, "inf": True}
    assert R.division_by_zero(_ev(phase="loss", op="aten.mean", inputs=empty, output=inf)) is None
    full = [{**empty[0], "shape": [4, 2], "min": 0.1, "max": 0.9}]
    assert R.division_by_zero(_ev(phase="loss", op="aten.mean", inputs=full, output=nan)) is None


def test_adam_eps_fix_never_repeats_the_runs_eps() -> None:
    """eps=1e-8 that float16 parameters round to 0: the fix names float16 and an eps it holds,
    never `eps=1e-8` again; in float32 (or bfloat16, which holds 1e-8) no eps is proposed."""
    first = {"step": 3, "phase": "optimizer", "param": "emb.weight"}
    half = R.optimizer_state_nonfinite(Evidence(first_nonfinite=first, eps=1e-8,
                                                dtype="torch.float16", optimizer="Adam"))
    assert half is not None and "0 in float16" in half.evidence
    assert "eps=1e-08 -> eps=1e-4" in half.fix and "eps=1e-8)" not in half.fix
    for dtype in ("torch.float32", "torch.bfloat16"):
        full = R.optimizer_state_nonfinite(Evidence(first_nonfinite=first, eps=1e-8,
                                                    dtype=dtype, optimizer="Adam", lr=1e-3))
        assert full is not None and "eps=1e-8" not in full.fix and "-> eps" not in full.fix
    zero = R.optimizer_state_nonfinite(Evidence(first_nonfinite=first, eps=0.0,
                                                optimizer="Adam"))
    assert zero is not None and "eps=1e-8" in zero.fix


def _diverged(**kw: object) -> Evidence:
    history = [{"step": 0, "loss": 0.7, "grad_norm": 1.0, "lr": kw.get("lr")},
               {"step": 1, "loss": 2e3, "grad_norm": 3e4, "lr": kw.get("lr")}]
    return Evidence(first_nonfinite={"step": 3, "phase": "forward", "op": "aten.addmm"},
                    history=history, optimizer="AdamW", **kw)  # type: ignore[arg-type]


def test_weight_decay_not_the_lr_when_the_lr_is_ordinary() -> None:
    """AdamW at an ordinary lr=3e-3 with weight_decay=1e4 multiplies the weights by -29 a
    step: the fix lowers the weight decay, not the LR; an LR typo (lr=1e3 with the usual
    0.1) is the LR's fault; Adam's L2 decay does not multiply the weights that way."""
    wd = R.optimizer_divergence(_diverged(lr=3e-3, weight_decay=1e4, decoupled_decay=True))
    assert wd is not None and "weight_decay=10000 -> weight_decay=0.1" in wd.fix
    assert "lower the LR" not in wd.fix and "1 - lr * weight_decay = -29" in wd.evidence
    typo = R.optimizer_divergence(_diverged(lr=1e3, weight_decay=0.1, decoupled_decay=True))
    assert typo is not None and "did you mean lr=1e-3?" in typo.fix  # 1e6x AdamW's default
    l2 = R.optimizer_divergence(_diverged(lr=3e-3, weight_decay=1e4, decoupled_decay=False))
    assert l2 is not None and "weight_decay=10000 ->" not in l2.fix


def test_exp_fix_follows_where_the_value_went() -> None:
    """An exp whose result goes into `1 + e` / log1p is a softplus or sigmoid by hand: the fix
    is softplus, not a softmax; into a sum (a softmax by hand): subtract the max."""
    rng = [{"dtype": "float32", "min": -3.0, "max": 1e5}]
    by_hand = _ev(phase="loss", op="aten.exp", inputs=rng, propagated_by={"op": "aten.add"})
    cause = R.exp_overflow(by_hand)
    assert cause is not None and "F.softplus" in cause.fix and "softmax" not in cause.fix
    soft = _ev(phase="forward", op="aten.exp", inputs=rng, propagated_by={"op": "aten.sum"})
    cause = R.exp_overflow(soft)
    assert cause is not None and "logsumexp" in cause.fix and "softplus" not in cause.fix


def test_healthy_evidence_gets_no_diagnosis() -> None:
    assert diagnose(Evidence()) == []


def _loop(model, optimizer, batches, **guard_kw):
    guard = nanguard.Guard(
        model, optimizer, out="", config=GuardConfig(record=RecordConfig(summary=False)), **guard_kw
    )
    with guard:
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert guard.report is not None
    return guard.report


def _batches(n: int, bad_step: int | None = None, where: str = "x"):
    g = torch.Generator().manual_seed(0)
    for step in range(n):
        x = torch.randn(16, 4, generator=g)
        y = x.sum(1, keepdim=True)
        if step == bad_step:
            (x if where == "x" else y)[5, 0] = float("nan") if where == "x" else float("inf")
        yield x, y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.parametrize(("where", "cause"), [("x", "data_nonfinite"), ("y", "label_nonfinite")])
def test_bad_row_is_diagnosed(where: str, cause: str) -> None:
    m = _model()
    report = _loop(m, torch.optim.SGD(m.parameters(), lr=0.01), _batches(40, 30, where))
    assert report.first_nonfinite["phase"] == "data"
    assert report.first_nonfinite["samples"] == [5]
    assert report.diagnosis[0]["cause"] == cause


def test_adam_eps_zero_is_diagnosed() -> None:
    # A parameter whose gradient is exactly zero: Adam with eps=0 computes 0 / 0.
    m = _model()
    m[0].weight.data[:, 3] = 0.0
    batches = [(torch.cat([torch.randn(8, 3), torch.zeros(8, 1)], 1), torch.randn(8, 1))] * 5
    report = _loop(m, torch.optim.Adam(m.parameters(), lr=1e-3, eps=0.0), batches)
    assert report.first_nonfinite is not None
    assert report.first_nonfinite["phase"] == "optimizer"
    assert report.diagnosis[0]["cause"] == "optimizer_state_nonfinite"
    assert "eps" in report.diagnosis[0]["fix"]


def test_cascade_is_diagnosed_as_optimizer_divergence() -> None:
    guards = []

    def factory(model, optimizer):
        guards.append(
            nanguard.Guard(
                model,
                optimizer,
                out="",
                activations=True,
                config=GuardConfig(record=RecordConfig(summary=False)),
            )
        )
        return guards[0]

    train_cascade(1, factory)  # seed 1 fails at step 227 (see nanguard demo)
    report = guards[0].report
    assert report.first_nonfinite is not None
    assert report.diagnosis[0]["cause"] == "optimizer_divergence"
    fix = report.diagnosis[0]["fix"]
    assert "lr=0.05 ->" in fix
    new_lr = float(fix.split("lr=0.05 -> lr=")[1].split(":")[0])
    assert new_lr <= 0.005  # at least 10x below the LR that diverged
    _, losses = train_cascade(1, lr=new_lr)  # the same seed at the proposed LR trains
    assert all(math.isfinite(v) for v in losses)
    assert "clip_grad_norm_" in report.diagnosis[0]["fix"]


def test_healthy_run_has_no_diagnosis() -> None:
    m = _model()
    report = _loop(m, torch.optim.SGD(m.parameters(), lr=0.01), _batches(60))
    assert report.status == "healthy"
    assert report.diagnosis == []


def _big_update_ev(ratio: float, at: int, fails: int = 1) -> Evidence:
    return Evidence(first_nonfinite={"step": fails, "phase": "forward", "op": "aten.exp",
                                     "inputs": [{"dtype": "float32", "min": -1.0,
                                                 "max": 97.0}]},
                    lr=0.3, optimizer="Adam",
                    history=[{"step": at, "loss": 0.4, "grad_norm": 0.47, "lr": 0.3,
                              "update_ratio": ratio}])


def test_an_update_that_replaced_the_weights_is_ranked_above_the_op_it_overflowed() -> None:
    causes = diagnose(_big_update_ev(0.98, at=0))
    assert [c.cause for c in causes[:2]] == ["optimizer_divergence", "exp_overflow"]
    assert "0.98x their norm" in causes[0].evidence
    # ~1% of the weights a step: 100x, 0.003; still 3x Adam's default, so Adam's 0.001
    assert "lr=0.3 -> lr=0.001: 300x smaller" in causes[0].fix
    assert "the measurement alone implies 0.003, still above the LRs Adam trains with" in \
        causes[0].fix
    # An ordinary first update (a healthy VAE at lr 1e-2: 0.12), a zero-initialised model's
    # (exactly 1: the weights were all zero), and a big update long before the failure are
    # not evidence against the LR.
    for ev in (_big_update_ev(0.12, at=0), _big_update_ev(1.0, at=0),
               _big_update_ev(0.98, at=0, fails=30)):
        assert [c.cause for c in diagnose(ev)][:1] == ["exp_overflow"]
    # After an init far too large (huge activations at step 0) the first update is huge too:
    # the init's evidence, not the LR's.
    huge_init = _big_update_ev(0.98, at=0)
    huge_init.history[0]["act_max"] = 1e7
    assert R.optimizer_divergence(huge_init) is None


class _VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        self.mu, self.logvar = nn.Linear(128, 8), nn.Linear(128, 8)
        self.dec = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        mu, lv = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * lv)
        kl = -0.5 * torch.mean(1 + lv - mu.pow(2) - lv.exp())
        return nn.functional.mse_loss(self.dec(z), x) + kl


@pytest.mark.parametrize("lr", [0.3, 5.0])
def test_vae_at_a_typo_lr_blames_the_lr_not_the_exp(tmp_path, lr: float) -> None:
    """A VAE whose KL term's exp(logvar) overflows at step 1 because Adam at this LR
    replaced the weights at step 0 (the update ratio checked here without nanguard)."""
    torch.manual_seed(0)
    m = _VAE()
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    g = nanguard.Guard(m, opt, out=tmp_path, config=GuardConfig(record=RecordConfig(
        summary=False)))
    data = torch.rand(256, 64)
    before = torch.cat([p.detach().flatten().clone() for p in m.parameters()])
    losses = []
    for i in range(4):
        loss = m(data[i * 64:(i + 1) * 64])
        g.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i == 0:
            after = torch.cat([p.detach().flatten() for p in m.parameters()])
            assert ((after - before).norm() / after.norm()).item() > 0.5  # replaced
    report = g.close()
    assert math.isfinite(losses[0]) and not math.isfinite(losses[1])
    assert report.first_nonfinite["step"] == 1
    assert report.diagnosis[0]["cause"] == "optimizer_divergence", report.diagnosis
    assert "update of step 0" in report.diagnosis[0]["evidence"]


def test_after_heal_cut_the_lr_the_fix_starts_where_the_run_ended_not_at_a_rollback() -> None:
    """A run under `heal` that cut the LR twice (0.05 -> 0.0125) and still warned: the fix
    proposes the LR the run ended at (its own history), and not a recovery that already ran;
    the summary's heal line says where the cuts began and how far they went."""
    from nanguard.record.report import Report
    from nanguard.show.summary import heal_line

    actions = [{"step": 205, "action": "heal_clip", "detail": "..."},
               {"step": 260, "action": "lr_cut", "detail": "..."},
               {"step": 359, "action": "lr_cut", "detail": "..."}]
    history = [{"step": s, "grad_norm": 0.5, "loss": 2.8, "lr": lr}
               for s, lr in ((300, 0.025), (400, 0.0125), (401, 0.0125))]
    ev = Evidence(alarms=[{"step": 321, "kind": "cascade", "signal": "grad_norm",
                           "value": 1.7, "message": "grew"}],
                  lr=0.05, optimizer="AdamW", history=history, actions=actions, entry="run")
    fix = R.optimizer_divergence(ev).fix
    assert "heal cut it 2 times in this run, lr=0.05 -> lr=0.0125 (0.25x)" in fix, fix
    assert "start at or below lr=0.0125" in fix
    assert "--policy rollback" not in fix and "acted in this run (heal_clip, lr_cut" in fix
    plain = R.optimizer_divergence(Evidence(alarms=ev.alarms, lr=0.05, history=history,
                                            entry="run")).fix
    assert "--policy rollback" in plain and "heal cut" not in plain  # no action, as before
    report = Report(run={"policy": "heal", "recovery": {"heal": {
        "updates_clipped": 3, "cuts": [{"step": 260, "action": "lr_cut", "lr": 0.05},
                                       {"step": 359, "action": "lr_cut", "lr": 0.025}],
        "lr_factor": 0.25, "cause": "the LR: lr 0.025; 2 grad-norm spikes within 38 steps"}}})
    assert heal_line(report).endswith(
        "within 38 steps (LR cuts from lr 0.05: x0.25 of the scheduler's in all)")


def test_bfloat16_has_float32s_range_so_no_low_precision_overflow() -> None:
    """A masked softmax under bf16 autocast (a fully padded sequence): bfloat16 holds what
    float32 holds, so inputs of 2.75 overflow nothing; the masked row is the cause."""
    first = {"step": 0, "phase": "forward", "op": "aten._softmax",
             "inputs": [{"dtype": "bfloat16", "min": "-inf", "max": 2.75}]}
    causes = diagnose(Evidence(first_nonfinite=first, dtype="bfloat16"))
    assert [c.cause for c in causes] == ["masked_softmax"]
    fp16 = R.low_precision_overflow(Evidence(first_nonfinite=dict(first, op="aten.mm"),
                                             dtype="float16"))
    assert fp16 is not None and "65504" in fp16.evidence


def test_a_loss_jump_gone_the_next_step_is_a_batch_not_divergence() -> None:
    """A healthy run whose loss jumped 1e6x at one step (one batch with labels x1000) and was
    back the next: it read `optimizer_divergence` 60%, "lower the LR 37x". An error the
    optimizer feeds back does not vanish in one update: that step's batch made it."""
    losses = [3.0, 2.9, 2.85, 5.3e6, 2.0, 1.9]
    history = [{"step": 87 + i, "loss": v, "grad_norm": 1.0, "lr": 1e-3}
               for i, v in enumerate(losses)]
    ev = Evidence(history=history, optimizer="AdamW", lr=1e-3, momentum=0.9)
    assert R.optimizer_divergence(ev) is None
    found = R.bad_batch(ev)
    assert found is not None and "step 90" in found.evidence and "back to 2" in found.evidence
    # With no alarm and nothing non-finite the run is healthy: no story at all.
    assert diagnose(ev) == []
    # The same jump that stays up is the optimizer's (and no batch was blamed).
    up = [*losses[:4], 4e6, 9e6]
    ev = Evidence(history=[{**h, "loss": v} for h, v in zip(history, up, strict=True)],
                  optimizer="AdamW", lr=1e-3, momentum=0.9)
    assert R.optimizer_divergence(ev) is not None
    assert R.bad_batch(ev) is None


def test_an_unnamed_spike_among_bad_batches_is_no_case_for_lowering_the_lr() -> None:
    """word_language_model with planted bad batches: 9 spikes named bad batches and one left
    unnamed (a first-epoch batch whose loss was no outlier yet) read "optimizer_divergence:
    lower the LR 10x" after the right `bad_batch`. Spikes alone, some traced to their data,
    show no amplification; a cascade beside them still does."""
    def spike(step: int, cause: str | None = None) -> dict[str, object]:
        a: dict[str, object] = {"step": step, "kind": "spike", "signal": "grad_norm",
                                "value": 5.0, "message": ""}
        return {**a, "cause": cause} if cause else a

    history = [{"step": s, "loss": 2.0, "grad_norm": 1.0, "lr": 3e-3} for s in range(50, 400)]
    alarms = [spike(59), *(spike(s, "bad_batch") for s in (274, 321, 349))]
    ev = Evidence(alarms=alarms, history=history, optimizer="AdamW", lr=3e-3, momentum=0.9)
    assert R.optimizer_divergence(ev) is None
    assert diagnose(ev)[0].cause == "bad_batch"
    cascade = {"step": 300, "kind": "cascade", "signal": "grad_norm", "value": 9.0,
               "message": ""}
    grown = Evidence(alarms=[*alarms, cascade], history=history, optimizer="AdamW", lr=3e-3,
                     momentum=0.9)
    assert R.optimizer_divergence(grown) is not None
    # Spikes that no batch explains at all: the optimizer stays a candidate.
    unnamed = Evidence(alarms=[spike(59), spike(274)], history=history, optimizer="AdamW",
                       lr=3e-3, momentum=0.9)
    assert R.optimizer_divergence(unnamed) is not None


def test_untraced_spikes_that_ran_away_are_the_optimizers_story_first() -> None:
    """word_language_model at `--lr 1000`: the loss ran 5 -> 37 -> 190 -> 3343 from the first
    update; its untraced grad-norm spikes read "also possible: bad_batch (50%)" beside
    `optimizer_divergence` (60%). An error that grows step after step is not one batch's:
    the batch stays a candidate, well below the optimizer."""
    def alarm(step: int, kind: str, signal: str = "grad_norm") -> dict[str, object]:
        return {"step": step, "kind": kind, "signal": signal, "value": 100.0, "message": ""}

    losses = [5.22, 37.1, 189.7, 3343.0]
    history = [{"step": i, "loss": v, "grad_norm": 0.1 * 170 ** min(i, 1), "lr": 1000.0}
               for i, v in enumerate(losses)]
    spikes = [alarm(1, "spike"), alarm(2, "spike")]
    ev = Evidence(alarms=[*spikes, alarm(3, "divergence", "loss")], history=history,
                  optimizer="hand-written", lr=1000.0)
    found = R.bad_batch(ev)
    assert found is not None and found.confidence <= 0.3 and "ran away" in found.evidence
    causes = diagnose(ev)
    assert causes[0].cause == "optimizer_divergence", causes
    assert {c.cause: c.confidence for c in causes}["bad_batch"] < causes[0].confidence
    # The same spikes with no runaway after them keep their even odds.
    calm = R.bad_batch(Evidence(alarms=spikes, history=history[:2], lr=1000.0))
    assert calm is not None and calm.confidence == 0.5
