"""CPU checks of the kernel seam: the reference path, and the custom ops' registration (real and fake).

The Triton kernels themselves run on the GPU (tests/test_kernels_gpu.py) and through Triton's interpreter
(tests/test_kernels_interp.py, tests/test_rollout_kernels.py); their machine code is checked offline in
tests/test_kernels_sass.py. Here the ops must be callable on CPU tensors (they fall back to dequantize + matmul),
differentiate correctly, and report the right shapes under FakeTensorMode so torch.compile can trace them; and the
launch schedules (split-K, routing between the decode kernels) are pure Python.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qerl import nvfp4
from qerl.kernels import backend, nvfp4_forward, nvfp4_linear, ops
from qerl.kernels.epilogue import Epilogue
from qerl.load.linear import NVFP4Linear

torch.set_num_threads(1)


def _weight(n: int, k: int, seed: int) -> nvfp4.NVFP4Tensors:
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize(torch.randn(n, k, generator=g) * 0.02)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_ops_registered() -> None:
    assert hasattr(torch.ops.qerl, "nvfp4_mm") and hasattr(torch.ops.qerl, "nvfp4_mm_t")
    assert not ops.use_triton(torch.zeros(1))  # CPU tensors never take the Triton path


def test_reference_and_op_on_cpu_match_float64() -> None:
    q = _weight(48, 80, 0)
    w = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 80, generator=g)
    bias = torch.randn(48, generator=g)
    u, b = torch.randn(5, 4, generator=g), torch.randn(48, 4, generator=g)
    ref = x.double() @ w.t() + bias.double() + 0.25 * u.double() @ b.double().t()
    y = torch.ops.qerl.nvfp4_mm(x, q.weight_packed, q.weight_scale, q.weight_global_scale, bias, u, b, 0.25)
    assert y.shape == (5, 48) and _rel(y, ref) < 1e-5
    y3 = nvfp4_forward(x.reshape(1, 5, 80), q, epilogue=Epilogue(bias, u.reshape(1, 5, 4), b, 0.25))
    assert y3.shape == (1, 5, 48) and _rel(y3.reshape(5, 48), ref) < 1e-5
    gy = torch.randn(5, 48, generator=g)
    gx = torch.ops.qerl.nvfp4_mm_t(gy, q.weight_packed, q.weight_scale, q.weight_global_scale)
    assert _rel(gx, gy.double() @ w) < 1e-5


def test_op_autograd_matches_dense() -> None:
    q = _weight(32, 64, 2)
    w = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g, requires_grad=True)
    bias = torch.randn(32, generator=g, requires_grad=True)
    u = torch.randn(6, 8, generator=g, requires_grad=True)
    b = torch.randn(32, 8, generator=g, requires_grad=True)
    gy = torch.randn(6, 32, generator=g)
    y = nvfp4_forward(x, q, epilogue=Epilogue(bias, u, b, 0.5))
    grads = torch.autograd.grad(y, (x, bias, u, b), gy)
    leaves = [t.detach().clone().requires_grad_() for t in (x, bias, u, b)]
    ref = torch.nn.functional.linear(leaves[0], w, leaves[1]) + 0.5 * leaves[2] @ leaves[3].t()
    ref_grads = torch.autograd.grad(ref, leaves, gy)
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) < 1e-5


def test_fake_impls_give_shapes() -> None:
    q = _weight(24, 48, 4)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(7, 48))
        packed, scale, gs = (mode.from_tensor(t) for t in (q.weight_packed, q.weight_scale, q.weight_global_scale))
        y = torch.ops.qerl.nvfp4_mm(x, packed, scale, gs)
        gx = torch.ops.qerl.nvfp4_mm_t(mode.from_tensor(torch.randn(7, 24)), packed, scale, gs)
    assert tuple(y.shape) == (7, 24) and y.dtype == torch.float32
    assert tuple(gx.shape) == (7, 48)


def test_nvfp4linear_cpu_uses_reference() -> None:
    lin = torch.nn.Linear(64, 16, bias=True)
    layer = NVFP4Linear.from_linear(lin)
    x = torch.randn(3, 64)
    want = nvfp4.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float32)
    assert _rel(layer(x), torch.nn.functional.linear(x, want, lin.bias)) < 1e-5
    assert _rel(nvfp4_linear(x, layer.packed_weight), x @ want.t()) < 1e-5


@pytest.mark.skipif(not backend.HAS_TRITON, reason="needs triton")
def test_bad_lora_shapes_raise() -> None:
    from qerl.kernels import fp4_gemm

    q = _weight(16, 32, 5)
    with pytest.raises(ValueError, match="LoRA epilogue"):
        fp4_gemm.matmul(
            torch.zeros(2, 32, dtype=torch.bfloat16),
            q,
            epilogue=Epilogue(lora_u=torch.zeros(3, 4), lora_b=torch.zeros(16, 4)),
        )


def test_decode_split_fills_waves() -> None:
    """The split-K rule (a model of waves x program length) on the H200's 132 SMs: the cases that
    decided it in benchmarks/results/decode_splits.json, and only splits a launch really runs."""
    from qerl.kernels import schedule as sch

    sms4, sms1 = 132 * 4, 132  # M <= 16: 4 programs per SM; M = 64: 1
    # 7B gate_up at M=1: 592 tiles, one slice each, would leave a second wave of 64 programs.
    assert sch.decode_split(592, 14, sms4) == 2
    # 7B o_proj at M=64: one resident program per SM, 2 slices of 7 steps fill one wave (7 slices: 3 waves).
    assert sch.decode_split(56, 14, sms1) == 2
    # 32B down at M=1: 80 tiles x 108 steps -> 6 slices (480 programs in 528 slots), not 5 (3/SM).
    assert sch.decode_split(80, 108, sms4) == 6
    assert sch.decode_split(1, 3, sms4) == 3  # one tile, few steps: every step its own slice
    for tiles in (1, 7, 56, 592, 5000):
        for k_steps in (1, 2, 14, 74, 108, 500):
            split = sch.decode_split(tiles, k_steps, sms4)
            steps = -(-k_steps // split)
            assert 1 <= split <= 64 and -(-k_steps // steps) == split
    cpu = torch.device("cpu")  # counts as 4 SMs
    assert sch.decode_config(1, 4096, 640, cpu).BK == 128  # BK halves until it divides K
    # Slots: SMs x 4 programs at M <= 16, x 1 at M = 64 (BM=64 fills an SM's shared memory). 4 tiles
    # of 14 steps: 16 slots take 4 slices in one wave; at M = 64 the 128-row schedule has 2 tiles on
    # 4 slots: 2 slices of 7 steps fill one wave.
    assert sch.decode_config(1, 256, 3584, cpu).split == sch.decode_split(4, 14, 16) == 4
    assert sch.decode_config(64, 256, 3584, cpu).split == sch.decode_split(2, 14, 4) == 2


def test_decode_schedule_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each padded token count gets its measured schedule (8 warps over 128 rows at BM = 64 / 128, with
    BK = 128 at BM = 128 to fit shared memory); QERL_DECODE_CONFIG overrides every M."""
    from qerl.kernels import schedule as sch

    cpu = torch.device("cpu")
    assert sch.default_decode(1) == sch.default_decode(16) == sch.DecodeConfig()
    assert (sch.default_decode(33).BN, sch.default_decode(64).warps, sch.default_decode(64).BK) == (128, 8, 256)
    assert (sch.default_decode(65).BK, sch.default_decode(128).BN) == (128, 128)
    with pytest.raises(KeyError):
        sch.default_decode(129)  # beyond DECODE_MAX_M the forward dequantizes and calls cuBLAS
    assert sch.decode_config(100, 3584, 18944, cpu).BK == 128
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, decode_config=sch.DecodeConfig(BN=64, BK=128)))
    assert sch.decode_config(100, 3584, 18944, cpu).BN == 64 == sch.default_decode(1).BN


