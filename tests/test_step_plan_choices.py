"""The decode step's plan for every tested shape, against a table recorded before the plan moved from ``qerl/kernels``
to ``qerl/rollout`` (issue 74): which op each step runs (kernel or torch reference, the LoRA shrink fused or not, the
output in the Gluon K order or not, a group as one FP4 launch or one per projection, the sampler and the bookkeeping),
and which FP4 kernel each GEMM launch takes with its schedule (Triton: BN, BK, warps, stages, split; TMA/wgmma: BM,
stages, slices + balanced extra; mma.sync: slices). On CPU, nothing runs: the plan is built for a described Hopper
device (capability 9.0, 132 SMs, an H100's or H200's) over models whose weights live on the meta device.

The table (``tests/data/step_plan_choices.txt``) changes only with a measured decision; ``table()`` writes its lines.
Its words: a producer op (norms, attention, SiLU) is ``ref`` (torch), ``k`` (the fused kernel; for the attention
``k(rope)`` with RoPE and the cache write inside it, ``rope,k`` with them in a kernel of their own, ``engine`` in
prefill), ``+s`` with the group's LoRA shrink inside it, ``:g`` writing the Gluon K order; a group is ``1:`` one FP4
launch (``1:g:`` reading the Gluon K order) or ``[...]`` one per projection (``+l``: the LoRA expand in its epilogue,
``+mm``: an addmm after it, ``dense``: a CPU dense copy); a GEMM is ``tri(BN,BK,warps,stages,split)``,
``tma(BM,stages,slices+extra)``, ``dir(slices)``, ``dequantized`` (dequantize + cuBLAS) or ``ref``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from qerl.kernels import backend, gluon_layout, reference, schedule
from qerl.load.linear import NVFP4Linear
from qerl.nvfp4 import NVFP4Tensors
from qerl.rollout import decoder, step_plan
from qerl.rollout.layers import Group, LayerView, ModelView, Norm, Proj, Stacked

fp4_gemm = pytest.importorskip("qerl.kernels.fp4_gemm")
pytest.importorskip("triton.experimental.gluon")
from qerl.kernels import fp4_direct, fp4_gluon  # noqa: E402  (after the skips: they need Triton's Gluon)

TABLE = Path(__file__).parent / "data" / "step_plan_choices.txt"
CUDA = torch.device("cuda", 0)
#: (hidden, intermediate, heads, kv heads, head dim, q/k/v bias): SmolLM2-135M, the GPU tests' medium Qwen2 and
#: its Gluon-shaped variant (tests/test_rollout_engines.py), Qwen2.5-7B and -32B.
MODELS = {
    "smollm2": (576, 1536, 9, 3, 64, False),
    "medium": (896, 2432, 7, 1, 128, True),
    "gluon": (1024, 2560, 8, 2, 128, True),
    "7b": (3584, 18944, 28, 4, 128, True),
    "32b": (5120, 27648, 40, 8, 128, True),
}
DECODE_ROWS = (1, 8, 12, 16, 32, 64, 128)
PREFILL_ROWS = (12, 40, 300)
RANK = 16


def _meta_linear(k: int, n: int, bias: bool) -> NVFP4Linear:
    return NVFP4Linear(k, n, bias=bias, device="meta")


def _group(shapes: list[tuple[int, int]], bias: bool, lora: bool, stacked: bool, device: torch.device) -> Group:
    """A group of NVFP4 projections ``(K, N)`` as ``ModelView.from_model`` makes it on ``device`` (meta tensors)."""
    projs = [Proj(_meta_linear(k, n, bias)) for k, n in shapes]
    k = shapes[0][0]
    st = None
    if stacked and len(projs) > 1:
        n = sum(s[1] for s in shapes)
        weight = NVFP4Tensors(torch.empty(n, k // 2, dtype=torch.uint8, device="meta"), None, None)
        st = Stacked(weight, torch.empty(n, device="meta") if bias else None, tuple(s[1] for s in shapes))
    group = Group(projs, stacked=st)
    if lora:
        r = RANK * len(projs)
        group.lora_a = torch.empty(r, k, device="meta")
        if device.type == "cuda" and gluon_layout.fits(k):
            group.lora_a_gluon_k = torch.empty(r, k, device="meta")
        for j, p in enumerate(projs):
            p.lora_slice = slice(j * RANK, (j + 1) * RANK)
            p.lora_b = torch.empty(p.base.out_features, RANK, device="meta")
    return group


def _view(model: str, lora: bool, stacked: bool, dtype: torch.dtype, device: torch.device) -> ModelView:
    """Two layers of ``model``'s shapes (the second layer's norm feeds the final norm)."""
    hidden, inter, heads, kv, hd, bias = MODELS[model]
    norm = Norm(torch.empty(hidden, device="meta"), 1e-6)
    qkv = [(hidden, heads * hd), (hidden, kv * hd), (hidden, kv * hd)]

    def layer() -> LayerView:
        return LayerView(
            attn_norm=norm,
            qkv=_group(qkv, bias, lora, stacked, device),
            o=_group([(heads * hd, hidden)], False, lora, stacked, device),
            mlp_norm=norm,
            gate_up=_group([(hidden, inter), (hidden, inter)], False, lora, stacked, device),
            down=_group([(inter, hidden)], False, lora, stacked, device),
        )

    return ModelView(None, None, [layer(), layer()], norm, None, None, heads, kv, hd, None, dtype, device)


def _gemm(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, gluon_k: bool) -> str:
    """The FP4 kernel ``fp4_gemm.matmul`` runs for this GEMM, and its schedule."""
    if not (backend.serves(device) and dtype in (torch.bfloat16, torch.half)):
        return "ref"
    decode = m <= schedule.DECODE_MAX_M
    req = fp4_gemm.Request(m, None, gluon_k, fp4_gemm.gluon_kernel(m, n, k, dtype, device) if decode else None, True)
    launch = next((f.__name__ for f, applies in fp4_gemm.ROUTES if applies(req)), "error")
    if launch == "_triton":
        c = schedule.decode_config(m, n, k, device)
        return f"tri({c.BN},{c.BK},{c.warps},{c.stages},{c.split})"
    if launch == "_tma":
        bm = max(16, 1 << (m - 1).bit_length())
        stages, _, resident, steps = fp4_gluon.SCHEDULE[bm]
        tiles, k_steps = schedule.cdiv(n, fp4_gluon.BN), k // fp4_gluon.BK
        base = schedule.resolve_split(tiles, k_steps, 0, 132 * resident, steps)
        extra = schedule.balanced_split(tiles, base, 132 * resident, k_steps, 132)[1] if bm <= 64 else 0
        return f"tma({bm},{stages},{base}+{extra})"
    if launch == "_direct":
        tiles, k_steps, slots = fp4_direct.launch_shape(n, k, device)
        return f"dir({schedule.resolve_split(tiles, k_steps, 0, slots, fp4_direct.PROGRAM_STEPS)})"
    return launch.strip("_")


#: The producer ops' functions in the table's words.
PRODUCERS: dict[Callable, str] = {
    step_plan.norm_reference: "ref",
    step_plan.norm_kernel: "k",
    step_plan.norm_shrink: "k+s",
    step_plan.silu_reference: "ref",
    step_plan.silu_kernel: "k",
    step_plan.silu_shrink: "k+s",
    step_plan.attention_reference: "ref",
    step_plan.attention_kernel: "rope,k",
    step_plan.attention_rope_kernel: "k(rope)",
}


def _producer(op: functools.partial) -> str:
    kw = op.keywords
    r = kw.get("r")
    fuse = r is not None and r.fuse
    gluon_k = kw.get("gluon_k", False) or (r is not None and r.gluon_k)
    return PRODUCERS[op.func] + ("+s" if fuse else "") + (":g" if gluon_k else "")


def _projection(op: Callable, proj: Proj, m: int, view: ModelView) -> str:
    """One projection's bound op (``decoder.projection_op``)."""
    if not isinstance(op, functools.partial):  # no adapter: the base alone
        op, lora = op.__closure__[0].cell_contents, ""
    else:
        lora = "+l"
    if op.func is decoder.addmm_lora_forward:
        op, lora = op.keywords["base"], "+mm"
    if op.func is decoder.dense_forward:
        return "dense" + lora
    gemm = _gemm(m, proj.base.out_features, proj.base.in_features, view.dtype, view.device, False)
    return gemm + lora


