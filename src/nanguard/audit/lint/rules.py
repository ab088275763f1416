"""Lint rules for the classic numerical mistakes in training code.

Every rule prefers silence to a guess: it fires on what is plainly visible in the source
(a call, a literal, a local assignment) and never on a floor it can see (`+ eps`, `clamp`,
`maximum`, a constant).
"""

from __future__ import annotations

import ast

from nanguard.audit.lint.engine import Context

RULES: dict[str, str] = {
    "NG001": "sigmoid followed by binary_cross_entropy / BCELoss",
    "NG002": "log of softmax / sigmoid output",
    "NG003": "log without a floor",
    "NG004": "division by a std / norm / sum / var without eps",
    "NG005": "sqrt without eps where a gradient flows",
    "NG006": "normalisation layer with eps <= 1e-8",
    "NG007": "optimizer with eps <= 0",
    "NG008": "deprecated register_backward_hook",
    "NG009": "torch.load without weights_only=True",
}

_TORCH_NS = ("torch.", "torch.nn.functional.", "torch.special.", "torch.linalg.", "torch.Tensor.")
_LOGS = {"log", "log2", "log10"}
_SQRTS = {"sqrt", "rsqrt"}
_DENOMS = {"std", "norm", "sum", "var", "vector_norm", "matrix_norm", "nansum"}
_CLAMPS = {"clamp", "clip", "clamp_min", "clamp_", "clip_", "clamp_min_"}
_POSITIVE = {"exp", "softplus", "maximum", "fmax", "max", "tensor", "as_tensor", "ones",
             "full", "exp2", "cosh"}  # fmt: skip
_NORM_EPS_POS = {
    "BatchNorm1d": 1, "BatchNorm2d": 1, "BatchNorm3d": 1, "SyncBatchNorm": 1,
    "InstanceNorm1d": 1, "InstanceNorm2d": 1, "InstanceNorm3d": 1, "LayerNorm": 1,
    "RMSNorm": 1, "GroupNorm": 2, "LazyBatchNorm1d": 0, "LazyBatchNorm2d": 0,
    "LazyBatchNorm3d": 0,
}  # fmt: skip
_F_NORM_EPS_POS = {"batch_norm": 7, "instance_norm": 7, "layer_norm": 4, "group_norm": 4,
                   "rms_norm": 3}  # fmt: skip
_OPTIMS = {"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "RMSprop", "Adadelta",
           "SparseAdam"}  # fmt: skip


def _torch_fn(ctx: Context, call: ast.expr, names: set[str]) -> str | None:
    """The function name if `call` is ``torch.<name>(...)`` / ``F.<name>(...)`` (any alias)."""
    if not isinstance(call, ast.Call):
        return None
    qual = ctx.qualname(call.func)
    for ns in _TORCH_NS:
        if qual.startswith(ns) and qual[len(ns) :] in names:
            return qual[len(ns) :]
    return None


def _method(ctx: Context, call: ast.expr, names: set[str]) -> str | None:
    """The method name if `call` is ``<tensor>.<name>(...)`` on a value, not a module."""
    if (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in names
        and not ctx.is_module_path(call.func.value)
    ):
        return call.func.attr
    return None


def _op(ctx: Context, call: ast.expr, names: set[str]) -> str | None:
    return _torch_fn(ctx, call, names) or _method(ctx, call, names)


def _first_arg(call: ast.Call) -> ast.expr | None:
    """The operand: the receiver of a method call, else the first positional argument."""
    if isinstance(call.func, ast.Attribute) and not call.args:
        return call.func.value
    return call.args[0] if call.args else None


def _num(expr: ast.expr) -> float | None:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, (int, float)):
        return float(expr.value)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        inner = _num(expr.operand)
        return -inner if inner is not None else None
    return None


def _eps_like(ctx: Context, expr: ast.expr) -> bool:
    value = _num(expr)
    if value is not None:
        return value > 0
    name = ctx.qualname(expr).rsplit(".", 1)[-1].lower()
    return "eps" in name or name in ("tiny", "epsilon")