def test_decode_schedule_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """QERL_DECODE_CONFIG picks the decode schedule for whole models (tuning runs); junk is a one-line error."""
    from qerl.kernels import schedule as sch

    monkeypatch.setenv("QERL_DECODE_CONFIG", "BN=64, BK=128,stages=6,resident=5")
    cfg = sch.DecodeConfig.from_env()
    assert (cfg.BN, cfg.BK, cfg.warps, cfg.stages, cfg.resident) == (64, 128, 4, 6, 5)
    monkeypatch.setenv("QERL_DECODE_CONFIG", "")
    assert sch.DecodeConfig.from_env() is None
    for bad in ("BN=64,foo=1", "BK=big", "x_split=0"):
        monkeypatch.setenv("QERL_DECODE_CONFIG", bad)
        with pytest.raises(ValueError, match="QERL_DECODE_CONFIG"):
            sch.DecodeConfig.from_env()


def test_decode_tune_counts_only_accurate_rows() -> None:
    """A tuning candidate whose check failed (NaN, over the error bound, or an exception) cannot win a
    sweep: a TMA candidate once broke the launches after it, which showed only as NaN errors."""
    from benchmarks.decode_tune import MAX_REL_ERR, usable_us

    assert usable_us({"us": 5.0, "rel_err": 1e-3}) == 5.0
    for row in (
        {"us": 5.0, "rel_err": float("nan")},
        {"us": 5.0, "rel_err": MAX_REL_ERR},
        {"error": "x", "rel_err": 0.0},
        {"us": 5.0},
    ):
        assert usable_us(row) == float("inf")


