"""Offline checks of the FP4 decode kernels' machine code, on any machine: the inline PTX of the nibble and scale
decodes (run by a small integer-PTX interpreter over every bit pattern), the Gluon K order, and the sm_90 SASS that
Triton's bundled ptxas makes of the two Gluon decode kernels (their structure, register spills, the PDL order), plus
the argument binding of their launchers.
"""

from __future__ import annotations

import pytest
import torch

from qerl import nvfp4

torch.set_num_threads(1)


def _halves(word: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit halves of uint32 ``word`` (int64) as ``dtype`` values."""
    return tuple(((word >> s) & 0xFFFF).to(torch.int16).view(dtype) for s in (0, 16))


def _u16(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit float tensor's bit patterns as non-negative int64."""
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def _bits(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two 16-bit float tensors -> the uint32 (int64) words holding them, ``lo`` in the low half."""
    return _u16(lo) | (_u16(hi) << 16)


def _e4m3x2_to_f16x2(a: torch.Tensor) -> torch.Tensor:
    """``cvt.rn.f16x2.e4m3x2``: the two e4m3 bytes of a 16-bit register -> f16 halves (low byte -> low half)."""
    lo, hi = (((a >> s) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16) for s in (0, 8))
    return _bits(lo, hi)


def _mul_bf16x2(a: torch.Tensor, b: torch.Tensor | int) -> torch.Tensor:
    """``mul.rn.bf16x2``: each bf16 half multiplied, rounded to nearest even."""
    b = torch.full_like(a, b) if isinstance(b, int) else b
    (a0, a1), (b0, b1) = _halves(a, torch.bfloat16), _halves(b, torch.bfloat16)
    return _bits((a0.double() * b0.double()).to(torch.bfloat16), (a1.double() * b1.double()).to(torch.bfloat16))


def _run_ptx(asm: str, word: torch.Tensor, src: str = "$1") -> dict[str, torch.Tensor]:
    """A small interpreter for the integer PTX the decode snippets use, on uint32 words held in int64 (the input
    register ``src``); returns the registers it wrote. ``mov.b32 {lo, hi}, r`` splits r into its 16-bit halves."""
    regs, m32 = {src: word}, 0xFFFFFFFF
    ops = {
        "mov.b32": lambda a: a,
        "shl.b32": lambda a, b: (a << b) & m32,
        "shr.u32": lambda a, b: a >> b,
        "and.b32": lambda a, b: a & b,
        "or.b32": lambda a, b: a | b,
        "mul.lo.u32": lambda a, b: (a * b) & m32,
        "shr.b32": lambda a, b: a >> b,
        "cvt.rn.f16x2.e4m3x2": _e4m3x2_to_f16x2,
        "mul.rn.bf16x2": _mul_bf16x2,
    }
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if rest.startswith("{"):  # mov.b32 {lo, hi}, r
            halves, value = rest[1:].split("}")
            lo, hi = (t.strip() for t in halves.split(","))
            value = regs[value.strip(" ,")]
            regs[lo], regs[hi] = value & 0xFFFF, value >> 16
            continue
        dst, *srcs = (t.strip() for t in rest.split(","))
        regs[dst] = ops[op](*(regs[t] if t in regs else int(t, 0) for t in srcs))
    return regs


def _code_table(fp16: bool) -> torch.Tensor:
    """The 16-bit pattern of each fp4 code's value times the decode's bias (2^-126 bf16, 2^-14 fp16)."""
    dtype, bias = (torch.float16, 2.0**-14) if fp16 else (torch.bfloat16, 2.0**-126)
    codes = torch.tensor(nvfp4.E2M1_VALUES + tuple(-v for v in nvfp4.E2M1_VALUES), dtype=torch.float64)
    return _u16((codes * bias).to(dtype))


def _every_word() -> torch.Tensor:
    """Words whose halves take all 65,536 patterns each, the other half shuffled."""
    g = torch.Generator().manual_seed(0)
    lo = torch.arange(65536, dtype=torch.int64)
    hi = torch.randperm(65536, generator=g).to(torch.int64)
    return torch.cat([lo | (hi << 16), hi | (lo << 16)])


@pytest.mark.parametrize("fp16", [False, True])
def test_nibble_asm_decodes_every_code(fp16: bool) -> None:
    """The decode kernels' inline PTX (``fp4_base.nibble_asm``, run here by a small interpreter) turns nibble
    ``i`` of both 16-bit halves of every word into ``e2m1 * 2^-126`` (bf16) / ``2^-14`` (fp16) bits: all 65,536
    patterns of each half, the other half shuffled, against the fp4 code table."""
    from qerl.kernels import fp4_base

    word, table = _every_word(), _code_table(fp16)
    for i in range(4):
        got = _run_ptx(fp4_base.nibble_asm(i, fp16), word)["$0"]
        for half in (0, 16):
            code = (word >> (half + 4 * i)) & 0xF
            assert torch.equal((got >> half) & 0xFFFF, table[code]), (i, half)


def test_word_nibble_asm_decodes_every_code() -> None:
    """``fp4_direct``'s decode of an int32 word of two int16 elements (``mma_decode.WORD_NIBBLE_ASM``: ``fp4_base.nibble_asm``'s bits,
    its bf16 pair handed back as two halves) gives element 0's code ``i`` in ``$0`` and element 1's in ``$1``."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import mma_decode

    word, table = _every_word(), _code_table(False)
    for i in range(4):
        regs = _run_ptx(mma_decode.WORD_NIBBLE_ASM[i], word, src="$2")
        for out, half in (("$0", 0), ("$1", 16)):
            assert torch.equal(regs[out], table[(word >> (half + 4 * i)) & 0xF]), (i, out)


def test_scale_pair_asm_converts_every_scale() -> None:
    """``fp4_direct``'s scale conversion (``mma_decode.SCALE_PAIR_ASM``, run by the interpreter above) turns every pair of
    non-negative e4m3 scale bytes (subnormals and zero included; NaN is no scale) into the bf16 bits of the
    scale times 2^118, exactly, low byte in ``$0``; a negative zero byte gives zero."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import mma_decode

    byte = torch.arange(0x7F, dtype=torch.int64)  # 0x00 .. 0x7E
    lo, hi = byte.repeat(len(byte)), byte.repeat_interleave(len(byte))
    regs = _run_ptx(str(mma_decode.SCALE_PAIR_ASM.value), torch.cat([lo | (hi << 8), torch.tensor([0x8080])]), src="$2")
    value = byte.to(torch.uint8).view(torch.float8_e4m3fn).double() * 2.0**118
    want = _u16(value.to(torch.bfloat16))
    assert torch.equal(value.to(torch.bfloat16).double(), value)  # every scale times 2^118 is exact in bf16
    assert torch.equal(regs["$0"][:-1], want[lo]) and torch.equal(regs["$1"][:-1], want[hi])
    assert regs["$0"][-1] == 0 and regs["$1"][-1] == 0


def test_gluon_k_order() -> None:
    """The Gluon decode kernel's x order: within each 256-element K step, element 4j + i sits at
    i * 64 + j (nibble i of packed int16 element j meets a contiguous x slice); rows keep their steps."""
    from qerl.kernels.gluon_layout import to_gluon_k

    x = torch.arange(2 * 512).view(2, 512)
    y = to_gluon_k(x)
    i, j = torch.arange(4).view(4, 1), torch.arange(64).view(1, 64)
    for row in range(2):
        for step in range(2):
            block = y[row, step * 256 : (step + 1) * 256].view(4, 64)
            assert torch.equal(block, row * 512 + step * 256 + 4 * j + i)


def _gluon_decode_sass(bm: int, epilogue: bool, pdl: bool = False) -> str:
    """The TMA/wgmma decode kernel's sm_90 SASS at ``bm`` tokens (split-K; ``epilogue``: bias and LoRA), compiled on
    any machine by Triton's bundled ptxas at its per-BM register cap."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from qerl.kernels import fp4_gluon as fgl

    def desc(dtype: str, shape: list[int], ty) -> str:
        return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{gl.NVMMASharedLayout.get_default_for(shape, ty)!r}>"

    stages, maxnreg, _, _ = fgl.SCHEDULE[bm]
    kernel = fgl._decode_gluon_kernel
    signature = {
        "x_desc": desc("bf16", [bm, fgl.BK], gl.bfloat16),
        "h_desc": desc("i16", [fgl.BN, fgl.BK // 4], gl.int16),
        "s_desc": desc("fp8e4nv", [fgl.BN, fgl.BK // 16], gl.float8e4nv),
        "g_ptr": "*fp32",
        "y_ptr": "*bf16",
        "part_ptr": "*fp32",
        "ticket_ptr": "*i32",
        "bias_ptr": "*bf16",
        "u_ptr": "*bf16",
        "lb_ptr": "*bf16",
        **dict.fromkeys(["M", "N", "K", "base", "extra", "Y1", "Y2", "S1", "S2", "stride_lb", "R"], "i32"),
        "lora_scale": "fp32",
        **dict.fromkeys(
            ["BM", "BN", "BK", "STAGES", "SPLIT", "CH", "HAS_BIAS", "HAS_LORA", "RC", "FENCED", "PDL", "num_warps"],
            "constexpr",
        ),
    }
    constants = {
        "BM": bm,
        "BN": fgl.BN,
        "BK": fgl.BK,
        "STAGES": stages,
        "SPLIT": True,
        "CH": fgl.SPLIT_CHUNK[bm],
        "HAS_BIAS": epilogue,
        "HAS_LORA": epilogue,
        "RC": 64,
        "FENCED": bm in fgl.FENCED_RELEASE,
        "PDL": pdl,
        "num_warps": 4,
    }
    aligned = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("y_ptr", "part_ptr", "N", "K")}
    options = {"num_warps": 4, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(
        GluonASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    ).asm["sass"]


@pytest.mark.parametrize("bm,epilogue", [(16, False), (32, True), (128, True), (64, False)])
def test_gluon_decode_compiles_for_sm90(bm: int, epilogue: bool) -> None:
    """The Gluon decode kernel compiles for sm_90 on any machine (Triton's bundled ptxas) with the
    structure it exists for: wgmma with the decoded weights as the register A operand, TMA loads, one
    wgmma wait per K step, and no register spills in the K loop at its per-BM register cap."""
    import re

    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import fp4_gluon as fgl

    sass = _gluon_decode_sass(bm, epilogue)
    # 4 nibbles x 4 k16 chunks, A in registers
    assert len(re.findall(r"HGMMA\.\S+ R\d+, R\d+, gdesc", sass)) == 16
    # The LoRA expand (epilogue only) is the one wgmma with A from shared memory: 4 k16 chunks of RC = 64.
    assert len(re.findall(r"HGMMA\.\S+ R\d+, gdesc", sass)) == (4 if epilogue else 0)
    # One wait per K step (ptxas did not serialise the K loop's wgmma), plus the LoRA expand's.
    assert sass.count("WARPGROUP.DEPBAR") == 1 + epilogue
    assert "UTMALDG" in sass and "SYNCS" in sass  # TMA loads completing on mbarriers
    # The split-K partials move in 16-byte vectors (each thread's BM / 2 fp32 values: BM / 8 stores), never as
    # the accumulator layout's 4-byte elements.
    assert len(re.findall(r"STG\.E\.128 ", sass)) == bm // 8 and not re.search(r"LDG\.E\.STRONG", sass)
    assert len(re.findall(r"LDG\.E\.128\.STRONG", sass)) % (bm // 8) == 0 and "LDG.E.128.STRONG" in sass
    # No spills in the K loop (from the label before the first wgmma to the branch after its wait). The
    # BM=128 epilogue with LoRA does spill (~30 local accesses once per output tile, ptxas -v).
    lines = sass.splitlines()
    first = next(i for i, line in enumerate(lines) if "HGMMA" in line)
    start = max(i for i in range(first) if lines[i].rstrip().endswith(":"))
    wait = next(i for i, line in enumerate(lines) if "WARPGROUP.DEPBAR" in line)
    end = next(i for i in range(wait, len(lines)) if "BRA" in lines[i])
    assert not [line for line in lines[start:end] if re.search(r"\b(?:LDL|STL)\b", line)], (
        "register spills in the K loop"
    )
    # A slot's weights are released (mbarrier arrive) before the wgmma wait, so the next step's weights stream in
    # during the MMAs: at a FENCED_RELEASE BM after the slot's loads behind a proxy fence, before any wgmma; at the
    # others once the step's wgmma are issued (every load of the slot is in their A registers). Its x after the wait.
    # Released right after the loads with neither, TMA overwrote a slot under a load in flight (docs/kernels.md#fenced-release).
    arrives = [i for i in range(start, end) if "SYNCS.ARRIVE" in lines[i]]
    assert len(arrives) == 2 and arrives[0] < wait < arrives[1], "expected the weight release before the wgmma wait"
    loads = [i for i in range(start, wait) if re.search(r"\bLDS", lines[i])]
    if bm in fgl.FENCED_RELEASE:
        fences = [i for i in range(start, wait) if "FENCE.VIEW.ASYNC.S" in lines[i]]
        assert fences and max(loads) < fences[0] < arrives[0] < first, "expected loads, proxy fence, release, wgmma"
    else:
        assert max(loads) < max(i for i in range(start, wait) if "HGMMA" in lines[i]) < arrives[0], (
            "expected the weight release after the wgmma are issued"
        )


def _direct_decode_sass(ring: bool, pdl: bool = False) -> str:
    """The mma.sync decode kernel's sm_90 SASS (split-K, bias, LoRA r16; ``ring``: the x ring's refill build)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from qerl.kernels import fp4_direct as fd

    kernel = fd._direct_kernel
    ints = [
        "M",
        "N",
        "K",
        "stride_xm",
        "stride_h",
        "stride_s",
        "steps_per_split",
        "Y1",
        "Y2",
        "S1",
        "S2",
        "stride_lb",
        "R",
    ]
    constants = {
        "BM": fd.BM,
        "BN": fd.ROWS_PER_WARP * fd.WARPS,
        "HW": fd.HW,
        "STEPS": fd.MAX_STEPS,
        "RING": ring,
        "SPLIT": True,
        "CH": fd.SPLIT_CHUNK,
        "HAS_BIAS": True,
        "HAS_LORA": True,
        "RC": 16,
        "WHOLE": not ring,
        "PDL": pdl,
        "num_warps": fd.WARPS,
    }
    signature = {
        "x_ptr": "*bf16",
        "h_ptr": "*i32",
        "s_ptr": "*i16",
        "g_ptr": "*fp32",
        "y_ptr": "*bf16",
        "part_ptr": "*fp32",
        "ticket_ptr": "*i32",
        "bias_ptr": "*bf16",
        "u_ptr": "*bf16",
        "lb_ptr": "*bf16",
        **dict.fromkeys(ints, "i32"),
        "lora_scale": "fp32",
        **dict.fromkeys(constants, "constexpr"),
    }
    aligned = {
        (kernel.arg_names.index(n),): [["tt.divisibility", 16]]
        for n in ("x_ptr", "h_ptr", "s_ptr", "y_ptr", "part_ptr", "N", "K", "stride_xm", "stride_h", "stride_s")
    }
    return triton.compile(
        GluonASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": fd.WARPS},
    ).asm["sass"]


@pytest.mark.parametrize("ring", [False, True])
def test_direct_decode_compiles_for_sm90(ring: bool) -> None:
    """The mma.sync decode kernel (``fp4_direct``) compiles for sm_90 on any machine with the structure it
    exists for: x staged in shared memory (cp.async) before the K loop, then per K step 16 register-operand
    HMMA (4 nibbles x 4 k16 chunks), 4 16-byte weight loads straight into registers and 8 16-byte x reads
    from shared memory, no barrier, store or spill; the LoRA expand (one HMMA in a loop over rank chunks)
    before it, or, in the RING build, after it (two HMMA: the first rank chunk and the loop over the rest).
    With ``RING`` (slices longer than the ring) the loop also holds the ring's refill, a block its branch
    skips on all but every STEPS-th step, and the next step's weight loads come before that branch (after it,
    ptxas sank them to ~70 instructions before the loop's end); without it, nothing else."""
    import re

    pytest.importorskip("triton.experimental.gluon")
    sass = _direct_decode_sass(ring)
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\s*\w+:", line)}
    loops = [
        (labels[m.group(1)], i)
        for i, line in enumerate(lines)
        for m in [re.search(r"BRA `?\(?(\w+)\)?;", line)]
        if m and m.group(1) in labels and labels[m.group(1)] < i
    ]
    start, end = max(loops, key=lambda ab: sum("HMMA" in line for line in lines[ab[0] : ab[1]]))  # the K loop
    assert any("LDGSTS" in line for line in lines[:start])
    assert sum("HMMA.16816.F32.BF16" in line for line in lines[:start]) == (0 if ring else 1)  # the LoRA expand
    skips = [m.group(1) for line in lines[start:end] for m in [re.search(r"@!?P\d BRA `?\(?(\w+)\)?;", line)] if m]
    if ring:
        branch = next(i for i in range(start, end) if re.search(r"@!?P\d BRA", lines[i]))
        refill, body = lines[branch : labels[skips[0]]], lines[labels[skips[0]] : end + 1]
        assert any("LDGSTS" in line for line in refill)
        # The next step's weights are loaded ahead of the refill's branch, at the top of the step.
        assert sum("LDG.E.128" in line for line in lines[start:branch]) == 4
        assert not [line for line in lines[start:branch] if re.search(r"\b(?:BAR|HMMA)\b", line)]
    else:
        assert not skips, "a branch inside the K loop"
        body = lines[start : end + 1]
        assert sum("LDG.E.128" in line for line in body) == 4
        # _pair_k: each mma's B pair is two adjacent registers of one x load, so nothing is copied into place
        assert not [line for line in body if re.search(r"\b(?:IMAD\.MOV|MOV)\b", line)], "register copies in the K loop"
    assert sum("HMMA.16816.F32.BF16" in line for line in body) == 16
    assert sum("LDS.128" in line for line in body) == 8
    assert not [line for line in body if re.search(r"\b(?:BAR|STS|LDSM|LDGSTS)\b", line)], (
        "a barrier or a store in the K loop"
    )
    assert not re.search(r"\b(?:LDL|STL)\b", sass), "register spills"
    assert sass.count("HMMA.16816.F32.BF16") == 16 + (2 if ring else 1)


@pytest.mark.parametrize("kernel", ["direct", "gluon16", "gluon64"])
def test_decode_kernels_pdl_order_sm90(kernel: str) -> None:
    """With ``PDL`` (qerl/kernels/pdl.py) a decode kernel lets its dependents launch (PREEXIT, griddepcontrol.
    launch_dependents: the mma.sync kernel after its K loop, the TMA kernel as it starts) and loads only weights before
    its wait for the kernel before it (ACQBULK, griddepcontrol.wait): the mma.sync kernel its first step's weight words
    and scales (LDG), the TMA kernel its first ring of weight and scale tiles (TMA); x (cp.async / TMA), u, partials,
    tickets and y all come after a wait. Without it, neither."""
    import re

    pytest.importorskip("triton.experimental.gluon")
    sass = {
        p: _direct_decode_sass(False, p) if kernel == "direct" else _gluon_decode_sass(int(kernel[5:]), True, p)
        for p in (False, True)
    }
    assert "ACQBULK" not in sass[False] and "PREEXIT" not in sass[False]
    lines = sass[True].splitlines()
    waits = [i for i, line in enumerate(lines) if "ACQBULK" in line]
    assert waits and "PREEXIT" in sass[True]
    if kernel == "direct":
        (wait,) = waits
        preexit = next(i for i, line in enumerate(lines) if "PREEXIT" in line)
        assert wait < max(i for i, line in enumerate(lines) if "HMMA" in line) < preexit, "trigger after the K loop"
        before = lines[:wait]
        assert sum("LDG.E.128" in line for line in before) == 4 and sum("LDG.E.U16" in line for line in before) == 4
        assert not [line for line in before if re.search(r"\b(?:LDGSTS|STG|ATOMG|RED|LDS|LDG\.E\.(?!128|U16))", line)]
        return
    # Every memory access but the weight TMA follows some wait in program order, each partition's own: the
    # producer's weight tiles (2 TMA a slot) come before its wait, its x TMA after it.
    first_wait = waits[0]
    assert [line for line in lines[:first_wait] if "UTMALDG" in line], "no weight TMA before the producer's wait"
    assert not [line for line in lines[:first_wait] if re.search(r"\b(?:STG|ATOMG|LDG|LDGSTS)\b", line)]
    assert waits[-1] < min(i for i, line in enumerate(lines) if re.search(r"\b(?:STG|ATOMG|LDG)\b", line))


@pytest.mark.parametrize("kernel", ["direct", "gluon"])
def test_gluon_decode_launch_binds_arguments(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both Gluon decode launchers hand their kernel every argument under the right name (the shared host
    tail, ``gluon_base.launch_tail``, names ``g_ptr`` .. ``RC``): the launch is captured on
    CPU tensors and bound to the kernel's Python signature, then checked field by field."""
    import inspect

    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import fp4_direct, fp4_gluon
    from qerl.kernels.epilogue import Epilogue

    module, name = (fp4_direct, "_direct_kernel") if kernel == "direct" else (fp4_gluon, "_decode_gluon_kernel")
    launches = []

    class Capture:
        fn = getattr(module, name).fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(module, name, Capture())
    monkeypatch.setattr(module, "supports", lambda *a: True)
    monkeypatch.setattr(module, "sm_count", lambda device: 132)
    m, n, k, rank = 3, 200, 1536, 24  # 6 K steps of 256: split 3 runs 2 each
    packed = torch.zeros(n, k // 2, dtype=torch.uint8)
    scale = torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn)
    g, x, bias = torch.ones(1), torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    u, lora_b = torch.zeros(m * rank, dtype=torch.bfloat16), torch.zeros(n, rank, dtype=torch.bfloat16)
    epilogue = Epilogue(bias, u, lora_b, 0.5, out_bounds=(100, 150), lora_bounds=(8, 16))
    y = module.matmul(x, nvfp4.NVFP4Tensors(packed, scale, g), epilogue=epilogue, split=3)
    ((grid, args, kwargs),) = launches
    launch_options = {"num_warps", "maxnreg"}  # Triton's, not the kernel's (num_warps is both for these kernels)
    signature = inspect.signature(Capture.fn)

    def bind(args: tuple, kwargs: dict) -> dict:
        """The launch's arguments by kernel parameter name (a keyword the kernel lacks fails the bind)."""
        options = {k: v for k, v in kwargs.items() if k in signature.parameters or k not in launch_options}
        return signature.bind(*args, **options).arguments

    bound = bind(args, kwargs)
    steps = k // 256
    tiles = -(-n // 64)
    # The Gluon kernel's grid is 1-D (tile, slice) programs (``_slice_of``): an explicit split is uniform.
    assert grid == ((tiles, 3) if kernel == "direct" else (tiles * 3,)) and y.shape == (m * n,)
    assert bound["g_ptr"] is g and bound["y_ptr"] is y and bound["bias_ptr"] is bias and bound["u_ptr"] is u
    bm = 8 if kernel == "direct" else 16  # the padded token count (the tile's BM)
    assert bound["lb_ptr"] is lora_b and bound["ticket_ptr"].dtype == torch.int32
    assert bound["part_ptr"].shape == (3, tiles, 64 * bm) and bound["BM"] == bm  # split x tiles x (BN x BM)
    assert (bound["M"], bound["N"], bound["K"]) == (m, n, k)
    if kernel == "direct":
        assert bound["steps_per_split"] == -(-steps // 3)
    else:
        assert (bound["base"], bound["extra"]) == (3, 0)
    assert (bound["Y1"], bound["Y2"], bound["S1"], bound["S2"], bound["stride_lb"], bound["R"]) == (
        100,
        150,
        8,
        16,
        rank,
        rank,
    )
    assert bound["lora_scale"] == 0.5 and bound["SPLIT"] and bound["HAS_BIAS"] and bound["HAS_LORA"]
    if kernel == "direct":
        # weights as int32 words, scales as int16 pairs of e4m3 bytes (the strides in those units)
        assert (bound["stride_xm"], bound["stride_h"], bound["stride_s"]) == (k, k // 8, k // 32)
        assert (
            bound["x_ptr"].shape == (m, k)
            and bound["h_ptr"].dtype == torch.int32
            and bound["s_ptr"].dtype == torch.int16
        )
        assert bound["WHOLE"] == (n % 64 == 0)
        assert (
            bound["STEPS"] == bound["steps_per_split"] and bound["CH"] == fp4_direct.SPLIT_CHUNK and not bound["RING"]
        )
        # x goes through a ring of at most MAX_STEPS K steps: a slice of MAX_STEPS + 1 steps stays one slice.
        k = 256 * (fp4_direct.MAX_STEPS + 1)
        packed, scale = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn)
        module.matmul(torch.zeros(m, k, dtype=torch.bfloat16), nvfp4.NVFP4Tensors(packed, scale, g), split=1)
        grid, args, kwargs = launches[-1]
        bound = bind(args, kwargs)
        assert grid == (-(-n // 64), 1) and bound["STEPS"] == fp4_direct.MAX_STEPS and bound["RING"]
        assert bound["steps_per_split"] == fp4_direct.MAX_STEPS + 1
    else:
        # The split left to the kernel at 7B down, M=64: the wave model's 4 slices, 40 of the 56 tiles in 5
        # (schedule.balanced_split), 264 programs and room for 5 slices of partials.
        n, k, m = 3584, 18944, 64
        packed, scale = torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn)
        module.matmul(torch.zeros(m, k, dtype=torch.bfloat16), nvfp4.NVFP4Tensors(packed, scale, g))
        grid, args, kwargs = launches[-1]
        bound = bind(args, kwargs)
        assert (
            grid == (264,)
            and (bound["base"], bound["extra"]) == (4, 40)
            and bound["part_ptr"].shape == (5, 56, 64 * 64)
        )
