"""Checks of qerl.kernels.fused_step against the plain-torch ops, shared by two tests:

* ``test_rollout_kernels.py::test_gpu_rollout_kernels_match_torch`` calls ``check_kernels("cuda", bf16)``;
* ``test_rollout_kernels.py::test_rollout_kernels_interpreted`` runs this file as a script under
  ``TRITON_INTERPRET=1`` on CPU (fp32 and fp16; the interpreter rounds bf16 products wrongly): the
  fused step kernels, the FP4 decode kernel (``check_decode_kernel``) and its stacked-group form, then
  ``check_engine_interpreted``: a whole NativeEngine generation through the kernels.

Every reference is computed in fp32 on CPU from the same (rounded) inputs.
"""

from __future__ import annotations

import torch

from qerl.kernels import fused_step, reference, step_base, step_sampler
from qerl.kernels.gluon_layout import to_gluon_k
from qerl.load.linear import stack_fused_groups
from qerl.rollout import step_plan
from qerl.rollout.decoder import LoraInputs, LoraU, lora_inputs
from qerl.rollout.layers import Group, Norm, Proj


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-6)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def _group(ranks: list[int], lora_a: torch.Tensor) -> Group:
    projs, start = [], 0
    for r in ranks:
        proj = Proj(torch.nn.Identity())
        if r:
            proj.lora_slice = slice(start, start + r)
            start += r
        projs.append(proj)
    return Group(projs, lora_a)


#: The torch reference route of ``rollout.step_plan`` (what CPU rollouts run), the kernels' oracle here.
_REFERENCE = step_plan.Route(kernel=False)


def _ref_norm(
    h: torch.Tensor, norm: Norm, delta: torch.Tensor | None = None, group: Group | None = None
) -> tuple[torch.Tensor, torch.Tensor, LoraInputs]:
    return step_plan.norm_op(_REFERENCE, norm, group)(h, delta)


def _ref_silu(gate: torch.Tensor, up: torch.Tensor, group: Group) -> tuple[torch.Tensor, LoraInputs]:
    return step_plan.silu_op(_REFERENCE, group)(gate, up)


def _at(
    cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> reference.AttentionArgs:
    """The RoPE tables, slots and caches of one step (the scale unused by the RoPE)."""
    return reference.AttentionArgs(cos, sin, pos, k_cache, v_cache, 1.0)


def _ref_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, scale: float, group: Group
) -> tuple[torch.Tensor, LoraInputs]:
    out = reference.decode_attention(q, k_cache, v_cache, pos, scale)
    return out, lora_inputs(out, group)