def test_direct_split_table_takes_only_clear_lora_wins() -> None:
    """``decode_tune --direct-splits``' table: per (N, K, M), the fastest accurate LoRA row's split, only where it beat
    the default split by more than the margin; rows without LoRA and inaccurate rows never set it. The launcher made
    from it passes that split where the caller left it to ``decode_split`` and leaves an explicit split alone."""
    from benchmarks.decode_tune import TABLE_MARGIN, split_table, with_split_table

    def row(n: int, m: int, split: int, us: float, lora: bool = True, default: bool = False, err: float = 1e-3) -> dict:
        return {"N": n, "K": 3584, "M": m, "lora": lora, "split": split, "us": us, "default": default, "rel_err": err}

    rows = [
        row(3584, 1, 14, 7.2, default=True),
        row(3584, 1, 7, 6.8),  # a clear win: taken
        row(3584, 8, 14, 8.0, default=True),
        row(3584, 8, 7, 8.0 * (1 - TABLE_MARGIN / 2)),  # within the margin
        row(4608, 1, 7, 7.7, default=True),
        row(4608, 1, 5, 5.0, err=float("nan")),  # a wrong kernel cannot win
        row(37888, 1, 3, 28.8, lora=False, default=True),
        row(37888, 1, 1, 20.0, lora=False),  # no LoRA: not the engine's
    ]
    assert split_table(rows) == {(3584, 3584, 1): 7}

    calls: list[int] = []

    def fake(x: object, weight: object, *, split: int = 0, **kwargs: object) -> None:
        calls.append(split)

    class T:
        def __init__(self, *shape: int) -> None:
            self.shape = shape
            self.out_features = shape[0]

    launch = with_split_table(fake, {(3584, 3584, 1): 7})
    launch(T(1, 3584), T(3584, 1792))  # in the table
    launch(T(8, 3584), T(3584, 1792))  # another M: decode_split's
    launch(T(1, 3584), T(3584, 1792), split=2)  # asked for
    assert calls == [7, 0, 2]