def _group_op(op: functools.partial, group: Group, m: int, view: ModelView) -> str:
    if op.func is decoder.stacked_forward:
        gluon_k = op.keywords["gluon_k"]
        n = sum(group.fp4_launch()[0].splits)
        k = group.projs[0].base.in_features
        return f"1{':g' if gluon_k else ''}:{_gemm(m, n, k, view.dtype, view.device, gluon_k)}"
    projs = op.keywords["projs"]
    return "[" + ",".join(_projection(p, q, m, view) for p, q in zip(projs, group.projs, strict=True)) + "]"


def _choices(view: ModelView, rows: int, decode: bool) -> str:
    """One line of the table: every op of the plan of ``rows`` rows over ``view``."""
    ops = step_plan.build(view, rows, decode=decode)
    sampler = "kernel" if ops.sample is not None else "torch"
    finish = "ref" if ops.finish is reference.finish_step else "kernel"
    first, last = ops.layers
    layer = view.layers[0]
    parts = {
        "first": _producer(ops.first_norm),
        "qkv": _group_op(first.qkv, layer.qkv, rows, view),
        "attn": "engine" if first.attention is None else _producer(first.attention),
        "o": _group_op(first.o, layer.o, rows, view),
        "mlp_norm": _producer(first.mlp_norm),
        "gate_up": _group_op(first.gate_up, layer.gate_up, rows, view),
        "silu": _producer(first.silu),
        "down": _group_op(first.down, layer.down, rows, view),
        "next": _producer(first.next_norm),
        "final": _producer(last.next_norm),
        "sample": sampler,
        "finish": finish,
    }
    return " ".join(f"{k}={v}" for k, v in parts.items())