def check_kernels(device: str, dtype: torch.dtype, tol: float) -> None:
    """Each fused kernel on ``device``/``dtype`` vs the plain-torch op in fp32; raises AssertionError."""
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def dev(t: torch.Tensor) -> torch.Tensor:  # copies: in-place ops must not touch the inputs
        return t.to(device, copy=True)

    # Residual add + RMSNorm, with and without the fused shrink (three rank segments, one empty proj).
    for m, k, ranks in ((1, 200, [4, 0, 6]), (3, 328, [8, 2, 6]), (5, 96, [16])):
        h, d, w = rnd(m, k), rnd(m, k), rnd(k, scale=0.3) + 1
        a = rnd(sum(ranks), k, scale=0.2)
        group = _group(ranks, a.float())
        ref_h, ref_x, ref_u = _ref_norm(h.float().clone(), Norm(w.float(), 1e-6), d.float(), group)
        # Both splits of the shrink: over the row's columns (rb=0) and over u's ranks, 1 and 4 to a program.
        for rb in (0, 1, 4):
            hc = dev(h)
            h_out, x, flat = fused_step.rms_norm_shrink(hc, dev(d), dev(w), 1e-6, dev(a), group.lora_bounds, rb=rb)
            assert torch.equal(hc.cpu(), h), "rms_norm_shrink must leave h unchanged"
            _close(h_out, ref_h, tol, f"rms_norm_shrink residual (rb={rb})")
            _close(x, ref_x, tol, f"rms_norm_shrink output (rb={rb})")
            for got, want in zip(
                LoraU.from_kernel(flat, x, group).per_projection(group), ref_u.per_projection(group), strict=True
            ):
                assert (got is None) == (want is None)
                if got is not None:
                    assert got.is_contiguous()
                    _close(got, want, 2 * tol, f"rms_norm_shrink u (m={m}, k={k}, rb={rb})")
        same, x2, flat2 = fused_step.rms_norm_shrink(hc, None, dev(w), 1e-6, dev(a), group.lora_bounds)
        assert same is hc
        _close(x2, _ref_norm(h.float(), Norm(w.float(), 1e-6))[1], tol, "rms_norm_shrink without delta")
        hc = dev(h)
        x3 = fused_step.rms_norm(hc, dev(d), dev(w), 1e-6)
        _close(hc, ref_h, tol, "rms_norm in-place residual")
        _close(x3, ref_x, tol, "rms_norm output")

    # Outputs in the Gluon decode kernel's K order (gluon_k=True): the same values, each row permuted
    # as gluon_layout.to_gluon_k does it; rows that are not whole 256-element steps are refused.
    h, d, w, g, u = rnd(3, 512), rnd(3, 512), rnd(512, scale=0.3) + 1, rnd(3, 512), rnd(3, 512)
    natural = fused_step.rms_norm(dev(h), dev(d), dev(w), 1e-6).cpu()
    assert torch.equal(fused_step.rms_norm(dev(h), dev(d), dev(w), 1e-6, gluon_k=True).cpu(), to_gluon_k(natural))
    natural = fused_step.silu_mul(dev(g), dev(u)).cpu()
    assert torch.equal(fused_step.silu_mul(dev(g), dev(u), gluon_k=True).cpu(), to_gluon_k(natural))
    # The fused shrinks with gluon_k: the output permuted, u (reduced from the natural-order values) bitwise the same.
    a = rnd(24, 512, scale=0.1)
    bounds = (8, 16)
    for rb in (0, 2):
        hout, natural, u_nat = fused_step.rms_norm_shrink(dev(h), dev(d), dev(w), 1e-6, dev(a), bounds, rb=rb)
        hout_p, permuted, u_p = fused_step.rms_norm_shrink(
            dev(h), dev(d), dev(w), 1e-6, dev(a), bounds, gluon_k=True, rb=rb
        )
        assert torch.equal(permuted.cpu(), to_gluon_k(natural.cpu())), f"rms_norm_shrink(gluon_k=True, rb={rb}) output"
        assert torch.equal(u_p, u_nat) and torch.equal(hout_p, hout), (
            f"rms_norm_shrink(gluon_k=True, rb={rb}) u / residual"
        )
    natural, u_nat = fused_step.silu_mul_shrink(dev(g), dev(u), dev(a))
    permuted, u_p = fused_step.silu_mul_shrink(dev(g), dev(u), dev(a), gluon_k=True)
    assert torch.equal(permuted.cpu(), to_gluon_k(natural.cpu())) and torch.equal(u_p, u_nat), (
        "silu_mul_shrink(gluon_k=True)"
    )
    try:
        fused_step.rms_norm(dev(h[:, :200]), None, dev(w[:200]), 1e-6, gluon_k=True)
        raise AssertionError("rms_norm(gluon_k=True) accepted rows of 200")
    except ValueError as err:
        assert "256" in str(err)

    # SiLU gating, with and without the down_proj shrink. Rank 200 at k=1024 splits the row into 32
    # programs whose partials the last one sums in two tiles of 16 (part_tile caps a tile at 4096 values).
    nsplit = step_base.shrink_split(1, 1024, step_base.rank_pad(200), 4)[0]
    assert step_base.part_tile(nsplit, step_base.rank_pad(200)) < nsplit
    for m, k, r in ((1, 1000, 16), (4, 300, 5), (1, 1024, 200)):
        g, u, a = rnd(m, k), rnd(m, k), rnd(r, k, scale=0.1)
        ref_act, ref_u = _ref_silu(g.float(), u.float(), _group([r], a.float()))
        act, flat = fused_step.silu_mul_shrink(dev(g), dev(u), dev(a))
        _close(act, ref_act, tol, "silu_mul_shrink output")
        _close(flat.view(m, r), ref_u.u, 2 * tol, "silu_mul_shrink u")
        _close(fused_step.silu_mul(dev(g), dev(u)), ref_act, tol, "silu_mul")

    # RoPE + cache write, then attention (GQA 4:1) with and without the o_proj shrink.
    b, nh, nkv, hd, s = 3, 8, 2, 16, 40
    kc, vc = rnd(b, nkv, s, hd), rnd(b, nkv, s, hd)
    q, k_, v = rnd(b, nh * hd), rnd(b, nkv * hd), rnd(b, nkv * hd)
    cos, sin = rnd(s, hd), rnd(s, hd)
    pos = torch.tensor([0, 17, 39])
    kcc, vcc = dev(kc), dev(vc)
    q_out = fused_step.rope_and_cache(dev(q), dev(k_), dev(v), _at(dev(cos), dev(sin), dev(pos), kcc, vcc))
    kr, vr = kc.float().clone(), vc.float().clone()
    q_ref = reference.rope_and_cache(q.float(), k_.float(), v.float(), _at(cos.float(), sin.float(), pos, kr, vr))
    _close(q_out, q_ref, 2 * tol, "rope q")
    _close(kcc, kr, 2 * tol, "rope k cache")
    assert torch.equal(vcc.cpu().float(), vr), "v cache"
    qa, a = rnd(b, nh, hd), rnd(12, nh * hd, scale=0.1)
    ref_att, ref_u = _ref_attention(
        qa.float(), kcc.cpu().float(), vcc.cpu().float(), pos, hd**-0.5, _group([12], a.float())
    )
    att, none = fused_step.decode_attention(dev(qa), kcc, vcc, dev(pos), hd**-0.5)
    assert none is None
    _close(att, ref_att, tol, "decode_attention")
    att, flat = fused_step.decode_attention(dev(qa), kcc, vcc, dev(pos), hd**-0.5, dev(a))
    _close(att, ref_att, tol, "decode_attention (shrink)")
    _close(flat.view(b, 12), ref_u.u, 2 * tol, "decode_attention u")
    check_rope_in_attention(rnd, dev, dev(a))
    check_qk_norm_in_attention(rnd, dev, dev(a), tol)
    qw, kw, vw = rnd(b, 16, hd), rnd(b, nkv, s, hd).to(device), rnd(b, nkv, s, hd).to(device)  # 16 heads x 16 = 256
    natural = fused_step.decode_attention(dev(qw), kw, vw, dev(pos), hd**-0.5)[0].cpu()
    permuted = fused_step.decode_attention(dev(qw), kw, vw, dev(pos), hd**-0.5, gluon_k=True)[0].cpu()
    assert torch.equal(permuted, to_gluon_k(natural)), "decode_attention(gluon_k=True)"
    a = rnd(12, 256, scale=0.1)
    _, u_nat = fused_step.decode_attention(dev(qw), kw, vw, dev(pos), hd**-0.5, dev(a))
    permuted, u_p = fused_step.decode_attention(dev(qw), kw, vw, dev(pos), hd**-0.5, dev(a), gluon_k=True)
    assert torch.equal(permuted.cpu(), to_gluon_k(natural)) and torch.equal(u_p, u_nat), (
        "decode_attention(gluon_k, shrink)"
    )

    check_finish_step(device)
    check_sample(device, dtype)


