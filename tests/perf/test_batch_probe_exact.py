"""BatchProbe's fused fingerprints and NaN rows equal the per-tensor definition, bit for bit."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nanguard.watch.batch import BatchProbe, _combine, batch_tensors
from nanguard.watch.fingerprint import sample_fingerprints
from nanguard.watch.packet import Packet, host_values
from nanguard.watch.stats import StepStats


def _reference(batch: Any) -> torch.Tensor:
    """What observe + collect gave when each tensor was fingerprinted, combined and checked
    with `torch.isfinite` on its own."""
    tensors = [t for t in batch_tensors(batch) if t.dim() > 0]
    size = tensors[0].shape[0]
    tensors = [t for t in tensors if t.shape[0] == size]
    h = torch.zeros(size, dtype=torch.float64)
    bad = torch.zeros(size, dtype=torch.bool)
    flags = []
    for t in tensors:
        h = _combine(h, sample_fingerprints(t))
        if t.is_floating_point() or t.is_complex():
            rows = (~torch.isfinite(t)).reshape(size, -1).any(dim=1)
            bad |= rows
            flags.append(rows.any())
        else:
            flags.append(torch.zeros((), dtype=torch.bool))
    return torch.cat([h, bad.double(), torch.stack(flags).double()])


def _batches() -> list[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 5, 3, generator=g)
    x[3, 1, 2] = math.nan
    x[7, 0, 0] = -math.inf
    big = torch.full((16, 4), 3e38)  # finite rows whose sum overflows: not a NaN row
    y = torch.randint(0, 9, (16,), generator=g)
    z = torch.randn(16, 2, dtype=torch.complex64, generator=g)
    z[5, 1] = complex(math.inf, 0)
    half = torch.randn(16, 3, generator=g).half()
    half[9, 2] = math.inf
    return [
        (x, y),
        (torch.randn(8, 20, generator=g), torch.randn(8, 1, generator=g)),
        {"x": x, "mask": torch.rand(16, 4, generator=g) > 0.5, "big": big},
        [z, half, x.double(), y.int(), torch.randn(16, generator=g).bfloat16()],
        (y, y.short(), y.to(torch.uint8)),  # integers only: no row can be NaN
        (x, torch.tensor(1.0), torch.randn(3, 2)),  # 0-dim and other sizes are left out
        x.transpose(1, 2),  # not contiguous
        torch.randn(4, 3, requires_grad=True),
    ]


def test_observe_collect_equal_reference() -> None:
    for batch in _batches():
        probe = BatchProbe()
        probe.observe(batch)
        size, packet = probe.collect()
        ref = _reference(batch)
        assert packet is not None and packet.dtype == torch.float64
        assert torch.equal(packet, ref), batch
        stats = StepStats(step=0)
        BatchProbe.decode(packet.tolist(), size, stats)
        assert stats.batch_tensors == len(ref) - 2 * size
        assert stats.sample_hashes == [int(v) for v in ref[:size].tolist()]
        assert stats.nonfinite_samples == ref[size : 2 * size].nonzero().flatten().tolist()
        flags = ref[2 * size :].nonzero().flatten().tolist()
        assert stats.nonfinite_tensors == flags


def test_micro_batches_and_dropped_rows() -> None:
    a, b = _batches()[0], (_batches()[0][0][:5], _batches()[0][1][:5])
    probe = BatchProbe()
    probe.observe(a)
    probe.observe(b)  # gradient accumulation: samples numbered across micro-batches
    size, packet = probe.collect()
    ra, rb = _reference(a), _reference(b)
    assert size == 21 and packet is not None
    assert packet[:16].equal(ra[:16]) and packet[16:21].equal(rb[:5])
    assert packet[21:42].equal(torch.cat([ra[16:32], rb[5:10]]))
    assert packet[42:].equal(torch.maximum(ra[32:], rb[10:]))
    probe.observe(a, accumulate=False)
    probe.observe(b, accumulate=False)  # a step the GradScaler skipped: a's NaN rows kept
    assert probe.dropped == [3, 7] and probe.skipped == [a]


def test_packet_path_decodes_to_the_reference() -> None:
    """The step's packet carries fingerprints and one float64 row sum per tensor: the NaN rows
    and tensors read from it are what the per-tensor definition gives, a finite row whose sum
    overflows (`big` as float64) is none, and float64 data is confirmed element by element."""
    batches = _batches()
    huge = torch.full((16, 4), 1e308, dtype=torch.float64)  # finite; its row sums overflow
    huge[2, 1] = math.nan
    batches.append((huge, -huge))
    cases = [[b] for b in batches] + [[batches[0], (batches[0][0][:5], batches[0][1][:5])]]
    for micro in cases:
        probe, exact_probe = BatchProbe(), BatchProbe()
        for b in micro:
            probe.observe(b)
            exact_probe.observe(b)
        taken = probe.take()
        size, vector = exact_probe.collect()
        assert vector is not None and taken.size == size
        want = StepStats(step=0)
        BatchProbe.decode(vector.tolist(), size, want)
        packet = Packet(torch.device("cpu"))
        taken.add_to(packet)
        got = StepStats(step=0)
        BatchProbe.decode_taken(packet.read(host_values), taken, got)  # as the guard reads
        assert got.sample_hashes == want.sample_hashes
        assert got.nonfinite_samples == want.nonfinite_samples, micro
        assert got.nonfinite_tensors == want.nonfinite_tensors
        assert got.batch_tensors == want.batch_tensors
        if micro[0] is batches[-1]:  # `huge`: overflowing rows are no NaN rows; the NaN row is one
            assert got.nonfinite_samples == [2] and got.nonfinite_tensors == [0, 1]


def test_host_and_device_combination_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small CPU micro-batch's fingerprints are combined on the host, a large one's on the
    device; a step holding both (the last micro-batch of an epoch is smaller) and a packet off
    the CPU give the same fingerprints as the reference."""
    import nanguard.watch.batch as batch_mod

    monkeypatch.setattr(batch_mod, "_HOST_COMBINE_MAX", 8)  # 16 samples: device; 5: host
    a = _batches()[0]
    b = (a[0][:5], a[1][:5])
    want = [int(v) for v in torch.cat([_reference(a)[:16], _reference(b)[:5]]).tolist()]
    for micro in ([a, b], [b, b]):
        probe = BatchProbe()
        for m in micro:
            probe.observe(m)
        taken = probe.take()
        assert (taken.hashes is None) == (micro[0] is b)  # both small: left to the host
        packet = Packet(torch.device("cpu"))
        taken.add_to(packet)
        got = StepStats(step=0)
        BatchProbe.decode_taken(packet.read(host_values), taken, got)
        expected = want if micro[0] is a else want[16:] * 2
        assert got.sample_hashes == expected
        assert got.nonfinite_samples == ([3, 7, 19] if micro[0] is a else [3, 8])


