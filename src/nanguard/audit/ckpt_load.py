"""Open checkpoints without executing code, and read them tensor by tensor in chunks.

Two formats: safetensors (read through `safe_open`, which memory-maps the file, so a tensor is
read a slice of rows at a time) and torch files (`torch.save`, zip or legacy format) loaded
with `torch.load(weights_only=True)`, whose unpickler refuses every global outside PyTorch's
allowlist. A torch file that needs any other global is reported as unsafe and never loaded.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import pickletools
import re
import struct
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from nanguard.audit.common import AuditInputError, UnsafeCheckpointError, one_line, require

# Elements per chunk when streaming a tensor: bounds memory to tens of MB whatever its size.
CHUNK_ELEMS = 1 << 21

_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}

# Globals a torch.save'd state dict legitimately references (used only to word the error for
# raw pickles; the safety gate itself is torch's weights_only unpickler).
_BENIGN_GLOBAL = re.compile(r"^(torch\.|collections\.OrderedDict$|_codecs\.encode$|builtins\.set$)")


def sniff(path: str) -> str:
    """Return ``safetensors``, ``torch-zip`` or ``pickle`` from the file's first bytes.

    Raises:
        AuditInputError: missing, a directory, empty, or not a checkpoint at all.
    """
    if not os.path.exists(path):
        raise AuditInputError(f"{path}: no such file")
    if os.path.isdir(path):
        raise AuditInputError(f"{path}: is a directory, expected a checkpoint file")
    size = os.path.getsize(path)
    if size == 0:
        raise AuditInputError(f"{path}: empty file (0 bytes)")
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if len(head) == 9 and head[8:9] == b"{":
        (header_len,) = struct.unpack("<Q", head[:8])
        if 8 + header_len > size:
            raise AuditInputError(
                f"{path}: truncated safetensors file (header says {header_len} bytes, "
                f"file has {size - 8})"
            )
        return "safetensors"
    if head[:1] == b"\x80":
        return "pickle"
    raise AuditInputError(
        f"{path}: not a checkpoint (expected a .safetensors file or a file written by torch.save)"
    )


def _pickle_globals(stream: IO[bytes]) -> list[str] | None:
    """Globals a pickle would import, read from its opcodes without running any of them.

    Returns None when the bytes are not a well-formed pickle.
    """
    names: list[str] = []
    recent: list[str] = []
    try:
        for op, arg, _pos in pickletools.genops(stream):
            if op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                names.append(".".join(recent[-2:]) if len(recent) >= 2 else "?")
            elif isinstance(arg, str):
                recent = [*recent[-1:], arg]
            if op.name == "STOP":
                break
    except Exception:  # genops raises ValueError and friends on garbage
        return None
    return names


def _explain_unpickling_failure(path: str, kind: str, exc: Exception) -> AuditInputError:
    """Turn a weights_only refusal into 'unsafe' (needs foreign code) or 'corrupt'."""
    msg = str(exc)
    match = re.search(r"Unsupported global: GLOBAL (\S+)", msg)
    if match:
        return UnsafeCheckpointError(
            f"{path}: unsafe checkpoint: loading it would execute pickled code "
            f"({match.group(1)}); refused, nothing was loaded"
        )
    try:
        if kind == "torch-zip":
            with zipfile.ZipFile(path) as zf:
                pkl = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
                names = _pickle_globals(zf.open(pkl)) if pkl else None
        else:
            with open(path, "rb") as f:
                names = _pickle_globals(f)
    except (OSError, zipfile.BadZipFile):
        names = None
    foreign = sorted({n for n in names or [] if not _BENIGN_GLOBAL.match(n)})
    if foreign:
        return UnsafeCheckpointError(
            f"{path}: unsafe checkpoint: loading it would execute pickled code "
            f"({', '.join(foreign[:3])}); refused, nothing was loaded"
        )
    if names:
        return AuditInputError(
            f"{path}: a raw pickle, not a torch.save file; re-save it with torch.save"
        )
    return AuditInputError(f"{path}: corrupt or not a torch checkpoint ({_first_sentence(msg)})")


def _first_sentence(exc: object) -> str:
    line = one_line(exc)
    return line.split(". ", 1)[0][:160]


def load_torch(path: str, kind: str) -> Any:
    """`torch.load` with weights_only=True; every failure becomes an AuditInputError."""
    import torch

    try:
        # mmap keeps a large zip checkpoint on disk until a tensor is touched. Warnings are
        # silenced because torch emits some for odd files and the CLI's stderr is one line.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=kind == "torch-zip")
    except pickle.UnpicklingError as exc:
        raise _explain_unpickling_failure(path, kind, exc) from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, KeyError... on bad bytes
        raise AuditInputError(
            f"{path}: corrupt or truncated torch checkpoint ({_first_sentence(exc)})"
        ) from None


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of nested dicts / lists / tuples with dotted names (``optimizer.state.0.exp_avg``)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)) and not (prefix.endswith(".params") or prefix == "params"):
        for i, value in enumerate(obj):
            yield from flatten(value, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def new_digest(dtype: str, shape: tuple[int, ...] | list[int]) -> Any:
    """The content hash of one tensor, before its bytes: sha256 seeded with its dtype and shape.

    The definition every auditor shares (`TensorStats.sha256`, the manifest of
    `nanguard.audit.manifest`): sha256 of ``f"{dtype}{list(shape)}"`` followed by the tensor's
    elements in row-major order, each in the machine's (little-endian) byte order. It depends
    on the values only, not on the file format or the device: a tensor hashes the same in a
    torch file, a safetensors file and in memory.
    """
    return hashlib.sha256(f"{dtype}{list(shape)}".encode())


def update_digest(digest: Any, chunk: Any) -> Any:
    """Feed one chunk (a 1-D tensor from `Source.chunks`) to `digest`; returns the contiguous
    CPU chunk, which callers reuse for their statistics."""
    import torch

    raw = chunk.contiguous()
    if raw.device.type != "cpu":  # an in-memory state dict may live on a GPU
        raw = raw.cpu()
    digest.update(memoryview(raw.view(torch.uint8).numpy()))
    return raw


class Source:
    """A checkpoint opened for streaming: tensor names, dtype and shape, and chunked data."""

    format = ""

    def names(self) -> list[str]:
        raise NotImplementedError

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype name without the ``torch.`` prefix, shape)."""
        raise NotImplementedError

    def chunks(self, name: str) -> Iterator[Any]:
        """The tensor's elements in row-major order, as 1-D torch tensors of bounded size."""
        raise NotImplementedError

    def scalars(self) -> dict[str, Any]:
        """Non-tensor leaves (numbers, strings) by dotted name."""
        return {}

    def nbytes(self, name: str) -> int:
        dtype, shape = self.meta(name)
        import torch

        return math.prod(shape) * getattr(torch, dtype).itemsize


