"""The training pass's RMSNorm and SwiGLU, one kernel each way, with transformers' rounding.

transformers' RMSNorm is eight elementwise ops forward (the input copied to fp32, squared, averaged, rsqrt'd,
multiplied, rounded back, multiplied by the weight, and with trained fp32 norms rounded once more) and about a dozen
backward, and it leaves an fp32 copy of its input and the rounded normalised rows for the backward. ``act(gate) * up``
is two ops forward and five backward, and keeps ``act(gate)`` besides both inputs. On a 7B pass these launches and
their reads and writes of whole activations cost about as much device time as the attention (docs/performance.md),
and the kept copies are a third of what a layer saves for its backward (``qerl.train.recompute``).

Here each is one kernel forward and one backward. The norm keeps only its input and one fp32 scale per row, the
SwiGLU only its two inputs (``act(gate)`` is recomputed in the backward). The math and each rounding to the activation
dtype are transformers' (fp32 inside, rounded where its ops round: the normalised rows before the weight, the
weight's product, the gradient of the normalised rows; ``silu(gate)`` and the product), so results differ from its
only where a sum runs in another order (the row's mean of squares, the weight's gradient over rows).
``qerl.kernels.reference``'s ``rms_norm`` and ``silu_mul`` are the same math in torch, for other devices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Programs that each add up the weight gradient of a share of the rows (then summed in torch, fp32).
NORM_GRAD_PROGRAMS = 256
#: Elements per program of the SwiGLU kernels.
SWIGLU_BLOCK = 1024
#: Row elements per thread the norm kernels aim at (a 5120-wide row: 16 warps), so that a whole row's fp32 vectors
#: stay in registers instead of spilling as they would at the default 4 warps.
NORM_ELEMENTS_PER_THREAD = 16


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // (32 * NORM_ELEMENTS_PER_THREAD)))


@triton.jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols, BLOCK: tl.constexpr, WEIGHT_GRAD: tl.constexpr
):
    """Rows ``pid, pid + programs, ...``; the program's share of the weight gradient goes to ``dw_ptr[pid]``."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        if WEIGHT_GRAD:
            dw += dy * xhat.to(dx_ptr.dtype.element_ty).to(tl.float32)
        dn = (dy * w).to(dx_ptr.dtype.element_ty).to(tl.float32)  # the normalised rows' gradient, in their dtype
        dx = rstd * (dn - xhat * (tl.sum(dn * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


@triton.jit
def _silu(g):
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _swiglu_forward_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = _silu(g).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(dout_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    act = (g * sig).to(dg_ptr.dtype.element_ty).to(tl.float32)
    dact = (dout * u).to(dg_ptr.dtype.element_ty).to(tl.float32)
    tl.store(du_ptr + offs, (dout * act).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (dact * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` in ``x``'s dtype, as transformers computes it (module docstring)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        rows = _rows(x)
        y = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        if rows.shape[0]:
            block = triton.next_power_of_2(rows.shape[1])
            _rms_norm_forward_kernel[(rows.shape[0],)](
                rows, weight, y, rstd, rows.shape[1], eps, BLOCK=block, num_warps=_norm_warps(block)
            )
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = rows.shape
        grad_w = ctx.needs_input_grad[1]
        dx = torch.empty_like(rows)
        programs = max(1, min(NORM_GRAD_PROGRAMS, n_rows))
        dw = torch.empty((programs, n_cols) if grad_w else (1,), dtype=torch.float32, device=rows.device)
        if n_rows:
            block = triton.next_power_of_2(n_cols)
            _rms_norm_backward_kernel[(programs,)](
                _rows(dy),
                rows,
                weight,
                rstd,
                dx,
                dw,
                n_rows,
                n_cols,
                BLOCK=block,
                WEIGHT_GRAD=grad_w,
                num_warps=_norm_warps(block),
            )
        weight_grad = None
        if grad_w:
            weight_grad = (dw.sum(0) if n_rows else torch.zeros(n_cols, device=rows.device)).to(weight.dtype)
        return dx.view(dy.shape), weight_grad, None


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` in the inputs' dtype, as transformers computes it; keeps only gate and up."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        if gate.numel():
            grid = (triton.cdiv(gate.numel(), SWIGLU_BLOCK),)
            _swiglu_forward_kernel[grid](gate, up, out, gate.numel(), BLOCK=SWIGLU_BLOCK)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        if gate.numel():
            grid = (triton.cdiv(gate.numel(), SWIGLU_BLOCK),)
            _swiglu_backward_kernel[grid](dout.contiguous(), gate, up, dg, du, gate.numel(), BLOCK=SWIGLU_BLOCK)
        return dg, du


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused RMSNorm (differentiable in ``x`` and ``weight``), its output in ``x``'s dtype."""
    return RMSNormFunction.apply(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fused ``silu(gate) * up`` (differentiable in both)."""
    return SwiGLUFunction.apply(gate, up)