def test_fingerprint_is_the_modular_weighted_sum() -> None:
    """`sample_sums` (one integer `torch.mv` on the CPU) equals its definition computed another
    way: exact int64 products summed, reduced modulo 2**32 (signed) for elements of up to 4
    bytes; for 8-byte elements the int64 products' wrapping sum."""
    from nanguard.watch.fingerprint import sample_sums, weights

    g = torch.Generator().manual_seed(1)
    cases = [torch.randn(16, 5, 3, generator=g), torch.randn(16, 3, generator=g).half(),
             torch.randint(0, 255, (16, 7), dtype=torch.uint8, generator=g),
             torch.rand(16, 4, generator=g) > 0.5,
             torch.randn(16, 2, dtype=torch.complex64, generator=g),
             torch.randn(16, 150_000, generator=g),  # an image-sized row: no temporary
             torch.randint(-2**62, 2**62, (16, 9), generator=g), torch.randn(16, 4).double()]
    views = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    for t in cases:
        got = sample_sums(t)
        u = t.to(torch.uint8) if t.dtype == torch.bool else t
        u = torch.view_as_real(u) if u.is_complex() else u
        size = u.element_size()
        bits = u.contiguous().view(views[size]).reshape(16, -1).to(torch.int64)
        w = (torch.arange(bits.shape[1], dtype=torch.int64) * 2654435761 + 97531) | 1
        if size <= 4:
            w = w & 0x7FFFFFFF
            want = (bits * w).sum(dim=1) % (1 << 32)  # int64 wrapping keeps it modulo 2**32
            want = torch.where(want >= 1 << 31, want - (1 << 32), want)
        else:
            want = (bits * w).sum(dim=1)  # int64 wrapping, the definition's modulus
        assert torch.equal(got.to(torch.int64), want), t.dtype
        assert weights(bits.shape[1], t.device, got.dtype).dtype == got.dtype