def _constantish(ctx: Context, expr: ast.expr, depth: int = 0) -> bool:
    """A Python number or a literal tensor: no gradient, no surprise zero."""
    expr = ctx.resolve(expr) if depth < 3 else expr
    if _num(expr) is not None:
        return True
    if isinstance(expr, ast.BinOp):
        return _constantish(ctx, expr.left, depth + 1) and _constantish(ctx, expr.right, depth + 1)
    if isinstance(expr, ast.Call):
        qual = ctx.qualname(expr.func)
        if qual in ("len", "float", "int") or qual.startswith("math."):
            return True
        if qual in ("torch.tensor", "torch.as_tensor") and expr.args:
            return _constantish(ctx, expr.args[0], depth + 1)
    if isinstance(expr, ast.Subscript):  # x.shape[-1]
        return isinstance(expr.value, ast.Attribute) and expr.value.attr == "shape"
    return isinstance(expr, ast.Name) and expr.id.isupper()


def _floored(ctx: Context, expr: ast.expr, depth: int = 0) -> bool:
    """True when the expression visibly cannot be 0 (or negative): `+ eps`, `clamp(min=c>0)`,
    `maximum`, `exp`, a constant."""
    if depth > 4:
        return False
    expr = ctx.resolve(expr)
    if _constantish(ctx, expr):
        value = _num(expr)
        return value is None or value > 0
    if isinstance(expr, ast.BinOp):
        if isinstance(expr.op, ast.Add):
            return (
                _eps_like(ctx, expr.left)
                or _eps_like(ctx, expr.right)
                or (_floored(ctx, expr.left, depth + 1) and _floored(ctx, expr.right, depth + 1))
            )
        if isinstance(expr.op, (ast.Mult, ast.Div, ast.Pow)):
            return _floored(ctx, expr.left, depth + 1) and (
                isinstance(expr.op, ast.Pow) or _floored(ctx, expr.right, depth + 1)
            )
        return False
    if not isinstance(expr, ast.Call):
        return False
    if _op(ctx, expr, _CLAMPS):
        lows = [k.value for k in expr.keywords if k.arg == "min"]
        idx = 1 if _torch_fn(ctx, expr, _CLAMPS) else 0  # torch.clamp(x, lo) / x.clamp(lo)
        if len(expr.args) > idx:
            lows.append(expr.args[idx])
        low = _num(lows[0]) if lows else None
        return bool(lows) and (low is None or low > 0)
    if _op(ctx, expr, _POSITIVE):
        return True
    if _op(ctx, expr, {"add", "add_"}) and expr.args and _eps_like(ctx, expr.args[-1]):
        return True  # x.add(eps), torch.add(x, eps)
    if _op(ctx, expr, _SQRTS):  # sqrt(var + eps) is as far from 0 as its argument
        arg = _first_arg(expr)
        return arg is not None and _floored(ctx, arg, depth + 1)
    return ctx.qualname(expr.func) == "max" and len(expr.args) >= 2


def _in_no_grad(ctx: Context, node: ast.AST) -> bool:
    grad_off = ("torch.no_grad", "torch.inference_mode", "torch.set_grad_enabled")
    cur = ctx.parent.get(node)
    while cur is not None:
        if isinstance(cur, ast.With):
            for item in cur.items:
                e = item.context_expr
                if isinstance(e, ast.Call) and ctx.qualname(e.func) in grad_off:
                    return True
        if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in cur.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ctx.qualname(target) in grad_off:
                    return True
        cur = ctx.parent.get(cur)
    return False


def _is_sigmoid(ctx: Context, expr: ast.expr) -> bool:
    expr = ctx.resolve(expr)
    if _op(ctx, expr, {"sigmoid"}):
        return True
    # an nn.Sigmoid() module called on something
    return isinstance(expr, ast.Call) and _module_is(ctx, expr.func, "Sigmoid")


def _module_is(ctx: Context, func: ast.expr, cls: str) -> bool:
    """Whether `func` (the callee) is an instance of torch.nn.<cls>, constructed visibly."""
    target = ctx.resolve(func)
    return isinstance(target, ast.Call) and ctx.qualname(target.func) == f"torch.nn.{cls}"