def check_sample(device: str, dtype: torch.dtype) -> None:
    """The fused sampler vs its definition: greedy = argmax and log_softmax (unprocessed); sampled = the
    race ``argmax(x / T - log E)`` over the very E it draws (``step_sampler.exponential``, read back through a
    probe kernel) with the log-prob of ``log_softmax(x / T)``; the same (seed, step) gives the same tokens,
    another step others. Three 2048-column splits per row, so the cross-split combine is exercised.
    On CUDA also the law itself: 200k draws of one row against softmax(x / T)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(seed_ptr, step_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        tl.store(out_ptr + row * V + cols, step_sampler.exponential(seed_ptr, step_ptr, row, cols, V), mask=cols < V)

    gen = torch.Generator().manual_seed(1)
    b, v, temp = 3, 5000, 0.7
    logits = (torch.randn(b, v, generator=gen) * 3).to(dtype)
    logits[1, 4100] = logits[1, 7] = logits[1].max() + 1  # a tie across splits: the first index wins
    x = logits.float()
    seed, step = torch.tensor([987654321]), torch.tensor([5])
    args = [t.to(device) for t in (torch.tensor(temp), seed, step)]
    tok, lp = fused_step.sample(logits.to(device), *args, greedy=True)
    assert tok.cpu().tolist() == torch.argmax(x, -1).tolist() and tok[1].item() == 7, "greedy token"
    _close(lp, torch.log_softmax(x, -1).gather(-1, tok.cpu()[:, None])[:, 0], 1e-5, "greedy log-prob")
    tok, lp = fused_step.sample(logits.to(device), *args, greedy=False)
    e = torch.empty(b, v, device=device)
    probe[(b,)](args[1], args[2], e, v, BLOCK=triton.next_power_of_2(v))
    want = torch.argmax(x / temp - e.cpu().log(), -1)
    assert tok.cpu().tolist() == want.tolist(), "sampled token: not the race over the drawn E"
    _close(lp, torch.log_softmax(x / temp, -1).gather(-1, want[:, None])[:, 0], 1e-5, "sampled log-prob")
    again = fused_step.sample(logits.to(device), *args, greedy=False)[0]
    later = fused_step.sample(logits.to(device), args[0], args[1], (step + 1).to(device), greedy=False)[0]
    assert torch.equal(again, tok) and not torch.equal(later, tok), "draws: same (seed, step) same, next step new"
    if device == "cuda":
        row = torch.randn(1, 50, generator=gen).to(dtype)
        n = 200_000
        tok, _ = fused_step.sample(row.to(device).expand(n, 50).contiguous(), *args, greedy=False)
        freq = torch.bincount(tok.cpu(), minlength=50).double() / n
        p = torch.softmax(row.double() / temp, -1)[0]
        z = ((freq - p).abs() / (p * (1 - p) / n).sqrt()).max().item()
        assert z < 5, f"sampled frequencies off softmax(x / T) by {z:.1f} standard errors"


def check_rope_in_attention(rnd, dev, lora_a: torch.Tensor, s: int = 200) -> None:  # noqa: ANN001
    """``decode_attention(rope=)`` (the partial kernel ropes q and writes this step's k / v itself) gives
    the bits of ``rope_and_cache`` + ``decode_attention``, caches included: 3 rows whose slots fall in
    different splits of a 4-split cache (GQA 4:1), with and without the o_proj shrink (``lora_a``)."""
    b, nh, nkv, hd = 3, 8, 2, 16
    kc, vc, q, k, v = rnd(b, nkv, s, hd), rnd(b, nkv, s, hd), rnd(b, nh * hd), rnd(b, nkv * hd), rnd(b, nkv * hd)
    cos, sin, pos = dev(rnd(s, hd)), dev(rnd(s, hd)), dev(torch.tensor([0, 117, s - 1]))
    for lora in (None, lora_a):
        k1, v1, k2, v2 = dev(kc), dev(vc), dev(kc), dev(vc)
        q1 = fused_step.rope_and_cache(dev(q), dev(k), dev(v), _at(cos, sin, pos, k1, v1))
        want = fused_step.decode_attention(q1, k1, v1, pos, hd**-0.5, lora)
        got = fused_step.decode_attention(
            dev(q).view(b, nh, hd), k2, v2, pos, hd**-0.5, lora, rope=(dev(k), dev(v), cos, sin)
        )
        assert torch.equal(k2, k1) and torch.equal(v2, v1), "decode_attention(rope=): cache"
        assert torch.equal(got[0], want[0]), "decode_attention(rope=): output"
        assert lora is None or torch.equal(got[1], want[1]), "decode_attention(rope=): u"


def check_qk_norm_in_attention(rnd, dev, lora_a: torch.Tensor, tol: float, s: int = 200) -> None:  # noqa: ANN001
    """Qwen3's per-head q / k norms inside the RoPE kernels: ``rope_and_cache(qk_norm=)`` against torch's
    ``step_plan.qk_norm`` + ``reference.rope_and_cache`` (q, k cache, v cache), and ``decode_attention(rope=,
    qk_norm=)`` against ``rope_and_cache(qk_norm=)`` + ``decode_attention``: the caches bit for bit (each kernel
    norms a k head as one ``[D]`` vector), the output and the shrink within ``tol``. A q head's sum of squares is
    reduced over a ``[D]`` vector by ``rope_and_cache`` and over a ``[G, D]`` tile by the attention kernel: on a GPU
    the two trees add in different orders (the last bit of a head's rstd differs, an H100 showed it), while the
    interpreter adds both in numpy's order."""
    b, nh, nkv, hd = 3, 8, 2, 16
    kc, vc, q, k, v = (
        rnd(b, nkv, s, hd),
        rnd(b, nkv, s, hd),
        rnd(b, nh * hd, scale=3.0),
        rnd(b, nkv * hd),
        rnd(b, nkv * hd),
    )
    cos, sin, pos = rnd(s, hd), rnd(s, hd), torch.tensor([0, 117, s - 1])
    qw, kw = 1 + 0.5 * rnd(hd).float(), 1 + 0.5 * rnd(hd).float()  # fp32, as trained norms are kept
    norms = (Norm(qw, 1e-6), Norm(kw, 1e-5))
    fused = (dev(qw), dev(kw), 1e-6, 1e-5)
    kr, vr = kc.float().clone(), vc.float().clone()
    qn, kn = step_plan.qk_norm(q.float(), k.float(), norms, hd)
    q_ref = reference.rope_and_cache(qn, kn, v.float(), _at(cos.float(), sin.float(), pos, kr, vr))
    k1, v1 = dev(kc), dev(vc)
    q1 = fused_step.rope_and_cache(dev(q), dev(k), dev(v), _at(dev(cos), dev(sin), dev(pos), k1, v1), fused)
    _close(q1, q_ref, 2 * tol, "qk-normed rope q")
    _close(k1, kr, 2 * tol, "qk-normed rope k cache")
    assert torch.equal(v1.cpu().float(), vr), "qk-normed rope: v cache"
    plain = fused_step.rope_and_cache(dev(q), dev(k), dev(v), _at(dev(cos), dev(sin), dev(pos), dev(kc), dev(vc)))
    assert (plain.cpu().float() - q_ref).abs().max() > 10 * tol * q_ref.abs().max(), "the norms changed nothing"
    for lora in (None, lora_a):
        k1, v1, k2, v2 = dev(kc), dev(vc), dev(kc), dev(vc)
        q1 = fused_step.rope_and_cache(dev(q), dev(k), dev(v), _at(dev(cos), dev(sin), dev(pos), k1, v1), fused)
        want = fused_step.decode_attention(q1, k1, v1, dev(pos), hd**-0.5, lora)
        got = fused_step.decode_attention(
            dev(q).view(b, nh, hd),
            k2,
            v2,
            dev(pos),
            hd**-0.5,
            lora,
            rope=(dev(k), dev(v), dev(cos), dev(sin)),
            qk_norm=fused,
        )
        assert torch.equal(k2, k1) and torch.equal(v2, v1), "decode_attention(rope=, qk_norm=): cache"
        _close(got[0], want[0], tol, "decode_attention(rope=, qk_norm=): output")
        if lora is not None:
            _close(got[1], want[1], 2 * tol, "decode_attention(rope=, qk_norm=): u")
    try:
        fused_step.decode_attention(dev(q).view(b, nh, hd), dev(kc), dev(vc), dev(pos), hd**-0.5, qk_norm=fused)
        raise AssertionError("decode_attention accepted qk_norm= without rope=")
    except ValueError as err:
        assert "rope=" in str(err)


def check_7b_shapes(device: str, dtype: torch.dtype, tol: float) -> None:
    """The fused shrinks on Qwen2.5-7B shapes at decode batches 1/8/64: vs torch, and launched twice
    (bit-identical: the split reduction is deterministic and its tickets are back at zero)."""
    gen = torch.Generator().manual_seed(1)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    hidden, inter, nh, nkv, hd = 3584, 18944, 28, 4, 128
    for m in (1, 8, 64):
        h, d, w = rnd(m, hidden), rnd(m, hidden), rnd(hidden, scale=0.3) + 1
        for ranks in ([16, 16, 16], [16, 16]):
            a = rnd(sum(ranks), hidden, scale=0.05)
            group = _group(ranks, a.float())
            _, ref_x, ref_u = _ref_norm(h.float().clone(), Norm(w.float(), 1e-6), d.float(), group)
            args = (h.to(device), d.to(device), w.to(device), 1e-6, a.to(device), group.lora_bounds)
            for rb in (None, 0):  # the default (by rank up to 64 rows) and the column split
                _, x, flat = fused_step.rms_norm_shrink(*args, rb=rb)
                assert torch.equal(flat, fused_step.rms_norm_shrink(*args, rb=rb)[2]), "rms_norm_shrink not repeatable"
                _close(x, ref_x, tol, "7b rms_norm_shrink output")
                for got, want in zip(
                    LoraU.from_kernel(flat, x, group).per_projection(group), ref_u.per_projection(group), strict=True
                ):
                    _close(got, want, 2 * tol, f"7b rms_norm_shrink u (m={m}, ranks={ranks}, rb={rb})")
        g, u, a = rnd(m, inter), rnd(m, inter), rnd(16, inter, scale=0.05)
        ref_act, ref_u = _ref_silu(g.float(), u.float(), _group([16], a.float()))
        act, flat = fused_step.silu_mul_shrink(g.to(device), u.to(device), a.to(device))
        assert torch.equal(flat, fused_step.silu_mul_shrink(g.to(device), u.to(device), a.to(device))[1])
        _close(act, ref_act, tol, "7b silu_mul_shrink output")
        _close(flat.view(m, 16), ref_u.u, 2 * tol, f"7b silu_mul_shrink u (m={m})")
        s = 600
        kc, vc, q, a = rnd(m, nkv, s, hd), rnd(m, nkv, s, hd), rnd(m, nh, hd), rnd(16, nh * hd, scale=0.05)
        pos = torch.randint(0, s, (m,), generator=gen)
        ref_att, ref_u = _ref_attention(q.float(), kc.float(), vc.float(), pos, hd**-0.5, _group([16], a.float()))
        args = (q.to(device), kc.to(device), vc.to(device), pos.to(device), hd**-0.5, a.to(device))
        att, flat = fused_step.decode_attention(*args)
        assert torch.equal(flat, fused_step.decode_attention(*args)[1]), "decode_attention shrink not repeatable"
        _close(att, ref_att, tol, "7b decode_attention")
        _close(flat.view(m, 16), ref_u.u, 2 * tol, f"7b decode_attention u (m={m})")


def check_stacked_decode(device: str, dtype: torch.dtype, tol: float, ms: tuple[int, ...] = (1, 5, 16)) -> None:
    """``kernels.nvfp4_group_decode`` (one launch over row-stacked weights, segmented outputs, the
    block-diagonal LoRA expand; u row-major or segmented) vs each projection on its own in fp32."""
    from qerl import kernels, nvfp4
    from qerl.kernels import reference
    from qerl.kernels.epilogue import Epilogue

    gen = torch.Generator().manual_seed(3)
    for splits, ranks, k, bias in (((96, 32, 32), (4, 0, 6), 256, True), ((64, 96), (8, 8), 128, False)):
        n, rank = sum(splits), sum(ranks)
        w = torch.randn(n, k, generator=gen) * 0.05
        q = nvfp4.quantize(w)
        b = torch.randn(n, generator=gen) * 0.1 if bias else None
        block = torch.zeros(n, rank)
        row = col = 0
        for rows, r in zip(splits, ranks, strict=True):
            block[row : row + rows, col : col + r] = torch.randn(rows, r, generator=gen) * 0.1
            row, col = row + rows, col + r
        ends = [sum(ranks[: j + 1]) for j in range(len(ranks))]
        bounds = (ends[0], ends[1] if len(ends) > 2 else rank)
        for m in ms:
            x = torch.randn(m, k, generator=gen)
            u = torch.randn(m, rank, generator=gen) * 0.5
            want = reference.mm(x, q, Epilogue(b, u, block))
            dev = nvfp4.NVFP4Tensors(*(t.to(device) for t in (q.weight_packed, q.weight_scale, q.weight_global_scale)))
            xd, bd, blk = x.to(device, dtype), None if b is None else b.to(device, dtype), block.to(device, dtype)
            for layout, ud, ub in (
                ("row-major", u.to(device, dtype), None),
                ("segmented", reference.segment(u, bounds).to(device, dtype), bounds),
            ):
                epilogue = Epilogue(bd, ud, blk, lora_bounds=ub)
                outs = kernels.nvfp4_group_decode(xd, dev, splits, epilogue=epilogue)
                start = 0
                for j, (got, rows) in enumerate(zip(outs, splits, strict=True)):
                    assert got.is_contiguous() and got.shape == (m, rows)
                    _close(got, want[:, start : start + rows], tol, f"stacked decode {splits} m={m} {layout} part {j}")
                    start += rows
            plain = kernels.nvfp4_group_decode(xd, dev, splits, epilogue=Epilogue(bd))
            base = reference.mm(x, q, Epilogue(b))
            _close(torch.cat(plain, dim=1), base, tol, f"stacked decode without LoRA {splits} m={m}")


def check_decode_kernel(dtype: torch.dtype, tol: float) -> None:
    """The FP4 decode kernel itself (interpreter: a plain-integer nibble decode stands in for its PTX)
    vs the dequantize-then-matmul reference: split-K with tickets, K not a multiple of BK, N not a
    multiple of BN, bias and the LoRA epilogue."""
    from qerl import nvfp4
    from qerl.kernels import fp4_gemm, reference
    from qerl.kernels.epilogue import Epilogue
    from qerl.kernels.schedule import DecodeConfig

    gen = torch.Generator().manual_seed(5)
    n, k, r = 80, 288, 6
    q = nvfp4.quantize(torch.randn(n, k, generator=gen) * 0.05)
    bias, lora_b = torch.randn(n, generator=gen) * 0.1, torch.randn(n, r, generator=gen) * 0.1
    for m in (1, 5):
        x, u = torch.randn(m, k, generator=gen), torch.randn(m, r, generator=gen)
        for split in (1, 2):
            cfg = DecodeConfig(BN=32, BK=64, warps=4, stages=1, split=split)
            epilogue = Epilogue(bias.to(dtype), u.to(dtype), lora_b.to(dtype), 0.5)
            got = fp4_gemm.matmul(x.to(dtype), q, epilogue=epilogue, config=cfg)
            want = reference.mm(x, q, Epilogue(bias, u, lora_b, 0.5))
            _close(got, want, tol, f"decode kernel m={m} split={split}")


def check_finish_step(device: str) -> None:
    """The one-launch step bookkeeping vs the torch ops it replaces (exact)."""
    b, rows, seq, pad = 4, 6, 5, 99
    tok = torch.tensor([7, 3, 8, 3])
    lp = torch.tensor([-0.5, -1.0, -2.0, -3.0])
    done = torch.tensor([False, False, True, False])
    row_id = torch.tensor([2, 0, rows, 5])
    stop = torch.tensor([3, 11, -1, -1])
    step = torch.tensor([2])
    out_tok, out_lp = torch.zeros(rows + 1, seq, dtype=torch.long), torch.zeros(rows + 1, seq)
    tokens, positions = torch.zeros(b, dtype=torch.long), torch.tensor([4, 5, 6, 7])
    args = [t.to(device) for t in (tok, lp, done, row_id, stop, step, tokens, positions, out_tok, out_lp)]
    fused_step.finish_step(*args[:2], reference.StepBooks(*args[2:], pad))
    d_tok, d_lp, d_done, _, _, d_step, d_tokens, d_pos, d_out_tok, d_out_lp = (t.cpu() for t in args)
    want_tok = torch.tensor([7, 3, pad, 3])
    assert d_done.tolist() == [False, True, True, True]
    assert d_tokens.tolist() == want_tok.tolist() and d_pos.tolist() == [5, 6, 7, 8] and d_step.item() == 3
    assert d_out_tok[2, 2] == 7 and d_out_tok[0, 2] == 3 and d_out_tok[rows, 2] == pad and d_out_tok[5, 2] == 3
    assert d_out_lp[2, 2] == -0.5 and d_out_lp[rows, 2] == 0.0 and d_out_lp[5, 2] == -3.0
    assert d_out_tok.sum() == 7 + 3 + pad + 3, "nothing else written"


def _plans_run_the_kernels(engine: object) -> bool:
    """Whether every step plan the engine built binds the kernels (the fused sampler and bookkeeping), not the torch
    references: the engine checks below would pass on the references too."""
    plans = engine.step_plans.values()
    return bool(plans) and all(p.sample is not None and p.finish is not reference.finish_step for p in plans)


def check_engine_interpreted() -> None:
    """A tiny NVFP4+LoRA Llama generated through every rollout kernel (CPU tensors, interpreter)."""
    from test_rollout_engines import PROMPTS, greedy
    from tiny_models import nvfp4_lora, tiny_llama

    from qerl.kernels import backend, schedule
    from qerl.rollout import get_engine
    from qerl.rollout.native import NativeEngine

    assert backend.available(torch.zeros(1)), "run after routing CPU tensors to the kernels (see __main__)"
    model = nvfp4_lora(tiny_llama(2), group_scales=True)
    assert stack_fused_groups(model) == 4, "q/k/v and gate/up of both layers"  # the stacked group path too
    prompts = PROMPTS[:3]  # the interpreter runs every program in Python: keep the grids small
    ref = get_engine(model, 0, kind="hf").generate(prompts, greedy(8))
    runs = {}
    # RoPE and the cache write in their own kernel, then in the attention kernel: the same tokens
    for rope_in_attention in (False, True):
        with schedule.switched(rope_in_attention=rope_in_attention):
            engine = NativeEngine(model, 0, kv_block=32)
            runs[rope_in_attention] = engine.generate(prompts, greedy(8))
        assert _plans_run_the_kernels(engine)
    out, fused = runs[False], runs[True]
    assert out.completion_ids == ref.completion_ids, "interpreted kernels: greedy differs from transformers"
    assert fused.completion_ids == out.completion_ids and fused.logprobs == out.logprobs, "rope in attention"
    worst = max(
        abs(a - b) for la, lb in zip(out.logprobs, ref.logprobs, strict=True) for a, b in zip(la, lb, strict=True)
    )
    assert worst < 1e-4, worst
    check_qwen3_engine_interpreted()


def check_qwen3_engine_interpreted() -> None:
    """A tiny NVFP4+LoRA Qwen3 (q / k norms drawn around 1) through every rollout kernel, its head norms in the
    RoPE kernel and then in the attention kernel: greedy tokens equal transformers', log-probs within 1e-4."""
    from test_rollout_engines import PROMPTS, greedy
    from tiny_models import nvfp4_lora, tiny_family

    from qerl.kernels import schedule
    from qerl.rollout import get_engine
    from qerl.rollout.native import NativeEngine

    model = nvfp4_lora(tiny_family("qwen3", 3), group_scales=True)
    prompts = PROMPTS[:3]
    ref = get_engine(model, 0, kind="hf").generate(prompts, greedy(8))
    for rope_in_attention in (False, True):
        with schedule.switched(rope_in_attention=rope_in_attention):
            engine = NativeEngine(model, 0, kv_block=32)
            out = engine.generate(prompts, greedy(8))
        assert _plans_run_the_kernels(engine)
        assert out.completion_ids == ref.completion_ids, f"qwen3 (rope in attention {rope_in_attention}): greedy"
        worst = max(
            abs(a - b) for la, lb in zip(out.logprobs, ref.logprobs, strict=True) for a, b in zip(la, lb, strict=True)
        )
        assert worst < 1e-4, (rope_in_attention, worst)


if __name__ == "__main__":
    torch.set_num_threads(1)
    check_kernels("cpu", torch.float32, 1e-5)
    check_kernels("cpu", torch.float16, 2e-3)
    check_decode_kernel(torch.float16, 4e-3)
    from qerl.kernels import backend

    backend.serves = lambda device: True  # CPU tensors to the (interpreted) Triton kernels from here on
    check_stacked_decode("cpu", torch.float16, 4e-3, ms=(1, 5))
    check_engine_interpreted()
    print("rollout kernels: interpreted checks passed")