def test_run_db_fingerprints_combined_on_the_writer_thread(tmp_path: Any) -> None:
    """A CPU step's fingerprints are left as per-tensor sums on the training thread and
    combined by the run store's writer: run.db's `batches` rows (quiet steps queued, a NaN-row
    step written at once, two micro-batches in one step) hold what the per-tensor definition
    gives, and a step's `sample_hashes` read on the training thread agrees."""
    import json

    from torch import nn

    from nanguard import Guard
    from nanguard.record.store import open_run

    torch.manual_seed(0)
    model = nn.Linear(5 * 3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(model, opt, out=tmp_path)
    g = torch.Generator().manual_seed(2)
    steps: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for k in range(6):
        x, y = torch.randn(12, 5, 3, generator=g), torch.randn(12, 1, generator=g)
        if k == 5:
            x[4, 0, 1] = math.nan  # a NaN row: this step is committed at once
        micro = [(x, y)] if k != 4 else [(x[:7], y[:7]), (x[7:], y[7:])]
        steps.append(micro)
        opt.zero_grad()
        for i, (bx, by) in enumerate(micro):
            loss = nn.functional.mse_loss(model(bx.flatten(1)), by)
            if i == 0:
                guard.watch(loss=loss, batch=(bx, by))
            else:
                guard.watch_micro_batch((bx, by))
            loss.backward()
        opt.step()
    quiet = guard.history[-2]  # step 4, its two micro-batches
    assert quiet.step == 4 and isinstance(quiet.raw_hashes(), tuple)  # not combined here
    want4 = [int(v) for b in steps[4] for v in _reference(b)[:len(b[0])].tolist()]
    guard.close()
    db = open_run(tmp_path)
    try:
        rows = db.execute("SELECT step, samples, nonfinite_samples FROM batches ORDER BY step"
                          ).fetchall()
    finally:
        db.close()
    assert [r[0] for r in rows] == list(range(6))
    for (_, samples, bad), micro in zip(rows, steps, strict=True):
        want = [int(v) for b in micro for v in _reference(b)[:len(b[0])].tolist()]
        assert json.loads(samples) == want
        assert json.loads(bad) == ([4] if micro is steps[5] else [])
    assert quiet.sample_hashes == want4  # combined when read


def test_host_path_equals_the_definition_over_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small CPU batch is measured on the host (`_host_micro`: sums read later, one total per
    floating-point tensor); the same batch through the device path (`_HOST_COMBINE_MAX` 0) and
    the per-tensor definition (`_reference`) give the same fingerprints, NaN rows and tensors:
    every dtype, 1-D to 4-D, not contiguous, requiring grad, rows whose sums overflow (finite:
    no NaN row) and a total that overflows while no row sum does."""
    import nanguard.watch.batch as batch_mod

    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 3, 2, 2, generator=g)
    x[2, 1, 0, 1] = math.nan
    wide = torch.full((16, 2), 1.5e38)  # each row's sum is finite; the total overflows
    over = torch.full((16, 4), 3e38)  # every row's sum overflows: finite, no NaN row
    over[11, 0] = math.inf
    h = torch.randn(16, 5, generator=g).half()
    h[4, 0] = math.nan
    b = torch.randn(16, 6, generator=g).bfloat16()
    b[9, 5] = -math.inf
    d = torch.randn(16, 3, generator=g).double()
    d[0, 2] = math.nan
    z = torch.randn(16, 2, dtype=torch.complex64, generator=g)
    z[13, 0] = complex(0, math.nan)
    ints = torch.randint(-2**40, 2**40, (16, 3), generator=g)
    cases = [
        (x, wide, over), (h, b, d), (z, ints), (x.permute(0, 3, 2, 1), h.t().contiguous().t()),
        (torch.randint(0, 255, (16, 4, 3), dtype=torch.uint8, generator=g),
         torch.rand(16, 7, generator=g) > 0.5, torch.randint(0, 5, (16,), generator=g)),
        (torch.randn(16, 4, generator=g, requires_grad=True), x[:, 0, 0, 0]),
    ]
    for batch in cases:
        size = 16
        ref = _reference(batch)
        got = {}
        for host in (True, False):
            monkeypatch.setattr(batch_mod, "_HOST_COMBINE_MAX", 256 if host else 0)
            probe = BatchProbe()
            probe.observe(batch)
            taken = probe.take()
            assert taken.host == host
            packet = Packet(torch.device("cpu"))
            taken.add_to(packet)
            stats = StepStats(step=0)
            BatchProbe.decode_taken(packet.read(host_values), taken, stats)
            got[host] = stats
            assert stats.sample_hashes == [int(v) for v in ref[:size].tolist()], batch
            assert stats.nonfinite_samples == ref[size : 2 * size].nonzero().flatten().tolist()
            assert stats.nonfinite_tensors == ref[2 * size :].nonzero().flatten().tolist()
            assert stats.batch_tensors == len(ref) - 2 * size
        assert isinstance(got[True].raw_hashes(), list)  # read above, on this thread
    assert _reference(cases[0])[16:32].nonzero().flatten().tolist() == [2, 11]


def test_host_and_device_micro_batches_in_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient accumulation whose micro-batches straddle `_HOST_COMBINE_MAX`: the host one is
    carried as the device one is (`_Micro.to_device`); NaN rows keep their place."""
    import nanguard.watch.batch as batch_mod

    monkeypatch.setattr(batch_mod, "_HOST_COMBINE_MAX", 8)
    a = _batches()[0]  # 16 samples, NaN rows 3 and 7: the device path
    b = (a[0][:5].clone(), a[1][:5])
    b[0][1, 0, 0] = math.inf  # 5 samples: the host path
    for micro in ([a, b], [b, a]):
        probe = BatchProbe()
        for m in micro:
            probe.observe(m)
        taken = probe.take()
        assert not taken.host and taken.hashes is not None
        packet = Packet(torch.device("cpu"))
        taken.add_to(packet)
        got = StepStats(step=0)
        BatchProbe.decode_taken(packet.read(host_values), taken, got)
        want = [int(v) for m in micro for v in _reference(m)[:len(m[0])].tolist()]
        assert got.sample_hashes == want
        assert got.nonfinite_samples == ([3, 7, 16 + 1, 16 + 3] if micro[0] is a
                                         else [1, 3, 5 + 3, 5 + 7])
        assert got.nonfinite_tensors == [0]
