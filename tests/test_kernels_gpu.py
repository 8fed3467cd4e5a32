"""GPU correctness of the Triton NVFP4 kernels (skipped without CUDA).

Every check draws fresh random inputs, poisons outputs (NaN) before the run, and compares against a float64
product on the dequantized weight: both ||out - ref|| / ||ref|| and max |out - ref| / max |ref| below 1e-2
(``test_kernels_interp.max_err``). The checks shared with the interpreter twins live in test_kernels_interp.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_kernels_interp import (
    MLP,
    check_backward,
    check_compile,
    check_fused_model,
    check_lora_grads,
    check_train_fused,
    dequantize_ulps,
    max_err,
)

from qerl import nvfp4
from qerl.kernels.epilogue import Epilogue

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: Bound on ``max_err`` against float64 per activation dtype: 2 eps of the dtype (4 of its unit roundoffs u = eps / 2).
#: The FP4 weights decode exactly (an e2m1 code times an e4m3 scale has at most 6 significant bits) and the kernels
#: accumulate in fp32 (K <= 18944: about sqrt(K) * 2^-24, far below u), so a 16-bit output's error is its roundings to
#: the dtype: the output itself (u), the operands rounded before the epilogue's dot or written by the kernel before the
#: GEMM (u: fp32 LoRA u and B, a fused RMSNorm's x), and on the dequantize + cuBLAS path a split-K reduction cuBLAS may
#: round to the dtype (u); one u of room. fp32 (the reference path only) is bound by its accumulation instead.
TOL = {torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps, torch.float16: 2 * torch.finfo(torch.float16).eps}
TOL[torch.float32] = 1e-5
_SEED = [0]


def _gen() -> torch.Generator:
    _SEED[0] += 1
    return torch.Generator(device="cuda").manual_seed(1000 + _SEED[0])


def _weight(n: int, k: int) -> nvfp4.NVFP4Tensors:
    return nvfp4.quantize(torch.randn(n, k, device="cuda", generator=_gen()) * 0.02)


def _w64(q: nvfp4.NVFP4Tensors) -> torch.Tensor:
    return nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float64)


def _rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=_gen()).to(dtype)


def _stacked_epilogue_case(m: int, rank: int, lora_bounds: tuple[int, int]):
    """What the rollout engine hands a stacked q/k/v decode GEMM (N=1000 split at 600/800, K=2048): weight,
    x, bias, a segmented u ``[m * rank]`` and a block-diagonal B (projection j's rows nonzero only in its
    rank columns, split at ``lora_bounds``), and the float64 result; returns (q, x, bias, u, B, bounds, ref)."""
    from qerl.kernels import reference

    n, k, out_bounds = 1000, 2048, (600, 800)
    q = _weight(n, k)
    x, bias = _rand(m, k), _rand(n) * 0.1
    lora_b = torch.zeros(n, rank, device="cuda", dtype=torch.bfloat16)
    rows, ranks = (0, *out_bounds, n), (0, *lora_bounds, rank)
    for j in range(3):
        lora_b[rows[j] : rows[j + 1], ranks[j] : ranks[j + 1]] = (
            _rand(rows[j + 1] - rows[j], ranks[j + 1] - ranks[j]) * 0.1
        )
    u = _rand(m * rank)
    ref = reference.mm(
        x.double(), q, Epilogue(bias.double(), u.double(), lora_b.double(), 1.0, out_bounds, lora_bounds)
    )
    return q, x, Epilogue(bias, u, lora_b, 1.0, out_bounds, lora_bounds), ref


def _poison_allocator() -> None:
    """Fill free cached blocks with NaN so that any output the kernels forget to write shows up."""
    torch.cuda.synchronize()
    blob = torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.float32)
    del blob


def _nan(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def _configs(M: int, N: int, K: int):
    from qerl.kernels import schedule as sch

    yield None  # the heuristic choice
    if M <= sch.DECODE_MAX_M:  # the decode kernel's other schedules: strided x gathers, fixed split
        yield sch.DecodeConfig(BN=64, BK=128, warps=4, stages=3, split=3, x_split=False)
        yield sch.DecodeConfig(BN=256, BK=128, warps=8, stages=3, split=1)


SHAPES = [  # (M, N, K): awkward M, K % 128 != 0, N % 64 != 0
    (1, 200, 1040),
    (3, 4096, 3584),
    (16, 1000, 2064),
    (17, 1000, 2064),
    (64, 264, 512),
    (65, 200, 1040),
    (128, 1000, 2064),  # the largest decode batch: BM=128, eight warps
    (300, 1000, 3584),
    (4095, 520, 1040),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_forward_all_paths(M: int, N: int, K: int, dtype: torch.dtype) -> None:
    from qerl.kernels import fp4_gemm as fg

    for cfg in _configs(M, N, K):
        q = _weight(N, K)
        x, bias = _rand(M, K, dtype=dtype), _rand(N, dtype=dtype)
        ref = x.double() @ _w64(q).t() + bias.double()
        _poison_allocator()
        y = fg.matmul(x, q, epilogue=Epilogue(bias), out=_nan((M, N), dtype), config=cfg)
        assert max_err(y, ref) < TOL[dtype], (cfg, max_err(y, ref))
        # again without bias, through the custom op and its own allocation
        x = _rand(M, K, dtype=dtype)
        _poison_allocator()
        y = torch.ops.qerl.nvfp4_mm(x, q.weight_packed, q.weight_scale, q.weight_global_scale)
        assert max_err(y, x.double() @ _w64(q).t()) < TOL[dtype]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize("M", [1, 16, 32, 40, 64, 100, 128])
@pytest.mark.parametrize("N,K", [(200, 1024), (1000, 3584)])
def test_gluon_decode(M: int, N: int, K: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon decode candidate against float64: split-K (its own ticket reduction), N not a multiple
    of its 64-row tile, x permuted in the call and beforehand; then the Triton kernel, which shares the
    ticket table, is still exact (a candidate once left it inconsistent for the launches after it)."""
    from qerl.kernels import fp4_gemm, fp4_gluon, gluon_layout

    q = _weight(N, K)
    x = _rand(M, K)
    ref = x.double() @ _w64(q).t()
    _poison_allocator()
    for split in (0, 1, 3):
        y = fp4_gluon.matmul(x, q, split=split)
        assert max_err(y, ref) < TOL[torch.bfloat16], (split, max_err(y, ref))
    y = fp4_gluon.matmul(gluon_layout.to_gluon_k(x), q, gluon_k=True)
    assert max_err(y, ref) < TOL[torch.bfloat16]
    assert max_err(fp4_gemm.matmul(x, q), ref) < TOL[torch.bfloat16]
    # The last program sums the vector partials in slice order however many it reads per round trip.
    bm = max(16, 1 << (M - 1).bit_length())
    chunks = {}
    for ch in (1, 2, 4):
        monkeypatch.setitem(fp4_gluon.SPLIT_CHUNK, bm, ch)
        chunks[ch] = fp4_gluon.matmul(x, q, split=5)
    assert (
        torch.equal(chunks[1], chunks[2])
        and torch.equal(chunks[1], chunks[4])
        and max_err(chunks[1], ref) < TOL[torch.bfloat16]
    )
    odd = _weight(N, K + 16)  # K not a whole number of 256-code steps
    with pytest.raises(ValueError, match="Gluon decode kernel"):
        fp4_gluon.matmul(_rand(M, K + 16), odd)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize("M", [17, 33, 64, 100, 128])