class TorchSource(Source):
    format = "torch"

    def __init__(self, obj: Any) -> None:
        import torch

        if isinstance(obj, torch.Tensor):
            obj = {"tensor": obj}
        self._tensors: dict[str, Any] = {}
        self._scalars: dict[str, Any] = {}
        for name, leaf in flatten(obj):
            if isinstance(leaf, torch.Tensor):
                self._tensors[name] = leaf
            else:
                self._scalars[name] = leaf

    def names(self) -> list[str]:
        return list(self._tensors)

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        t = self._tensors[name]
        return str(t.dtype).removeprefix("torch."), tuple(t.shape)

    def chunks(self, name: str) -> Iterator[Any]:
        flat = self._tensors[name].reshape(-1)
        for start in range(0, flat.numel(), CHUNK_ELEMS):
            yield flat[start : start + CHUNK_ELEMS]

    def scalars(self) -> dict[str, Any]:
        return self._scalars


class SafetensorsSource(Source):
    format = "safetensors"

    def __init__(self, handle: Any) -> None:
        self._f = handle

    def names(self) -> list[str]:
        return list(self._f.keys())

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        sl = self._f.get_slice(name)
        code = sl.get_dtype()
        if code not in _ST_DTYPES:
            raise AuditInputError(f"tensor {name}: unsupported safetensors dtype {code}")
        return _ST_DTYPES[code], tuple(sl.get_shape())

    def chunks(self, name: str) -> Iterator[Any]:
        _, shape = self.meta(name)
        if len(shape) == 0:
            yield self._f.get_tensor(name).reshape(-1)
            return
        # Slice along dim 0 so only a block of rows is ever resident, however big the tensor.
        row = math.prod(shape[1:])
        step = max(1, CHUNK_ELEMS // max(row, 1))
        sl = self._f.get_slice(name)
        for start in range(0, shape[0], step):
            yield sl[start : start + step].reshape(-1)


@contextmanager
def open_checkpoint(path: str) -> Iterator[Source]:
    """Open a checkpoint for auditing, by content rather than by extension.

    Raises:
        AuditInputError: unreadable, corrupt or not a checkpoint.
        UnsafeCheckpointError: a torch file that would execute pickled code.
    """
    path = os.fspath(path)
    kind = sniff(path)
    if kind != "safetensors":
        yield TorchSource(load_torch(path, kind))
        return
    safetensors = require("safetensors", "safetensors")
    try:
        handle = safetensors.safe_open(path, framework="pt")
    except Exception as exc:  # SafetensorError is not an OSError; any failure means bad bytes
        raise AuditInputError(f"{path}: corrupt safetensors file ({one_line(exc)[:160]})") from None
    yield SafetensorsSource(handle)
