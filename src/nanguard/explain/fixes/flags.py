"""The script's own flag for a value a fix changes (`--lr 0.05` -> `--lr 0.005`), found in
the command line the script ran with (`Evidence.argv`).

A flag is found by its name (dashes and underscores folded away, case ignored, a dotted key
by its last part: `--lr`, `--learning-rate`, `--adam_epsilon`, `--weight-decay`,
`--grad_clip`, `--optimizer.lr`), written `--flag V` or `--flag=V`, the last one given winning
(argparse's rule); failing that, for an LR, eps or weight decay, by its value alone when
exactly one flag holds it (`--step-size 3e-2`). When several do (SAC's `--q-lr 3 --policy-lr
3`), the one whose words name the failing part (`context_words`: `q_optimizer.step()` is the
critic's, not the policy's) is taken; `holders` gives them all for a fix that cannot tell.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAMES = {
    "lr": re.compile(r"^(?:base|max|peak|init(?:ial)?)?(?:lr|learningrate)$"),
    "eps": re.compile(r"^(?:adam|adamw|optim(?:izer)?)?(?:eps|epsilon)$"),
    "weight_decay": re.compile(r"^(?:weightdecay|wd|l2(?:reg)?|decay)$"),
    "clip": re.compile(r"^(?:grad(?:ient)?)?clip(?:grad(?:ient)?)?(?:norm|val(?:ue)?)?$"
                       r"|^maxgrad(?:ient)?norm$"),
    "gamma": re.compile(r"^(?:gamma|discount(?:factor)?)$"),
    "batch_size": re.compile(r"^(?:(?:mini)?batch(?:size)?|bs|(?:mini)?batchsz)$"),
}
"""Flag names (folded) per setting."""

_PART_LR = re.compile(r"^[a-z]+[0-9]*(?:lr|learningrate)$")
"""A part's own LR flag (folded): `--q-lr`, `--policy_lr`, `--critic-learning-rate` (or, LR
first, one ending in a part's word: `--lr-d`, `--lr_actor`)."""

_BY_VALUE = ("lr", "eps", "weight_decay")
"""Settings whose flag may be found by its value alone (a clip of 1.0 is too common a number)."""


@dataclass(frozen=True)
class Flag:
    """One flag of the script's command line."""

    name: str
    """As the user wrote it, dashes included: `--learning_rate`."""
    text: str
    """Its value as written: `1e3`."""
    eq: bool = False
    """Written `--flag=V` (a fix is written the same way)."""

    @property
    def value(self) -> float:
        return float(self.text)

    def now(self) -> str:
        """The flag as the run had it, in backquotes: `` `--lr 0.05` ``."""
        return self.with_text(self.text)

    def set(self, value: float) -> str:
        """The flag set to `value`, in backquotes: `` `--lr 0.005` ``."""
        return self.with_text(number(value))

    def with_text(self, text: str) -> str:
        return f"`{self.name}{'=' if self.eq else ' '}{text}`"

    def flipped(self) -> str | None:
        """The value as written with its exponent's sign flipped (`1e3` -> `1e-3`, `1000` ->
        `1e-3`), or None when it has no positive exponent."""
        m = re.fullmatch(r"([0-9.]+)[eE]\+?([0-9]+)", self.text)
        if m:
            return f"{m.group(1)}e-{int(m.group(2))}"
        if self.value >= 10:
            mantissa, exponent = f"{self.value:.6e}".split("e")
            return f"{float(mantissa):g}e-{int(exponent)}"
        return None


def below_one(flag: Flag) -> str | None:
    """The discount factor a value above 1 was presumably meant as, written as typed
    (`99` -> `0.99`, `995` -> `0.995`, `9.9` -> `0.99`), or None when no digits read so."""
    digits = flag.text.replace(".", "", 1)
    if not digits.isdigit() or flag.value <= 1 or flag.value >= 1000:
        return None
    meant = "0." + digits.lstrip("0")
    return meant if 0.5 <= float(meant) < 1 else None


def number(v: float) -> str:
    """A value as a user types it: `0.005`, `1e-5` (not `1e-05`), `100`."""
    text = f"{v:.3g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        return f"{mantissa}e{int(exponent)}"
    return text


def _flags(argv: Sequence[str]) -> list[Flag]:
    """Every `--name V` / `--name=V` / `-name V` whose value is a finite number."""
    out: list[Flag] = []
    for i, arg in enumerate(argv):
        if not arg.startswith("-") or len(arg) < 3 or _is_number(arg):
            continue
        name, eq, text = arg.partition("=")
        if not eq:
            text = argv[i + 1] if i + 1 < len(argv) else ""
        if _is_number(text):
            out.append(Flag(name=name, text=text, eq=bool(eq)))
    return out


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _fold(name: str) -> str:
    """`--Learning-Rate` -> `learningrate`; a dotted config key (LightningCLI's
    `--optimizer.lr`, `--model.learning_rate`) by its last part."""
    return name.lstrip("-").rsplit(".", 1)[-1].replace("-", "").replace("_", "").lower()


_SAME_PART = (
    frozenset({"q", "qf", "critic", "vf"}),
    frozenset({"policy", "pi", "actor"}),
    frozenset({"alpha", "temperature", "entropy", "ent"}),
    frozenset({"d", "disc", "discriminator", "netd", "critic"}),
    frozenset({"g", "gen", "generator", "netg"}),
    frozenset({"enc", "encoder"}),
    frozenset({"dec", "decoder"}),
)
"""Words that name the same part of a model of several parts (RL's actor and critic, a GAN's
generator and discriminator, an encoder and a decoder)."""