@pytest.mark.parametrize("r,lora_bounds", [(16, (6, 11)), (80, (30, 55))])
def test_gluon_decode_epilogue(M: int, r: int, lora_bounds: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon candidate behind ``fp4_gemm.matmul`` (``QERL_DECODE_GLUON``, M above ``GLUON_MIN_M``) with
    what the rollout engine hands the decode GEMMs: bias, the LoRA expand from a segmented u (rank 80:
    two 64-wide wgmma chunks), segmented q/k/v-style outputs, against the float64 reference; an fp16 x
    (unsupported) still takes the Triton kernel."""
    from qerl.kernels import fp4_gemm, fp4_gluon, reference
    from qerl.kernels import schedule as sch

    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, gluon_decode=True))
    calls = []
    monkeypatch.setattr(fp4_gluon, "matmul", lambda *a, _f=fp4_gluon.matmul, **k: calls.append(1) or _f(*a, **k))
    q, x, epilogue, ref = _stacked_epilogue_case(M, r, lora_bounds)
    _poison_allocator()
    y = fp4_gemm.matmul(x, q, epilogue=epilogue)
    assert max_err(y, ref) < TOL[torch.bfloat16]
    bias, u, lora_b = epilogue.bias, epilogue.lora_u.view(M, r), epilogue.lora_b
    y = fp4_gemm.matmul(x, q, epilogue=Epilogue(bias, u, lora_b, 0.5))
    assert (
        max_err(y, reference.mm(x.double(), q, Epilogue(bias.double(), u.double(), lora_b.double(), 0.5)))
        < TOL[torch.bfloat16]
    )
    y = fp4_gemm.matmul(x.half(), q)
    assert max_err(y, x.double() @ _w64(q).t()) < TOL[torch.float16]
    assert len(calls) == 2  # both bf16 calls took the Gluon kernel


@pytest.mark.parametrize("M", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("N,K", [(3584, 18944), (5120, 5120)])
def test_split_k_decode_is_repeatable_on_real_shapes(M: int, N: int, K: int) -> None:
    """The decode GEMMs the engine runs (Qwen2.5-7B down, 32B o: split-K over most of the SMs, the partials
    summed by the tile's last ticket), 20 calls with and without the LoRA epilogue: every output bitwise equal to the
    first and that one within the bf16 TOL of float64. A race shows up here as calls that differ: with the K loop's weight slot
    released to the TMA without a proxy fence, the balanced split got some tiles wrong at 7B down M=64 in 19 of 19
    calls (rel. error up to 3.9e-2, docs/kernels.md#fenced-release) while passing every smaller-shape test."""
    from qerl.kernels import fp4_gemm, reference

    q = _weight(N, K)
    x, u, lora_b = _rand(M, K), _rand(M, 16), _rand(N, 16) * 0.1
    for lora in ((), (None, u, lora_b, 0.5)):
        ref = reference.mm(x.double(), q, Epilogue(*(a.double() if torch.is_tensor(a) else a for a in lora)))
        first = fp4_gemm.matmul(x, q, epilogue=Epilogue(*lora))
        assert max_err(first, ref) < TOL[torch.bfloat16]
        differ = sum(not torch.equal(fp4_gemm.matmul(x, q, epilogue=Epilogue(*lora)), first) for _ in range(19))
        assert differ == 0, f"{differ} of 19 repeated calls differ from the first (lora={bool(lora)})"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize("M", [1, 8, 16, 64, 128])
def test_pdl_decode_chain_matches_serial(M: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step's kernels under programmatic dependent launch (``qerl/kernels/pdl.py``): a chain where each
    GEMM reads the RMSNorm just before it (which triggers it early) and each RMSNorm the GEMM before it, with a LoRA
    epilogue reading the shrink's u, eager and replayed from a CUDA graph, bitwise equal to the same chain launched
    without PDL, and that within the bf16 TOL of float64. Reading x, u or the tickets before the wait, or storing before it,
    would let a GEMM see the previous call's values: the outputs of the chain's links then differ."""
    from qerl.kernels import fp4_gemm, fused_step, reference, schedule

    # From 9 to GLUON_MIN_M rows the TMA/wgmma kernel takes only GEMMs of at least GLUON_MIN_WEIGHTS weights.
    n = k = 4608 if schedule.DIRECT_MAX_M < M <= schedule.GLUON_MIN_M else 1024
    qs = [_weight(n, k) for _ in range(4)]
    lora_a, lora_b = _rand(16, k) * 0.05, _rand(n, 16) * 0.05
    norm_w = torch.rand(k, device="cuda", generator=_gen()).to(torch.bfloat16) + 0.5
    h0 = _rand(M, k)
    takes = fp4_gemm.gluon_kernel(M, n, k, torch.bfloat16, h0.device) is not None
    assert takes, f"M={M}, N=K={n}: expected a Gluon decode kernel, the ones launched with PDL"

    def chain() -> list[torch.Tensor]:
        h, outs = h0, []
        for q in qs:
            _, x, u = fused_step.rms_norm_shrink(h, None, norm_w, 1e-6, lora_a, (16, 16), gluon_k=takes)
            h = fp4_gemm.matmul(x, q, epilogue=Epilogue(None, u.view(M, 16), lora_b), gluon_k=takes, pdl=True)
            outs.append(h)
        return outs

    runs = {}
    for on in (False, True):
        monkeypatch.setattr(schedule, "SWITCHES", replace(schedule.SWITCHES, decode_pdl=on))
        eager = [y.clone() for y in chain()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            chain()
            with torch.cuda.graph(graph, stream=stream):
                outs = chain()
        torch.cuda.current_stream().wait_stream(stream)
        replays = []
        for _ in range(3):
            graph.replay()
            replays.append([y.clone() for y in outs])
        torch.cuda.synchronize()
        runs[on] = [eager, *replays]
    serial = runs[False][0]
    for got in runs[False] + runs[True]:
        assert all(torch.equal(a, b) for a, b in zip(got, serial, strict=True))
    h = h0.double()
    for q, y in zip(qs, serial, strict=True):
        x = reference.rms_norm(h, None, norm_w.double(), 1e-6)
        h = x @ _w64(q).t() + (x @ lora_a.double().t()) @ lora_b.double().t()
        assert max_err(y, h) < TOL[torch.bfloat16]
        h = y.double()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N,K", [(200, 1024), (1000, 3584), (72, 256), (130, 256 * 17)])
def test_direct_decode(M: int, N: int, K: int) -> None:
    """The mma.sync kernel against float64: x in the Gluon K order, split-K (auto, one slice, three),
    N not a multiple of its 64-row tile, one K step, slices longer than the x ring (17 steps in one slice:
    fills of 7, 7 and 3); then the Triton kernel (sharing the ticket table) is still exact; M > 8 and K off
    the 256-code steps are refused."""
    from qerl.kernels import fp4_direct, fp4_gemm, gluon_layout

    q = _weight(N, K)
    x = _rand(M, K)
    ref = x.double() @ _w64(q).t()
    xp = gluon_layout.to_gluon_k(x)
    _poison_allocator()
    for split in (0, 1, 3):  # one slice refills the x ring past MAX_STEPS steps; 3 leaves the last slice short
        y = fp4_direct.matmul(xp, q, split=split)
        assert max_err(y, ref) < TOL[torch.bfloat16], (split, max_err(y, ref))
    assert max_err(fp4_gemm.matmul(x, q), ref) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="direct decode kernel"):
        fp4_direct.matmul(_rand(9, K), q)
    odd = _weight(N, K + 16)
    with pytest.raises(ValueError, match="direct decode kernel"):
        fp4_direct.matmul(_rand(M, K + 16), odd)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize("M", [1, 5, 8])
@pytest.mark.parametrize("r,lora_bounds", [(16, (6, 11)), (48, (16, 32))])
def test_direct_decode_epilogue(M: int, r: int, lora_bounds: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """``fp4_gemm.matmul(gluon_k=True)`` at M <= ``DIRECT_MAX_M`` takes the mma.sync kernel with what the
    rollout engine hands it (bias, the LoRA expand from a segmented u, segmented outputs) against the float64
    reference, as the Triton kernel does on the same x in natural order, and as the TMA/wgmma kernel does where the
    mma.sync kernel's slices would refill its x ring (``fp4_direct.refills``, forced here); at M = 9 an x in that
    order is refused."""
    from qerl.kernels import fp4_direct, fp4_gemm, fp4_gluon, gluon_layout
    from qerl.kernels import schedule as sch

    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, direct_decode=True))
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, gluon_decode=True))
    calls = []
    monkeypatch.setattr(
        fp4_direct, "matmul", lambda *a, _f=fp4_direct.matmul, **k: calls.append("direct") or _f(*a, **k)
    )
    monkeypatch.setattr(fp4_gluon, "matmul", lambda *a, _f=fp4_gluon.matmul, **k: calls.append("tma") or _f(*a, **k))
    q, x, epilogue, ref = _stacked_epilogue_case(M, r, lora_bounds)
    _poison_allocator()
    y = fp4_gemm.matmul(gluon_layout.to_gluon_k(x), q, epilogue=epilogue, gluon_k=True)
    assert calls == ["direct"]
    assert max_err(y, ref) < TOL[torch.bfloat16]
    assert max_err(fp4_gemm.matmul(x, q, epilogue=epilogue), ref) < TOL[torch.bfloat16]
    assert calls == ["direct"]  # natural order: the Triton kernel
    monkeypatch.setattr(fp4_direct, "refills", lambda *a: True)
    y = fp4_gemm.matmul(gluon_layout.to_gluon_k(x), q, epilogue=epilogue, gluon_k=True)
    assert calls == ["direct", "tma"] and max_err(y, ref) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="gluon_k"):
        fp4_gemm.matmul(_rand(9, x.shape[1]), q, gluon_k=True)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("r,lora_bounds", [(16, (6, 11)), (48, (16, 32)), (80, (40, 60))])
def test_direct_decode_lora_split(M: int, r: int, lora_bounds: tuple[int, int]) -> None:
    """The mma.sync kernel's LoRA expand (rank chunks on the tile's last K slice, before its K loop) against float64
    at split counts from one slice (the expand and the whole K loop in one program) to one K step a slice, with
    ranks of one, three and five 16-rank chunks."""
    from qerl.kernels import fp4_direct, gluon_layout

    q, x, epilogue, ref = _stacked_epilogue_case(M, r, lora_bounds)
    xp = gluon_layout.to_gluon_k(x)
    _poison_allocator()
    for split in (1, 2, 3, 5, 8):
        y = fp4_direct.matmul(xp, q, epilogue=epilogue, split=split)
        assert max_err(y, ref) < TOL[torch.bfloat16], (split, max_err(y, ref))


@pytest.mark.parametrize("M", [1, 16, 33, 64, 100, 128, 200])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_lora_epilogue(M: int, rank: int) -> None:
    from qerl.kernels import nvfp4_forward

    N, K = 1000, 2048
    q = _weight(N, K)
    x = _rand(M, K)
    u = _rand(M, rank, dtype=torch.float32)
    b = _rand(N, rank, dtype=torch.float32) * 0.1
    ref = x.double() @ _w64(q).t() + 0.5 * u.double() @ b.double().t()
    _poison_allocator()
    y = nvfp4_forward(x, q, epilogue=Epilogue(None, u, b, 0.5))
    assert max_err(y, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_kernel(dtype: torch.dtype) -> None:
    _poison_allocator()
    check_backward("cuda", dtype, [(M, N, K) for M, N, K in SHAPES], TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_kernel(dtype: torch.dtype) -> None:
    """The dequantize kernel against ``nvfp4.dequantize`` element by element: at most one unit of the output dtype's
    last place. Not bitwise by construction: the kernel's fp32 ``scale / global_scale`` compiles to
    ``div.full.f32`` (within 2 ulp of the IEEE quotient that torch computes), which can move a rounding boundary;
    the interpreter twin (IEEE division) is bitwise equal."""
    _poison_allocator()
    for n, k in ((520, 1040), (3584, 2048)):
        assert dequantize_ulps("cuda", dtype, n, k) <= 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 17, 300])
def test_autograd_matches_dense(M: int, dtype: torch.dtype) -> None:
    from qerl.load.linear import NVFP4Linear

    layer = NVFP4Linear.from_linear(torch.nn.Linear(1040, 200, bias=True).cuda())
    layer.bias.data = layer.bias.data.to(dtype)
    layer.bias.requires_grad_(True)
    w = layer.dequantized_weight(dtype)
    x = _rand(2, M, 1040, dtype=dtype).requires_grad_(True)
    gy = _rand(2, M, 200, dtype=dtype)
    y = layer(x)
    gx, gb = torch.autograd.grad(y, (x, layer.bias), gy)
    x2 = x.detach().double().requires_grad_(True)
    b2 = layer.bias.detach().double().requires_grad_(True)
    y2 = torch.nn.functional.linear(x2, w.double(), b2)
    gx2, gb2 = torch.autograd.grad(y2, (x2, b2), gy.double())
    assert max_err(y, y2) < TOL[dtype] and max_err(gx, gx2) < TOL[dtype] and max_err(gb, gb2) < TOL[dtype]


def test_peft_lora_grads_match_dense_model() -> None:
    check_lora_grads(
        "cuda", torch.bfloat16, vocab_size=512, hidden_size=256, intermediate_size=688, max_position_embeddings=128
    )


def test_torch_compile_fullgraph() -> None:
    check_compile("cuda", torch.bfloat16, (1, 5, 300), TOL[torch.bfloat16])


def test_cuda_graph_decode_step() -> None:
    model = MLP("cuda", torch.bfloat16)
    static_x = _rand(4, 512)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            model(static_x)  # compile + allocate split-K tickets outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    for _ in range(3):
        static_x.copy_(_rand(4, 512))
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert max_err(static_y, model.reference(static_x)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_train_fused_norm_and_swiglu(dtype: torch.dtype) -> None:
    """The training pass's fused RMSNorm and SwiGLU, forward and backward, against float64 (interpreted twin:
    test_kernels_interp.check_train_fused), within two of the dtype's eps."""
    check_train_fused("cuda", dtype, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_layers_give_the_model_transformers_gives(dtype: torch.dtype) -> None:
    """A tiny Qwen2 + LoRA + trained norms with its norms and MLPs on the fused kernels against transformers' ops:
    logits and gradients within 4 eps of the dtype (bound to calibrate; the interpreter's fp16 run is bitwise)."""
    check_fused_model("cuda", dtype, 2 * TOL[dtype])