def test_gluon_decode_split_counts() -> None:
    """The Gluon kernel's split-K counts (its own program cost per BM in ``decode_split``) are those that won
    on the H200: one slice for gate_up at M=64 (48.4 us, 2 slices 65.4) and q/k/v at M=128 (17.9 vs 22.7 us),
    four for down at M=64 (30.0 us, 1 slice 57.5) (decode_gluon_splits.json); at BM=16 the fastest split of
    each GEMM ``GLUON_MIN_WEIGHTS`` sends it (docs/kernels.md#gluon-schedule: 7B gate_up one slice, 31.2 us
    against 36.4 for two)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import fp4_gluon
    from qerl.kernels import schedule as sch

    def split(n: int, k: int, bm: int) -> int:
        _, _, resident, program_steps = fp4_gluon.SCHEDULE[bm]
        return sch.decode_split(-(-n // fp4_gluon.BN), k // fp4_gluon.BK, 132 * resident, program_steps)

    assert split(37888, 3584, 64) == 1
    assert split(4608, 3584, 128) == 1
    assert split(3584, 18944, 64) == 4
    measured = {
        (37888, 3584): 1,
        (3584, 18944): 7,
        (7168, 5120): 3,
        (5120, 5120): 4,
        (55296, 5120): 1,
        (5120, 27648): 4,
    }
    assert {nk: split(*nk, 16) for nk in measured} == measured
    assert sch.decode_split(592, 14, 264) == 2  # the Triton kernel's own cost split gate_up in two


def test_balanced_split_only_where_the_busiest_sm_gets_lighter() -> None:
    """``schedule.balanced_split`` on the H200's 132 SMs: one slice more for some tiles where a uniform split leaves
    slots empty and each SM then holds at most one long program (7B down at M=64, 32B down at M=16: both faster on
    the H200, docs/kernels.md#fenced-release / #balanced-split); the uniform split where more long programs than
    SMs would stay (32B down at M=32/64: 35.6 -> 37.1 us balanced), where no slot is free, or a slice is one step."""
    from qerl.kernels import schedule as sch

    assert sch.balanced_split(56, 4, 264, 74, 132) == (4, 40)  # 7B down, BM=64: 16 tiles x 4 + 40 x 5 = 264
    assert sch.balanced_split(80, 4, 396, 108, 132) == (4, 76)  # 32B down, BM=16
    assert sch.balanced_split(80, 3, 264, 108, 132) == (3, 0)  # 32B down, BM=32/64: 56 x 3 long programs
    assert sch.balanced_split(56, 7, 396, 74, 132) == (7, 0)  # 7B down, BM=16: 392 of 396 slots, no gain
    assert sch.balanced_split(600, 1, 264, 14, 132) == (1, 0)  # no slot free
    assert sch.balanced_split(8, 3, 264, 3, 132) == (3, 0)  # slices of one step already
    for tiles, split, k_steps in ((56, 4, 74), (72, 3, 14), (80, 4, 108), (7, 2, 30)):
        base, extra = sch.balanced_split(tiles, split, 264, k_steps, 132)
        assert base == split and 0 <= extra < tiles and (extra == 0 or tiles * base + extra <= 264)


def test_direct_decode_split_counts() -> None:
    """The mma.sync kernel's split-K counts on 132 SMs (its own program cost in ``decode_split``): one 14-step
    ring slice per tile for 7B gate_up (28.3 / 28.6 us at M = 1 / 8 with LoRA, against 28.8 / 30.7 for 3 slices)
    and 32B gate_up, 15 for 7B down, 7 for q/k/v, 14 for o (docs/kernels.md#direct-ring-refill); the Triton kernel's
    program cost would cut 7B gate_up in 3."""
    pytest.importorskip("triton.experimental.gluon")
    from benchmarks.decode_tune import launched_split
    from qerl.kernels import fp4_direct as fd
    from qerl.kernels import schedule as sch

    def split(n: int, k: int, program_steps: int = fd.PROGRAM_STEPS) -> int:
        tiles, k_steps, _ = fd.launch_shape(n, k, torch.device("cpu"))
        return launched_split(k_steps, sch.decode_split(tiles, k_steps, 132 * fd.RESIDENT, program_steps))

    measured = {(37888, 3584): 1, (3584, 18944): 15, (4608, 3584): 7, (3584, 3584): 14, (55296, 5120): 1}
    assert {nk: split(*nk) for nk in measured} == measured
    assert split(37888, 3584, sch.DECODE_PROGRAM_STEPS) == 3


def test_gluon_kernel_routes_by_rows_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which decode kernel ``gluon_kernel`` gives a GEMM: the mma.sync kernel up to 8 rows (but the TMA/wgmma kernel
    where its split-K slices would refill its x ring), the TMA/wgmma kernel above 16, and from 9 to 16 rows only
    for GEMMs of at least ``GLUON_MIN_WEIGHTS`` weights (7B gate_up and down, not its q/k/v or o:
    docs/kernels.md#gluon-min-weights); the rest take the Triton kernel."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import fp4_direct, fp4_gemm, fp4_gluon
    from qerl.kernels import schedule as sch

    asked: list[str] = []
    monkeypatch.setattr(fp4_gluon, "supports", lambda *a: asked.append("tma") or True)
    monkeypatch.setattr(fp4_direct, "supports", lambda *a: asked.append("direct") or True)
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, gluon_decode=True))
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, direct_decode=True))
    monkeypatch.setattr(fp4_direct, "sm_count", lambda device: 132)  # an H200's, for the mma.sync kernel's split

    def route(m: int, n: int, k: int) -> str | None:
        asked.clear()
        taken = fp4_gemm.gluon_kernel(m, n, k, torch.bfloat16, torch.device("cpu"))
        assert taken is None or taken == asked[0]
        return taken

    assert route(8, 37888, 3584) == "direct"
    assert [route(m, 37888, 3584) for m in (9, 12, 16)] == ["tma"] * 3  # 7B gate_up
    assert route(12, 3584, 18944) == "tma"  # 7B down
    assert route(12, 4608, 3584) is None and route(16, 3584, 3584) is None  # 7B q/k/v and o: Triton
    assert route(17, 3584, 3584) == "tma"
    # Up to 8 rows the GEMMs split into slices that would refill the mma.sync kernel's x ring (32B down) go to the
    # TMA/wgmma kernel; no 7B GEMM does, nor 32B gate_up (one slice a tile).
    assert [route(m, 5120, 27648) for m in (1, 4, 8)] == ["tma"] * 3
    assert [route(1, n, k) for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944))] == ["direct"] * 4
    assert [route(8, n, 5120) for n in (7168, 5120, 55296)] == ["direct"] * 3  # 32B q/k/v, o, gate_up
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, direct_decode=False))
    assert route(1, 5120, 27648) is None  # without the mma.sync kernel, few rows stay on the Triton kernel
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, direct_decode=True))
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, direct_ring=True))
    assert route(8, 5120, 27648) == "direct"  # QERL_DECODE_DIRECT_RING=1 keeps them on the mma.sync kernel
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, direct_ring=False))
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, gluon_decode=False))
    assert route(12, 37888, 3584) is None and route(1, 5120, 27648) == "direct"
