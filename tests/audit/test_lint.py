"""`nanguard lint`: every rule has a positive case and a negative case written the right way,
plus noqa, directory walking, select/ignore, JSON output and exit codes."""

from __future__ import annotations

import json
import textwrap

import pytest

from nanguard.audit import RULES, lint_source

HEADER = "import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"

CASES = {
    "NG001": [
        ("p = torch.sigmoid(z)\nloss = F.binary_cross_entropy(p, y)\n",
         "loss = F.binary_cross_entropy_with_logits(z, y)\n"),
        ("crit = nn.BCELoss()\nloss = crit(z.sigmoid(), y)\n",
         "crit = nn.BCEWithLogitsLoss()\nloss = crit(z, y)\n"),
        ("model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())\ncrit = nn.BCELoss()\n",
         "model = nn.Sequential(nn.Linear(4, 1))\ncrit = nn.BCEWithLogitsLoss()\n"),
    ],
    "NG002": [
        ("out = torch.log(F.softmax(z, dim=-1))\n", "out = F.log_softmax(z, dim=-1)\n"),
        ("out = z.softmax(-1).log()\n", "out = z.log_softmax(-1)\n"),
        ("p = torch.sigmoid(z)\nout = torch.log(p)\n", "out = F.logsigmoid(z)\n"),
    ],
    "NG003": [
        ("out = torch.log(x)\n", "out = torch.log(x.clamp(min=1e-6))\n"),
        ("out = x.log()\n", "out = (x + 1e-8).log()\n"),
        ("out = torch.log2(x.abs())\n", "EPS = 1e-8\nout = torch.log2(x.abs() + EPS)\n"),
        ("out = torch.log(x.clamp(min=0))\n", "out = torch.log(torch.tensor(10000.0))\n"),
    ],
    "NG004": [
        ("z = (x - x.mean()) / x.std()\n", "z = (x - x.mean()) / (x.std() + 1e-5)\n"),
        ("u = x / x.norm(dim=-1, keepdim=True)\n",
         "u = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)\n"),
        ("m = (l * mask).sum() / mask.sum()\n", "m = (l * mask).sum() / mask.sum().clamp(min=1)\n"),
        ("v = x.var(-1)\nn = x / v\n", "v = x.var(-1)\nn = x / torch.sqrt(v + 1e-5)\n"),
        ("x /= x.sum()\n", "x /= x.sum() + 1e-8\n"),
    ],
    "NG005": [
        ("d = torch.sqrt((a - b).pow(2).sum(-1))\n",
         "d = torch.sqrt((a - b).pow(2).sum(-1) + 1e-8)\n"),
        ("r = x.pow(2).mean(-1).rsqrt()\n", "r = (x.pow(2).mean(-1) + 1e-6).rsqrt()\n"),
        ("n = x.pow(2).sum() ** 0.5\n", "att = q @ k / head_dim ** 0.5\ns = math.sqrt(d)\n"),
        ("def f(x):\n    return x.sqrt()\n",
         "@torch.no_grad()\ndef f(x):\n    return x.sqrt()\n"
         "with torch.no_grad():\n    y = torch.sqrt(x)\n"),
    ],
    "NG006": [
        ("bn = nn.BatchNorm1d(64, eps=0)\n", "bn = nn.BatchNorm1d(64)\n"),
        ("ln = nn.LayerNorm(512, 1e-12)\n", "ln = nn.LayerNorm(512, eps=1e-5)\n"),
        ("y = F.layer_norm(x, (8,), eps=0.0)\n", "gn = nn.GroupNorm(4, 64, 1e-5)\n"),
    ],
    "NG007": [
        ("opt = torch.optim.Adam(params, lr=1e-3, eps=0)\n",
         "opt = torch.optim.Adam(params, lr=1e-3, eps=1e-8)\n"),
        ("opt = torch.optim.AdamW(params, 1e-3, (0.9, 0.999), 0.0)\n",
         "opt = torch.optim.AdamW(params, 1e-3)\n"),
    ],
    "NG008": [
        ("h = model.register_backward_hook(fn)\n", "h = model.register_full_backward_hook(fn)\n"),
    ],
    "NG009": [
        ("sd = torch.load(path)\n", "sd = torch.load(path, weights_only=True)\n"),
        ("sd = torch.load(path, weights_only=False)\n", "sd = torch.load(path, **kwargs)\n"),
    ],
}  # fmt: skip

PAIRS = [(code, i, pos, neg) for code, pairs in CASES.items() for i, (pos, neg) in enumerate(pairs)]


def test_every_rule_has_cases():
    assert set(CASES) == set(RULES)


@pytest.mark.parametrize(("code", "i", "pos", "neg"), PAIRS, ids=[f"{c}-{i}" for c, i, *_ in PAIRS])
def test_rule_positive_and_negative(code, i, pos, neg):
    found = lint_source(HEADER + pos, "t.py")
    assert [f.code for f in found] == [code], [f.format() for f in found]
    assert found[0].fix and found[0].line > 4
    clean = lint_source(HEADER + neg, "t.py")
    assert clean == [], [f.format() for f in clean]


CORRECT_MODEL = """
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim)
        self.crit = nn.CrossEntropyLoss()

    def forward(self, x, y, mask):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att / math.sqrt(q.shape[-1])
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        out = att @ v
        logp = F.log_softmax(out, dim=-1)
        rms = out.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        self.log("loss", logp.mean())
        return self.crit(out, y) + (out * rms).mean() + torch.log1p(out.abs()).mean()
"""


def test_no_false_positives_on_a_correct_model():
    assert lint_source(CORRECT_MODEL, "model.py") == []


def test_noqa_specific_and_bare(tmp_path):
    src = HEADER + "a = torch.log(x)  # noqa: NG003\nb = torch.log(x)  # noqa\n"
    src += "c = torch.log(x)  # noqa: NG001\nd = '# noqa'; e = torch.log(x)\n"
    found = lint_source(src, "t.py")
    assert [(f.line, f.code) for f in found] == [(7, "NG003"), (8, "NG003")]


def test_directory_walk_json_and_exit_codes(tmp_path, cli):
    pkg = tmp_path / "proj" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "train.py").write_text(HEADER + "sd = torch.load('x.pt')\n")
    (tmp_path / "proj" / "ok.py").write_text("x = 1\n")
    (tmp_path / "proj" / "notes.txt").write_text("torch.load('x')\n")
    code, out, _ = cli("lint", tmp_path / "proj")
    assert code == 1
    assert out.splitlines()[0].startswith(f"{pkg / 'train.py'}:5:6: NG009 ")
    code, out, _ = cli("lint", tmp_path / "proj", "--format", "json")
    assert code == 1 and [f["code"] for f in json.loads(out)] == ["NG009"]
    code, out, _ = cli("lint", tmp_path / "proj", "--ignore", "NG009")
    assert code == 0 and "All checks passed" in out
    code, out, _ = cli("lint", tmp_path / "proj" / "ok.py")
    assert code == 0


def test_unknown_rule_code_is_user_error(tmp_path, cli):
    (tmp_path / "a.py").write_text("x = 1\n")
    code, _, err = cli("lint", tmp_path / "a.py", "--select", "NG999")
    assert code == 2 and "NG999" in err


def test_multiline_code_is_dedented_source():
    src = textwrap.dedent("""
        import torch
        def f(x):
            y = torch.softmax(x, -1)
            return torch.log(
                y
            )
    """)
    assert [(f.code, f.line) for f in lint_source(src)] == [("NG002", 5)]
