"""Pick the NVFP4 decode-kernel schedule (M <= 64) and the dequantize block, in one device call.

For the Qwen2.5-7B down_proj (N=3584, K=18944) and gate_up (N=37888, K=3584) shapes and
M in {1, 16, 64} (gate_up: {1, 16}): every candidate ``DecodeConfig`` is first checked against a float64 product on
the dequantized weight (NaN-poisoned output, fresh random x), then timed the way
benchmarks/gemm.py times (CUDA graph over rotating weight copies > L2, median), beside torch's
bf16 ``F.linear`` on the dequantized weight in the same run. Then the dequantize kernel's blocks
(bitwise against ``nvfp4.dequantize``) and the M=1024 dequantize + cuBLAS path.

The schedule with the least time summed over every (shape, M) is printed as a ``QERL_DECODE_CONFIG``
value (``--env-file`` writes it), so the model-level benchmarks can run with it on the same machine
before it becomes the code's default. (The kernel addresses the weight through (row, K step, tile)
strides, so another weight order can be a candidate here without a new kernel; docs/kernels.md lists
the orders measured.)

    python -m benchmarks.decode_tune --out $OUT            # prints a table, writes decode_tune.json
    python -m benchmarks.decode_tune --quick --out $OUT    # no dequantize rows (~2-3 min)
    python -m benchmarks.decode_tune --splits --out $OUT   # split-K sweep, 7B/32B shapes -> decode_splits.json
    python -m benchmarks.decode_tune --gluon --out $OUT    # the Gluon candidate vs the Triton kernel -> decode_gluon.json
    python -m benchmarks.decode_tune --gluon-splits --out $OUT  # its split-K counts at M = 64 / 128 -> decode_gluon_splits.json
    python -m benchmarks.decode_tune --direct-splits [--engine-ab] --out $OUT  # the mma.sync kernel's -> direct_splits.json

``--gluon`` times each 7B decode GEMM at M = 1 / 8 / 16 / 32 / 64 / 128 with the Triton decode kernel (its
default schedule), the Gluon kernel (``qerl.kernels.fp4_gluon``: TMA producer warp, wgmma consumer
warpgroup) with x permuted inside the call, the same on an x already in that order (as the rollout
engine's producers write it), and at M <= 8 the mma.sync kernel (``qerl.kernels.fp4_direct``) on that x,
each checked against float64, side by side in one run.

``--splits`` times the default schedule at every distinct split-K count on each decode GEMM of the
7B and 32B shapes (q/k/v and gate/up fused, as the engine runs them), M = 1 and 64, checked against
float64 like the rest: the data for choosing split from the shape (wave quantization, docs/kernels.md).

``--direct-splits`` does the same for the mma.sync kernel (``fp4_direct``, x pre-permuted) at M = 1 / 8, without and
with a LoRA epilogue of the engine's rank for each GEMM (``DIRECT_RANKS``), on every 7B / 32B decode GEMM that kernel
takes (not 32B down: ``fp4_direct.refills``); ``--engine-ab`` then times the 7B engine (b = 1 / 8, 256 tokens) with
``decode_split``'s splits / the sweep's best split per (GEMM, M) where it beat them by > 2% (``split_table``) /
``decode_split``'s again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Layer, command, copy_bandwidth, graph_time, utc_now, write_json
from qerl import nvfp4
from qerl.kernels import fp4_gemm as fg
from qerl.kernels import schedule

SHAPES = {"down": (3584, 18944), "gate_up": (37888, 3584)}
#: (N, K) of every decode GEMM of a Qwen2.5 layer, q/k/v and gate/up fused as the rollout engine runs them.
MODEL_SHAPES = {
    "7b_qkv": (4608, 3584),
    "7b_o": (3584, 3584),
    "7b_gate_up": (37888, 3584),
    "7b_down": (3584, 18944),
    "32b_qkv": (7168, 5120),
    "32b_o": (5120, 5120),
    "32b_gate_up": (55296, 5120),
    "32b_down": (5120, 27648),
}
MS = {"down": (1, 16, 64), "gate_up": (1, 16)}
D = schedule.DecodeConfig
#: Schedules around the default (BN=64 BK=256 w4 s3; split from ``schedule.decode_split``). Shared memory per stage is
#: ~BN*BK*9/16 B of weight + scales and 16*BK*2 B of x (BM*BK*2 at larger M), so fewer/smaller stages
#: fit more programs per SM. A sweep of them found a fixed cost per K step that 3-4 programs per SM
#: do not hide; the candidates below test more programs per SM and two warpgroups sharing one x tile.
CANDIDATES = {
    "n64k256w4s3": D(64, 256, 4, 3),
    "n64k256w4s3_rep": D(64, 256, 4, 3),  # same config again: the run-to-run spread
    "n64k256w4s4": D(64, 256, 4, 4),  # one more stage: more loads in flight, fewer programs per SM
    "n64k512w4s3": D(64, 512, 4, 3),
    "n64k128w4s3": D(64, 128, 4, 3),
    "n128k256w8s3": D(128, 256, 8, 3),  # two warpgroups, 64 rows each, one shared x tile
    "n128k256w8s4": D(128, 256, 8, 4),
}
#: ``--large``: schedules for the batches GRPO decodes (M = 64 and 128; BM = 64, 128; M = 16 for reference). At BM=64 the default
#: holds 238 registers and 117 KB of shared memory, so one 4-warp program per SM issues on 25% of cycles
#: (Nsight Compute, docs/kernels.md): eight warps (two warpgroups: over 128 weight rows sharing one x tile, or over the
#: tokens of 64 rows) and BK=128 (half the x tile and registers) are what can fill an SM there.
LARGE_CANDIDATES = {
    "n64k256w4s3": D(64, 256, 4, 3),
    "n64k128w4s3": D(64, 128, 4, 3),
    "n64k128w4s4": D(64, 128, 4, 4),
    "n64k256w8s3": D(64, 256, 8, 3),
    "n64k128w8s3": D(64, 128, 8, 3),
    "n64k128w8s4": D(64, 128, 8, 4),
    "n64k128w8s3_r8": D(64, 128, 8, 3, resident=8),  # 116 registers, 61 KB at BM=64: two programs per SM
    "n64k64w8s4": D(64, 64, 8, 4),
    "n128k256w8s3": D(128, 256, 8, 3),
    "n128k128w8s3": D(128, 128, 8, 3),
    "n128k128w8s3_r8": D(128, 128, 8, 3, resident=8),  # 120 registers, 67 KB at BM=64: two per SM
    "n128k128w8s4": D(128, 128, 8, 4),
    "n128k64w8s4": D(128, 64, 8, 4),
    "n256k128w8s3": D(256, 128, 8, 3),
}
LARGE_MS = (16, 64, 128)
#: ``--gluon``: the token counts of the A/B (BM = 16 / 16 / 32 / 64 / 128).
GLUON_MS = (1, 8, 16, 32, 64, 128)
LARGE_SHAPES = ("7b_qkv", "7b_o", "7b_gate_up", "7b_down")
#: The code's default schedule among the candidates (the baseline of ``best_overall``).
DEFAULT = next(name for name, cfg in CANDIDATES.items() if cfg == D())


DEQUANT_BLOCKS = ((16, 64, 4), (32, 32, 4), (8, 128, 4))


#: Relative error against float64 above which a candidate's time does not count (NaN never counts).
MAX_REL_ERR = 1e-2
#: LoRA ranks of each decode GEMM as the rollout engine stacks them at r16 (q/k/v 3 x 16, gate/up 2 x 16).
DIRECT_RANKS = {"qkv": 48, "o": 16, "gate_up": 32, "down": 16}
#: How much faster than ``decode_split``'s choice a split must be for ``split_table`` to take it (the sweep's noise).
TABLE_MARGIN = 0.02


def launched_split(k_steps: int, split: int) -> int:
    """The slices a launch over ``k_steps`` K steps asked for ``split`` really runs: ceil(k / ceil(k / split))."""
    return -(-k_steps // -(-k_steps // split))


def distinct_splits(k_steps: int, most: int = 64) -> list[int]:
    """The split-K counts a launch over ``k_steps`` K steps really runs (``launched_split``), asked for up to ``most``."""
    return sorted({launched_split(k_steps, s) for s in range(1, min(most, k_steps) + 1)})


def usable_us(row: dict) -> float:
    """A checked row's time, or inf where the candidate failed or missed ``MAX_REL_ERR``: a candidate
    that computes the wrong thing (or breaks the launches after it) cannot win a sweep."""
    return row["us"] if "us" in row and row.get("rel_err", float("nan")) < MAX_REL_ERR else float("inf")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def decode_rows(layer: Layer, shape: str, ms: tuple[int, ...], candidates: dict = CANDIDATES) -> list[dict]:
    """Every candidate at every M: checked against float64 (NaN-poisoned output), then timed (and, at M > 64,
    the dequantize + cuBLAS path beside them)."""
    q0 = layer.q[0]
    w64 = nvfp4.dequantize(q0.weight_packed, q0.weight_scale, q0.weight_global_scale, torch.float64)
    rows = []
    for m in ms:
        x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ w64.t()
        base = graph_time(layer.bf16_fwd_fns(x)) * 1e6
        if m > 64:
            t = graph_time(layer.dq_fwd_fns(x)) * 1e6
            rows.append(
                {"shape": shape, "M": m, "cand": "dequantize+cuBLAS", "bf16_us": base, "us": t, "speedup": base / t}
            )
            print(f"{shape:8s} M={m:3d} dequantize+cuBLAS {t:8.1f} us  x{base / t:.2f}", flush=True)
        for name, cfg in candidates.items():
            resolved = schedule.decode_config(m, layer.n, layer.k, x.device, cfg)
            row = {"shape": shape, "M": m, "cand": name, "config": resolved.__dict__, "bf16_us": base}
            try:
                y = torch.full((m, layer.n), float("nan"), device="cuda", dtype=torch.bfloat16)
                fg.matmul(x, q0, out=y, config=cfg)
                torch.cuda.synchronize()
                row["rel_err"] = rel(y, ref)
                fns = [lambda q=q, cfg=cfg, x=x: fg.matmul(x, q, config=cfg) for q in layer.q]
                t = graph_time(fns) * 1e6
                row.update(us=t, speedup=base / t, wbw_TBps=layer.packed_bytes / t / 1e6)
            except Exception as e:  # a candidate that fails to compile or run is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(
                f"{shape:8s} M={m:3d} {name:26s} split={row['config']['split']:3d} "
                + (
                    f"ERR {row['error'][:120]}"
                    if "error" in row
                    else f"{row['us']:8.1f} us  x{row['speedup']:.2f}  {row['wbw_TBps']:.2f} TB/s  err {row['rel_err']:.1e}  (bf16 {base:.1f})"
                ),
                flush=True,
            )
    return rows


def gluon_rows(layer: Layer, shape: str, ms: tuple[int, ...]) -> list[dict]:
    """``--gluon``: the Triton decode kernel, the Gluon TMA/wgmma kernel (x permuted in the call / beforehand)
    and, at M <= 8, the mma.sync kernel (``fp4_direct``, x permuted beforehand)."""
    from qerl.kernels import fp4_direct, fp4_gluon, gluon_layout

    q0 = layer.q[0]
    w64 = nvfp4.dequantize(q0.weight_packed, q0.weight_scale, q0.weight_global_scale, torch.float64)
    rows = []
    for m in ms:
        x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
        xp = gluon_layout.to_gluon_k(x)
        ref = x.double() @ w64.t()
        base = graph_time(layer.bf16_fwd_fns(x)) * 1e6
        calls = {
            "triton": lambda q, x=x: fg.matmul(x, q),
            "gluon": lambda q, x=x: fp4_gluon.matmul(x, q),
            "gluon_prepermuted": lambda q, xp=xp: fp4_gluon.matmul(xp, q, gluon_k=True),
        }
        if fp4_direct.supports(m, layer.k, x.dtype, x.device):
            calls["direct_prepermuted"] = lambda q, xp=xp: fp4_direct.matmul(xp, q)
        for name, call in calls.items():
            row = {"shape": shape, "M": m, "cand": name, "bf16_us": base}
            try:
                row["rel_err"] = rel(call(q0), ref)
                t = graph_time([lambda q=q, call=call: call(q) for q in layer.q]) * 1e6
                row.update(us=t, speedup=base / t, wbw_TBps=layer.packed_bytes / t / 1e6)
            except Exception as e:  # a candidate that fails to compile or run is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(
                f"{shape:10s} M={m:3d} {name:18s} "
                + (
                    f"ERR {row['error'][:160]}"
                    if "error" in row
                    else f"{row['us']:8.1f} us  x{row['speedup']:.2f}  {row['wbw_TBps']:.2f} TB/s  err {row['rel_err']:.1e}"
                ),
                flush=True,
            )
    return rows


def gluon_split_rows(layer: Layer, shape: str, ms: tuple[int, ...] = (64, 128)) -> list[dict]:
    """``--gluon-splits``: the Gluon kernel (x pre-permuted, as the engine hands it) at each distinct
    split-K count up to 16 and at its default (``decode_split`` over ``fp4_gluon.SCHEDULE``'s residency)."""
    from qerl.kernels import fp4_gluon, gluon_layout

    q0 = layer.q[0]
    w64 = nvfp4.dequantize(q0.weight_packed, q0.weight_scale, q0.weight_global_scale, torch.float64)
    splits = distinct_splits(layer.k // fp4_gluon.BK, 16)
    rows = []
    for m in ms:
        x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
        xp, ref = gluon_layout.to_gluon_k(x), x.double() @ w64.t()
        for split in (0, *splits):

            def call(q: nvfp4.NVFP4Tensors, xp: torch.Tensor = xp, split: int = split) -> torch.Tensor:
                return fp4_gluon.matmul(xp, q, gluon_k=True, split=split)

            t = graph_time([lambda q=q, call=call: call(q) for q in layer.q]) * 1e6
            rows.append(
                {
                    "shape": shape,
                    "N": layer.n,
                    "K": layer.k,
                    "M": m,
                    "split": split or "default",
                    "us": t,
                    "rel_err": rel(call(q0), ref),
                    "wbw_TBps": layer.packed_bytes / t / 1e6,
                }
            )
            print(
                f"{shape:10s} M={m:3d} split={split or 'default'!s:8s} {t:8.1f} us  err {rows[-1]['rel_err']:.1e}",
                flush=True,
            )
    return rows


def split_rows(layer: Layer, shape: str, ms: tuple[int, ...] = (1, 64)) -> list[dict]:
    """The default schedule at every distinct split-K count (1..64) of ``layer``: checked, timed."""
    q0 = layer.q[0]
    w64 = nvfp4.dequantize(q0.weight_packed, q0.weight_scale, q0.weight_global_scale, torch.float64)
    k_steps = -(-layer.k // D().BK)
    splits = distinct_splits(k_steps)
    rows = []
    for m in ms:
        asked = schedule.decode_config(m, layer.n, layer.k, torch.device("cuda")).split
        default = launched_split(k_steps, asked)
        x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ w64.t()
        for split in splits:
            cfg = schedule.DecodeConfig(split=split)
            y = fg.matmul(x, q0, config=cfg)
            fns = [lambda q=q, x=x, cfg=cfg: fg.matmul(x, q, config=cfg) for q in layer.q]
            t = graph_time(fns) * 1e6
            rows.append(
                {
                    "shape": shape,
                    "N": layer.n,
                    "K": layer.k,
                    "M": m,
                    "split": split,
                    "default": split == default,
                    "us": t,
                    "rel_err": rel(y, ref),
                    "wbw_TBps": layer.packed_bytes / t / 1e6,
                }
            )
        mine = [r for r in rows if r["M"] == m]
        best = min(mine, key=lambda r: r["us"])
        dflt = next(r for r in mine if r["default"])
        print(
            f"{shape:12s} M={m:3d} default split {default:3d} {dflt['us']:7.1f} us | best split {best['split']:3d} "
            f"{best['us']:7.1f} us | " + " ".join(f"{r['split']}:{r['us']:.1f}" for r in mine),
            flush=True,
        )
    return rows


def direct_split_rows(layer: Layer, shape: str, ms: tuple[int, ...] = (1, 8)) -> list[dict]:
    """``--direct-splits``: the mma.sync kernel at every distinct split of ``layer``, without and with the LoRA
    epilogue of the engine's rank for this GEMM (dense u and B), x pre-permuted: checked against float64, timed."""
    from qerl.kernels import fp4_direct as fd
    from qerl.kernels import gluon_layout

    q0 = layer.q[0]
    w64 = nvfp4.dequantize(q0.weight_packed, q0.weight_scale, q0.weight_global_scale, torch.float64)
    tiles, k_steps, slots = fd.launch_shape(layer.n, layer.k, w64.device)
    default = launched_split(k_steps, schedule.decode_split(tiles, k_steps, slots, fd.PROGRAM_STEPS))
    rank = DIRECT_RANKS[shape.split("_", 1)[1]]
    rows = []
    for m in ms:
        x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
        xp = gluon_layout.to_gluon_k(x)
        u = torch.randn(m, rank, device="cuda", dtype=torch.bfloat16) * 0.1
        b = torch.randn(layer.n, rank, device="cuda", dtype=torch.bfloat16) * 0.01
        for lora in (False, True):
            ref = x.double() @ w64.t() + (0.5 * (u.double() @ b.double().t()) if lora else 0.0)
            extra = {"lora_u": u, "lora_b": b, "lora_scale": 0.5} if lora else {}
            for split in distinct_splits(k_steps):

                def call(
                    q: nvfp4.NVFP4Tensors, split: int = split, extra: dict = extra, xp: torch.Tensor = xp
                ) -> torch.Tensor:
                    return fd.matmul(xp, q, split=split, **extra)

                err = rel(call(q0), ref)
                t = graph_time([lambda q=q, call=call: call(q) for q in layer.q]) * 1e6
                steps = -(-k_steps // split)
                rows.append(
                    {
                        "shape": shape,
                        "N": layer.n,
                        "K": layer.k,
                        "M": m,
                        "lora": lora,
                        "split": split,
                        "default": split == default,
                        "us": t,
                        "rel_err": err,
                        "steps": steps,
                        "ring": steps > fd.MAX_STEPS,
                    }
                )
            mine = [r for r in rows if r["M"] == m and r["lora"] == lora]
            print(
                f"{shape:12s} M={m} lora={int(lora)} "
                + " ".join(f"{r['split']}:{r['us']:.2f}" + "*" * r["default"] for r in mine),
                flush=True,
            )
    return rows


def split_table(rows: list[dict], margin: float = TABLE_MARGIN) -> dict[tuple[int, int, int], int]:
    """``(N, K, M) -> split`` from ``direct_split_rows``' LoRA rows (the engine always runs the epilogue): the fastest
    accurate split of each GEMM and M where it beat ``decode_split``'s by more than ``margin``."""
    table = {}
    for key in sorted({(r["N"], r["K"], r["M"]) for r in rows if r["lora"]}):
        mine = [r for r in rows if r["lora"] and (r["N"], r["K"], r["M"]) == key]
        best = min(mine, key=usable_us)
        default = next(r for r in mine if r["default"])
        if usable_us(best) < (1 - margin) * default["us"]:
            table[key] = best["split"]
    return table


def with_split_table(
    matmul: Callable[..., torch.Tensor], table: dict[tuple[int, int, int], int]
) -> Callable[..., torch.Tensor]:
    """``fp4_direct.matmul`` (passed in, so a patched module attribute never calls itself) launching each ``(N, K, M)``
    of ``table`` at its split where the caller left the split to ``decode_split``."""

    def launch(x: torch.Tensor, weight: nvfp4.NVFP4Tensors, *, split: int = 0, **kwargs: Any) -> torch.Tensor:
        if split == 0:
            split = table.get((weight.out_features, x.shape[1], x.shape[0]), 0)
        return matmul(x, weight, split=split, **kwargs)

    return launch


def dequant_rows(layer: Layer, bw: float) -> list[dict]:
    q0 = layer.q[0]
    ref = nvfp4.dequantize(q0.weight_packed, q0.weight_scale, q0.weight_global_scale, torch.bfloat16)
    moved = layer.packed_bytes + 2 * layer.n * layer.k
    rows = []
    for block in DEQUANT_BLOCKS:
        row = {"block": list(block)}
        try:
            w = fg.dequantize(q0, block=block)
            row["max_abs_diff"] = (w.float() - ref.float()).abs().max().item()
            t = graph_time(layer.dequant_fns(block)) * 1e6
            row.update(us=t, TBps=moved / t / 1e6, frac_of_copy=moved / (t * 1e-6) / bw)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(
            f"dequant {block}: "
            + (
                row.get("error", "")[:150]
                or f"{row['us']:.1f} us {row['TBps']:.2f} TB/s ({row['frac_of_copy']:.2f} of copy) maxdiff {row['max_abs_diff']:.2e}"
            ),
            flush=True,
        )
    for m in (1024,):
        x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
        gy = torch.randn(m, layer.n, device="cuda", dtype=torch.bfloat16)
        r = {
            "M": m,
            "fwd_us": graph_time(layer.dq_fwd_fns(x)) * 1e6,
            "bf16_fwd_us": graph_time(layer.bf16_fwd_fns(x)) * 1e6,
            "bwd_us": graph_time(layer.dq_bwd_fns(gy)) * 1e6,
            "bf16_bwd_us": graph_time(layer.bf16_bwd_fns(gy)) * 1e6,
        }
        r["fwd_ratio"], r["bwd_ratio"] = r["bf16_fwd_us"] / r["fwd_us"], r["bf16_bwd_us"] / r["bwd_us"]
        rows.append(r)
        print(
            f"M={m} dequant+cuBLAS fwd {r['fwd_us']:.1f} us (x{r['fwd_ratio']:.2f}), bwd {r['bwd_us']:.1f} us (x{r['bwd_ratio']:.2f})",
            flush=True,
        )
    return rows


def direct_splits(result: dict, out: Path, engine: bool) -> None:
    """``--direct-splits`` (and ``--engine-ab``): the sweep into direct_splits.json, then the engine A/B/A of its table."""
    from benchmarks import rollout_ab
    from qerl.kernels import fp4_direct as fd

    result["splits"] = []
    for shape in [s for s in MODEL_SHAPES if s != "32b_down"]:
        layer = Layer(*MODEL_SHAPES[shape])
        result["splits"] += direct_split_rows(layer, shape)
        layer.free()
        torch.cuda.empty_cache()
        write_json(out / "direct_splits.json", result, indent=1)
    table = split_table(result["splits"])
    result["table"] = [{"N": n, "K": k, "M": m, "split": s} for (n, k, m), s in table.items()]
    write_json(out / "direct_splits.json", result, indent=1)
    print("split table:", result["table"], flush=True)
    if engine and table:
        args = argparse.Namespace(shapes=["7b"], batches=[1, 8], tokens=256)
        ab = rollout_ab.engine_ab(
            args, "decode_split", [], "table", [(fd, "matmul", with_split_table(fd.matmul, table))]
        )
        write_json(out / "direct_splits_engine_ab.json", {**ab, "command": result["command"], "table": result["table"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="folder for decode_tune.json")
    ap.add_argument("--quick", action="store_true", help="no dequantize / M=1024 rows")
    ap.add_argument("--splits", action="store_true", help="only the split-K sweep (decode_splits.json)")
    ap.add_argument(
        "--large",
        action="store_true",
        help="only the M = 16 / 64 / 128 schedules on the 7B GEMMs (decode_tune_large.json)",
    )
    ap.add_argument("--env-file", type=Path, help="write the best schedule here as a QERL_DECODE_CONFIG value")
    ap.add_argument(
        "--gluon", action="store_true", help="only the Gluon candidate vs the Triton kernel (decode_gluon.json)"
    )
    ap.add_argument(
        "--gluon-splits", action="store_true", help="only the Gluon kernel's split-K sweep (decode_gluon_splits.json)"
    )
    ap.add_argument(
        "--direct-splits", action="store_true", help="only the mma.sync kernel's split-K sweep (direct_splits.json)"
    )
    ap.add_argument(
        "--engine-ab", action="store_true", help="with --direct-splits: the 7B engine with the sweep's split table"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_tune.py: needs a CUDA device")
    torch.manual_seed(0)
    bw = copy_bandwidth()["max"]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    result = {
        "date": utc_now(),
        "device": torch.cuda.get_device_name(),
        "command": command("benchmarks.decode_tune"),
        "copy_bw_GBps": bw / 1e9,
        "decode": [],
        "dequant": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.splits:
        result["splits"] = []
        for shape, (n, k) in MODEL_SHAPES.items():
            layer = Layer(n, k)
            result["splits"] += split_rows(layer, shape)
            layer.free()
            torch.cuda.empty_cache()
            write_json(out / "decode_splits.json", result, indent=1)
        return
    if args.direct_splits:
        direct_splits(result, out, args.engine_ab)
        return
    if args.gluon_splits:
        result["splits"] = []
        for shape in LARGE_SHAPES:
            layer = Layer(*MODEL_SHAPES[shape])
            result["splits"] += gluon_split_rows(layer, shape)
            layer.free()
            torch.cuda.empty_cache()
            write_json(out / "decode_gluon_splits.json", result, indent=1)
        return
    if args.large or args.gluon:
        cands, ms, name = (
            (("triton", "gluon", "gluon_prepermuted", "direct_prepermuted"), GLUON_MS, "decode_gluon.json")
            if args.gluon
            else (LARGE_CANDIDATES, LARGE_MS, "decode_tune_large.json")
        )
        for shape in LARGE_SHAPES:
            layer = Layer(*MODEL_SHAPES[shape])
            result["decode"] += gluon_rows(layer, shape, ms) if args.gluon else decode_rows(layer, shape, ms, cands)
            layer.free()
            torch.cuda.empty_cache()
            write_json(out / name, result, indent=1)
        for m in ms:
            mine = {
                cand: [usable_us(r) for r in result["decode"] if r["cand"] == cand and r["M"] == m] for cand in cands
            }
            total = {
                cand: sum(us) for cand, us in mine.items() if us
            }  # inf where a candidate failed or was wrong anywhere
            print(
                f"M={m}: summed over {LARGE_SHAPES}: "
                + ", ".join(f"{k} {v:.1f}" for k, v in sorted(total.items(), key=lambda kv: kv[1]))
            )
        return
    for shape, (n, k) in SHAPES.items():
        layer = Layer(n, k)
        result["decode"] += decode_rows(layer, shape, MS[shape])
        if shape == "down" and not args.quick:
            result["dequant"] = dequant_rows(layer, bw)
        layer.free()
        torch.cuda.empty_cache()
        write_json(out / "decode_tune.json", result, indent=1)
    best = {}
    for r in result["decode"]:
        if usable_us(r) < float("inf"):
            key = (r["shape"], r["M"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    print("best per shape/M:")
    for (shape, m), r in sorted(best.items()):
        print(f"  {shape:8s} M={m:3d} {r['cand']:26s} {r['us']:7.1f} us x{r['speedup']:.2f} {r['wbw_TBps']:.2f} TB/s")
    # One schedule for whole models: the candidate with the least total time over every (shape, M)
    # measured (a candidate that failed or was inaccurate anywhere is out).
    keys = {(r["shape"], r["M"]) for r in result["decode"]}
    total: dict[str, float] = {}
    for name in CANDIDATES:
        us = [usable_us(r) for r in result["decode"] if r["cand"] == name]
        if len(us) == len(keys) and max(us) < float("inf"):
            total[name] = sum(us)
    if total:
        name = min(total, key=total.get)
        cfg = CANDIDATES[name]
        env = f"BN={cfg.BN},BK={cfg.BK},warps={cfg.warps},stages={cfg.stages},resident={cfg.resident}"
        result["best_overall"] = {
            "cand": name,
            "total_us": total[name],
            "QERL_DECODE_CONFIG": env,
            "default_total_us": total.get(DEFAULT),
        }
        print(f"best overall: {name} ({total[name]:.1f} us summed; default {total.get(DEFAULT, float('nan')):.1f})")
        print(f"QERL_DECODE_CONFIG={env}")
        if args.env_file:
            args.env_file.write_text(env + "\n")
        write_json(out / "decode_tune.json", result, indent=1)


if __name__ == "__main__":
    main()