_SETTING_WORDS = frozenset({"lr", "learning", "rate", "eps", "epsilon", "weight", "decay",
                            "wd", "base", "max", "peak", "init", "initial"})
"""Words of a flag's name that say which setting it is, not which part it sets."""

_ANY_PART = frozenset({"optimizer", "optim", "opt", "step", "model", "net", "module",
                       "weight", "bias", "self", "args", "loss"})
"""Words any part's line or flag may hold: no evidence of which part."""


def words(text: str) -> set[str]:
    """The lower-case words of identifiers in `text`: `q_optimizer.step()` -> {q, optimizer,
    step}; `qf1`, `netD`, `--policy-lr` -> {qf}, {net, d}, {policy, lr}."""
    out: set[str] = set()
    for ident in re.findall(r"[A-Za-z][A-Za-z0-9]*", text.replace("_", " ")):
        # camelCase parts, digits kept inside a word (`Conv2d`) and dropped at its end (`qf1`)
        for w in [*re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", ident), ident]:
            out.add(re.sub(r"[0-9]+$", "", w).lower())
    return out - {""}


def context_words(first: Mapping[str, Any] | None) -> set[str]:
    """Words that name the part a finding is in: its module and parameter names, and the
    identifiers of the user's line it ran at (`q_optimizer.step()` for an optimizer-phase
    value; the line is read from the file when it is still there)."""
    if not first:
        return set()
    found = words(" ".join(str(first.get(k) or "") for k in ("module", "param")))
    source = str(first.get("source") or "")
    path, _, line = source.rpartition(":")
    if path and line.isdigit():
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        if 0 < int(line) <= len(lines):
            found |= words(lines[int(line) - 1].split("#", 1)[0])
    return found


def _names_part(flag: Flag, context: set[str]) -> bool:
    """The words of `flag`'s name, less the setting's own (`lr`), name a part in `context`
    (`--q-lr` and `q_optimizer`, `--critic-lr` and `qf1`)."""
    own = words(flag.name) - _SETTING_WORDS - _ANY_PART
    return bool(own & context) or any(own & group and context & group for group in _SAME_PART)


def holders(argv: Sequence[str] | None, setting: str,
            values: Sequence[float] = ()) -> list[Flag]:
    """The flags that may have set `setting` to one of `values`, the last of each name, in
    the order given: those named for it (a part's own, `--q-lr`, included), the ones holding
    one of `values` when some do; else, for an LR, eps or weight decay, every flag holding
    one of `values` (not written as a plain integer: `--epochs 1000`). What a fix names when
    `find_flag` cannot tell which of them set the failing part's value."""
    if not argv:
        return []
    flags = _flags(argv)
    generic = [f for f in flags if _NAMES[setting].match(_fold(f.name))]
    named = [f for f in flags if f in generic or _part_lr(f, setting)]
    held = [f for f in named if any(math.isclose(f.value, v, rel_tol=1e-6) for v in values)]
    if not named and setting in _BY_VALUE and values:
        held = [f for f in flags if not f.text.lstrip("+-").isdigit()
                and any(math.isclose(f.value, v, rel_tol=1e-6) for v in values)]
    # `--lr 0.1 --q-lr 3` with no value to go by: the LR's own flag, as before part flags.
    found = held or generic or named
    last: dict[str, Flag] = {}
    for f in reversed(found):  # each name's last, in the order of those
        last.setdefault(_fold(f.name), f)
    return list(last.values())[::-1]


_SCHEDULE_WORDS = frozenset({"min", "final", "end", "last", "warmup", "start", "target",
                             "cycle", "cyclic", "scheduler", "schedule", "decay", "lrs"})
"""Words of an LR flag's name that make it a schedule's bound, not a part's LR."""


def _part_lr(flag: Flag, setting: str) -> bool:
    """`flag` is a part's LR (`--q-lr`, `--critic_learning_rate`, `--lr-d`: SAC, DDPG, a
    GAN's two optimizers), not a schedule's bound (`--min-lr`, `--lr-decay`)."""
    folded = _fold(flag.name)
    if setting != "lr" or words(flag.name) & _SCHEDULE_WORDS:
        return False
    after = re.fullmatch(r"(?:lr|learningrate)([a-z]+)[0-9]*", folded)  # LR first: `--lr-d`
    return bool(_PART_LR.match(folded)) or (after is not None
                                            and any(after[1] in g for g in _SAME_PART))


def find_flag(argv: Sequence[str] | None, setting: str,
              values: Sequence[float] = (), context: set[str] | None = None) -> Flag | None:
    """The flag of `argv` that set `setting` (`lr`, `eps`, `weight_decay`, `clip`), or None.

    `values`: the values the run had for it (the LR of the failing step, of the onset): a
    flag named for the setting is taken whatever its value (a schedule or a batch-size rule
    may have scaled it), the one holding one of these values first when several are; without
    one, a flag holding one of these values is, when it is the only one that does (and its
    value is not written as a plain integer: `--epochs 1000`). Of several (`holders`) naming
    parts (`--q-lr 3 --policy-lr 3`), the only one whose name names the failing part
    (`context`, from `context_words`: `q_optimizer.step()`) is; None when none or several do
    (the fix then names them all)."""
    found = holders(argv, setting, values)
    if len(found) <= 1:
        return found[0] if found else None
    if context:
        part = [f for f in found if _names_part(f, context)]
        if len(part) == 1:
            return part[0]
    if all(_NAMES[setting].match(_fold(f.name)) for f in found):  # `--lr 0.1 --max-lr 1`
        return found[-1]
    return None
