"""The script's own flag for a value a fix changes (`--lr 0.05` -> `--lr 0.005`), found in
the command line the script ran with (`Evidence.argv`).

A flag is found by its name (dashes and underscores folded away, case ignored, a dotted key
by its last part: `--lr`, `--learning-rate`, `--adam_epsilon`, `--weight-decay`,
`--grad_clip`, `--optimizer.lr`), written `--flag V` or `--flag=V`, the last one given winning
(argparse's rule); failing that, for an LR, eps or weight decay, by its value alone when
exactly one flag holds it (`--step-size 3e-2`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

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


def find_flag(argv: Sequence[str] | None, setting: str,
              values: Sequence[float] = ()) -> Flag | None:
    """The flag of `argv` that set `setting` (`lr`, `eps`, `weight_decay`, `clip`), or None.

    `values`: the values the run had for it (the LR of the failing step, of the onset): a
    flag named for the setting is taken whatever its value (a schedule or a batch-size rule
    may have scaled it), the one holding one of these values first when several are; without
    one, a flag holding one of these values is, when it is the only one that does (and its
    value is not written as a plain integer: `--epochs 1000`)."""
    if not argv:
        return None
    flags = _flags(argv)
    named = [f for f in flags if _NAMES[setting].match(_fold(f.name))]
    held = [f for f in named if any(math.isclose(f.value, v, rel_tol=1e-6) for v in values)]
    if named:  # `--lr 0.1 --max-lr 1` (a one-cycle schedule): the one holding the value
        return (held or named)[-1]
    if setting not in _BY_VALUE or not values:
        return None
    held = [f for f in flags if not f.text.lstrip("+-").isdigit()
            and any(math.isclose(f.value, v, rel_tol=1e-6) for v in values)]
    names = {_fold(f.name) for f in held}
    return held[-1] if len(names) == 1 else None