#: Variant -> (what it changes): the view's LoRA / stacking / dtype / device, the switches, the module constants.
VARIANTS: dict[str, dict] = {
    "default": {},
    "nolora": {"lora": False},
    "unstacked": {"stacked": False},
    "stack_off": {"const": {"STACK_GROUPS": False}},
    "fuse0": {"const": {"FUSED_LORA_MAX_ROWS": 0}},
    "gluon_off": {"switches": {"gluon_decode": False}},
    "direct_off": {"switches": {"direct_decode": False}},
    "ring_on": {"switches": {"direct_ring": True}},
    "rope_off": {"switches": {"rope_in_attention": False}},
    "sampler_off": {"switches": {"fused_sampler": False}},
    "min_weights0": {"min_weights": 0},
    "fp16": {"dtype": torch.float16},
    "triton_off": {"triton": False},
    "cpu": {"device": torch.device("cpu"), "dtype": torch.float32},
}


def _variant_models(variant: str) -> tuple[str, ...]:
    """Every model for the default; the 7B and 32B shapes and the Gluon test's for the others."""
    return tuple(MODELS) if variant == "default" else ("gluon", "7b", "32b")


def _cases() -> Iterator[tuple[str, str, str, int]]:
    for variant in VARIANTS:
        for model in _variant_models(variant):
            for decode, rows in [(True, r) for r in DECODE_ROWS] + [(False, r) for r in PREFILL_ROWS]:
                yield variant, model, "decode" if decode else "prefill", rows


def table() -> list[str]:
    """The table's lines, in a described Hopper device's terms (see the module doc)."""
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        mp.setitem(schedule.SM_COUNTS, CUDA, 132)
        for variant, model, mode, rows in _cases():
            v = VARIANTS[variant]
            with pytest.MonkeyPatch.context() as inner:
                inner.setattr(schedule, "SWITCHES", replace(schedule.SWITCHES, **v.get("switches", {})))
                for name, value in v.get("const", {}).items():
                    inner.setattr(step_plan, name, value)
                if "min_weights" in v:
                    inner.setattr(schedule, "GLUON_MIN_WEIGHTS", v["min_weights"])
                if not v.get("triton", True):
                    inner.setattr(backend, "enabled", lambda: False)
                device = v.get("device", CUDA)
                view = _view(model, v.get("lora", True), v.get("stacked", True), v.get("dtype", torch.bfloat16), device)
                lines.append(f"{variant} {model} {mode} {rows}: {_choices(view, rows, mode == 'decode')}")
    return lines


def test_the_plan_chooses_as_recorded() -> None:
    """Every case's ops and GEMM kernels are the recorded ones (the first differing lines are shown)."""
    want = TABLE.read_text().splitlines()
    got = table()
    assert len(got) == len(want), (len(got), len(want))
    diff = [f"- {w}\n+ {g}" for w, g in zip(want, got, strict=True) if w != g]
    assert not diff, f"{len(diff)} cases differ:\n" + "\n".join(diff[:5])