def _check_call(ctx: Context, node: ast.Call) -> None:
    qual = ctx.qualname(node.func)
    leaf = qual.rsplit(".", 1)[-1]

    # NG001: probabilities from a sigmoid fed to BCE.
    is_bce = _torch_fn(ctx, node, {"binary_cross_entropy"}) or _module_is(ctx, node.func, "BCELoss")
    if is_bce and node.args and _is_sigmoid(ctx, node.args[0]):
        ctx.report(node, "NG001",
                   "sigmoid followed by binary_cross_entropy: saturates (loss clamped at 100, "
                   "zero gradient) and is unsafe under autocast",
                   "drop the sigmoid and use F.binary_cross_entropy_with_logits / "
                   "nn.BCEWithLogitsLoss on the logits")  # fmt: skip

    # NG002 / NG003: log of softmax or sigmoid; log without a floor.
    if _op(ctx, node, _LOGS) and not (_method(ctx, node, _LOGS) and node.args):
        arg = _first_arg(node)
        if arg is not None and not _floored(ctx, arg):
            inner = ctx.resolve(arg)
            kind = _op(ctx, inner, {"softmax", "sigmoid"})
            if kind:
                better = "F.log_softmax(x, dim)" if kind == "softmax" else "F.logsigmoid(x)"
                ctx.report(node, "NG002",
                           f"log of {kind}: underflows to log(0) = -inf for confident outputs",
                           f"use {better} on the logits")  # fmt: skip
            elif not _constantish(ctx, arg):
                ctx.report(node, "NG003",
                           f"{_op(ctx, node, _LOGS)} without a floor: -inf at 0, NaN below",
                           "log(x.clamp_min(eps)) or log(x + eps)")  # fmt: skip

    # NG004: torch.div / x.div by a risky denominator.
    if _op(ctx, node, {"div", "true_divide", "divide"}) and node.args:
        denom = (
            node.args[1] if _torch_fn(ctx, node, {"div", "true_divide", "divide"}) else node.args[0]
        )
        if len(node.args) > 1 or _method(ctx, node, {"div", "true_divide", "divide"}):
            _check_denominator(ctx, node, denom)

    # NG005: sqrt / rsqrt / pow(x, 0.5) without eps.
    sq = _op(ctx, node, _SQRTS)
    if sq and (arg := _first_arg(node)) is not None:
        _check_sqrt(ctx, node, arg, sq)
    if _torch_fn(ctx, node, {"pow"}) and len(node.args) == 2 and _num(node.args[1]) in (0.5, -0.5):
        _check_sqrt(ctx, node, node.args[0], "pow(x, 0.5)")

    # NG006: normalisation eps too small.
    pos = None
    if qual.startswith("torch.nn.") and leaf in _NORM_EPS_POS and qual.count(".") == 2:
        pos = _NORM_EPS_POS[leaf]
    elif _torch_fn(ctx, node, set(_F_NORM_EPS_POS)):
        pos = _F_NORM_EPS_POS[leaf]
    if pos is not None:
        eps = _arg(node, "eps", pos)
        value = _num(eps) if eps is not None else None
        if value is not None and value <= 1e-8:
            ctx.report(node, "NG006",
                       f"{leaf} with eps={value:g}: a constant channel divides by ~0 "
                       "(and eps below 6e-8 is 0 in float16)",
                       "use eps=1e-5 (the PyTorch default)")  # fmt: skip

    # NG007: adaptive optimizer with eps <= 0.
    if qual.startswith("torch.optim.") and leaf in _OPTIMS:
        eps = _arg(node, "eps", 3 if leaf in ("Adam", "AdamW") else None)
        value = _num(eps) if eps is not None else None
        if value is not None and value <= 0:
            ctx.report(node, "NG007",
                       f"{leaf} with eps={value:g}: a parameter whose gradient is always 0 "
                       "divides 0 by 0 (NaN)", "use eps=1e-8 (the default)")  # fmt: skip

    # NG008: deprecated hook.
    if isinstance(node.func, ast.Attribute) and node.func.attr == "register_backward_hook":
        ctx.report(node, "NG008",
                   "register_backward_hook is deprecated and gives wrong grad_input for "
                   "modules with several operations",
                   "use register_full_backward_hook")  # fmt: skip

    # NG009: torch.load that can execute pickled code.
    if qual == "torch.load" and not any(k.arg is None for k in node.keywords):
        wo = _arg(node, "weights_only", None)
        if wo is None or (isinstance(wo, ast.Constant) and wo.value is not True):
            ctx.report(node, "NG009",
                       "torch.load without weights_only=True can execute code from the file",
                       "torch.load(path, weights_only=True)")  # fmt: skip


def _arg(node: ast.Call, name: str, pos: int | None) -> ast.expr | None:
    for k in node.keywords:
        if k.arg == name:
            return k.value
    if pos is not None and len(node.args) > pos:
        return node.args[pos]
    return None


def _check_denominator(ctx: Context, node: ast.AST, denom: ast.expr) -> None:
    target = ctx.resolve(denom)
    if _floored(ctx, target):
        return
    kind = _op(ctx, target, _DENOMS)
    if kind is None and _op(ctx, target, _SQRTS):
        kind = "sqrt"
    if kind is None:
        return
    ctx.report(node, "NG004",
               f"division by a {kind}() with no eps: inf/NaN when it is 0 "
               "(constant input, empty mask, zero vector)",
               f"divide by ({kind}(...) + eps) or {kind}(...).clamp_min(eps)")  # fmt: skip


def _check_sqrt(ctx: Context, node: ast.AST, arg: ast.expr, what: str) -> None:
    if _floored(ctx, arg) or _constantish(ctx, arg) or _in_no_grad(ctx, node):
        return
    ctx.report(node, "NG005",
               f"{what} without eps: its gradient is infinite at 0 (NaN in backward)",
               "sqrt(x + eps), or x.clamp_min(eps).sqrt()")  # fmt: skip


def _tensorish(ctx: Context, expr: ast.expr) -> bool:
    """Visibly a tensor computation (a call), not a Python number such as head_dim."""
    expr = ctx.resolve(expr)
    return isinstance(expr, ast.Call) and not _constantish(ctx, expr)


def _check_binop(ctx: Context, node: ast.BinOp) -> None:
    if isinstance(node.op, ast.Div):
        _check_denominator(ctx, node, node.right)
    elif (
        isinstance(node.op, ast.Pow)
        and _num(node.right) in (0.5, -0.5)
        and _tensorish(ctx, node.left)
    ):
        _check_sqrt(ctx, node, node.left, f"x ** {_num(node.right):g}")


def _sigmoid_model_output(ctx: Context) -> ast.AST | None:
    """A visible model whose output is a sigmoid: nn.Sequential(..., nn.Sigmoid()) or a
    forward() that returns sigmoid(...)."""
    for node in ast.walk(ctx.tree):
        if isinstance(node, ast.Call) and ctx.qualname(node.func) == "torch.nn.Sequential":
            last = node.args[-1] if node.args else None
            if isinstance(last, ast.Call) and ctx.qualname(last.func) == "torch.nn.Sigmoid":
                return last
        if isinstance(node, ast.FunctionDef) and node.name == "forward":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and ret.value and _is_sigmoid(ctx, ret.value):
                    return ret
    return None


def _check_module_sigmoid_bce(ctx: Context) -> None:
    """NG001 across a file: the model ends in a sigmoid and the loss is BCELoss."""
    source = _sigmoid_model_output(ctx)
    if source is None:
        return
    flagged = {(f.line, f.col) for f in ctx.findings if f.code == "NG001"}
    for node in ast.walk(ctx.tree):
        if (
            isinstance(node, ast.Call)
            and ctx.qualname(node.func) == "torch.nn.BCELoss"
            and (node.lineno, node.col_offset + 1) not in flagged
        ):
            ctx.report(node, "NG001",
                       f"BCELoss on a model whose output passes through a sigmoid "
                       f"(line {getattr(source, 'lineno', '?')}): saturates, zero gradient",
                       "remove the final sigmoid and use nn.BCEWithLogitsLoss")  # fmt: skip


def run_rules(ctx: Context) -> None:
    for node in ast.walk(ctx.tree):
        if isinstance(node, ast.Call):
            _check_call(ctx, node)
        elif isinstance(node, ast.BinOp):
            _check_binop(ctx, node)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
            _check_denominator(ctx, node, node.value)
    _check_module_sigmoid_bce(ctx)
