"""Benchmark the NVFP4 Triton kernels against torch's bf16 matmul on the dequantized weight (H200).

For Qwen2.5-7B and -32B layer shapes and M in {1, 4, ..., 4096}, in one run: time (median), bytes
moved, GB/s, TFLOP/s, and the speed ratio to ``F.linear`` / ``grad_y @ W`` in bf16, plus the
device-to-device copy bandwidth measured in the same run. Every timing is a CUDA graph of R calls
that rotate over enough weight copies to overflow the 60 MB L2 (decode reads weights from HBM, as in a
real model step); the per-call time is the median replay time / R.

    python -m benchmarks.gemm --out benchmarks/results   # writes kernels.json, kernels_speedup.png
    python -m benchmarks.gemm --plot benchmarks/results/kernels.json   # only the PNG again

The decode GEMMs the Gluon kernels take are launched as the rollout engine launches them, with programmatic dependent
launch (``qerl/kernels/pdl.py``: each call's first weight loads overlap the call before it); ``time_us_no_pdl`` is the
same calls without it, in the same run.

The summary holds the targets of issue 3 for the 7B down_proj shape (N=3584, K=18944). Where vLLM is
importable (the GPU machine with the vLLM bundle on the path), every forward row also times vLLM's Marlin
NVFP4 GEMM (``apply_fp4_marlin_linear`` on weights from vLLM's own ``rand_marlin_weight_nvfp4_like``, copies
rotated like ours, its output checked against x @ its reference weight), and the summary gets the same three
decode figures for it: the issue's "Marlin-class" peer measured beside ours in one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (
    ROTATE_BYTES,
    Layer,
    command,
    copy_bandwidth,
    graph_time,
    save_figure,
    utc_now,
    versions,
    write_json,
)
from qerl.kernels import backend, schedule

#: (out_features N, in_features K) per layer: Qwen2.5-7B (hidden 3584, inter 18944, 28 q / 4 kv heads of 128)
#: and Qwen2.5-32B (hidden 5120, inter 27648, 40 q / 8 kv heads).
MODELS = {
    "qwen2.5-7b": {
        "q": (3584, 3584),
        "k": (512, 3584),
        "v": (512, 3584),
        "o": (3584, 3584),
        "gate": (18944, 3584),
        "up": (18944, 3584),
        "down": (3584, 18944),
        "qkv": (4608, 3584),
        "gate_up": (37888, 3584),
    },
    "qwen2.5-32b": {
        "q": (5120, 5120),
        "k": (1024, 5120),
        "v": (1024, 5120),
        "o": (5120, 5120),
        "gate": (27648, 5120),
        "up": (27648, 5120),
        "down": (5120, 27648),
        "qkv": (7168, 5120),
        "gate_up": (55296, 5120),
    },
}
MS = (1, 4, 16, 32, 64, 256, 1024, 4096)
SUMMARY_SHAPE = ("qwen2.5-7b", "down")


class Marlin:
    """vLLM's Marlin NVFP4 GEMM on an (n, k) weight: copies of vLLM's own repacked random NVFP4 weights (its test
    helper ``rand_marlin_weight_nvfp4_like``), enough to overflow L2 like ``Layer``'s, and one call per copy."""

    def __init__(self, n: int, k: int) -> None:
        from vllm.model_executor.layers.quantization.utils import marlin_utils, marlin_utils_fp4

        self.n, self.k, self.apply = n, k, marlin_utils_fp4.apply_fp4_marlin_linear
        self.workspace = marlin_utils.marlin_make_workspace_new(torch.device("cuda"))
        copies = max(1, -(-ROTATE_BYTES // (n * k // 2)))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        # (reference weight [k, n], packed, scales, global scale); only the first copy keeps its reference
        self.copies = [marlin_utils_fp4.rand_marlin_weight_nvfp4_like(w, 16) for _ in range(copies)]
        self.copies[1:] = [(None, *c[1:]) for c in self.copies[1:]]

    def call(self, x: torch.Tensor, copy: tuple) -> torch.Tensor:
        return self.apply(x, copy[1], copy[2], copy[3], self.workspace, self.n, self.k)

    def fns(self, x: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
        return [lambda c=c: self.call(x, c) for c in self.copies]

    def rel_err(self, x: torch.Tensor) -> float:
        """Its output against x @ the reference weight its helper returned (the check that the timed call is right)."""
        want = x.float() @ self.copies[0][0].float()
        return ((self.call(x, self.copies[0]).float() - want).abs().max() / want.abs().max()).item()


def marlin_peer(n: int, k: int) -> Marlin | None:
    """vLLM's Marlin for this shape, or None where vLLM is not importable."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    return Marlin(n, k)


def measure(layer: Layer, m: int, copy_bw: float, marlin: Marlin | None = None) -> dict:
    from qerl.kernels import fp4_gemm as fg  # Triton: GPU machines only

    n, k = layer.n, layer.k
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * n * k
    act_bytes = 2 * m * (n + k)
    row = {
        "M": m,
        "N": n,
        "K": k,
        "flops": flops,
        "fp4_weight_bytes": layer.packed_bytes,
        "bf16_weight_bytes": 2 * n * k,
        "x_in_gluon_order": fg.gluon_kernel(m, n, k, x.dtype, x.device) is not None,
    }  # Layer.fwd_fns hands x over as the engine does
    for kind, ours, base in (
        ("fwd", layer.fwd_fns(x), layer.bf16_fwd_fns(x)),
        ("bwd", layer.bwd_fns(gy), layer.bf16_bwd_fns(gy)),
    ):
        t, tb = graph_time(ours), graph_time(base)
        moved = layer.packed_bytes + act_bytes
        row[kind] = {
            "time_us": t * 1e6,
            "bytes": moved,
            "GBps": moved / t / 1e9,
            "TFLOPs": flops / t / 1e12,
            "weight_bw_fraction_of_copy": layer.packed_bytes / t / copy_bw,
            "bf16_time_us": tb * 1e6,
            "bf16_GBps": (2 * n * k + act_bytes) / tb / 1e9,
            "bf16_TFLOPs": flops / tb / 1e12,
            "speedup_vs_bf16": tb / t,
        }
    if row["x_in_gluon_order"] and schedule.SWITCHES.decode_pdl:  # the same calls launched without PDL, for the record
        with schedule.switched(decode_pdl=False):
            row["fwd"]["time_us_no_pdl"] = graph_time(layer.fwd_fns(x)) * 1e6
    if marlin is not None:
        tm, fwd = graph_time(marlin.fns(x)), row["fwd"]
        fwd.update(
            {
                "vllm_marlin_time_us": tm * 1e6,
                "vllm_marlin_weight_bw_fraction_of_copy": layer.packed_bytes / tm / copy_bw,
                "vllm_marlin_speedup_vs_bf16": fwd["bf16_time_us"] / (tm * 1e6),
                "speedup_vs_vllm_marlin": tm * 1e6 / fwd["time_us"],
                "vllm_marlin_rel_err": marlin.rel_err(x),
            }
        )
    return row


D = schedule.DecodeConfig
SWEEP = {  # configs tried on the summary shape, to pick the heuristics (docs/kernels.md)
    1: [D(), D(128, 256, 4, 3), D(128, 128, 4, 4), D(64, 256, 4, 4, x_split=False)],
    16: [D(), D(128, 128, 4, 4)],
    64: [D(), D(128, 128, 4, 4)],
}
#: The fused grad_x kernel at a prefill-sized M, against dequantize + cuBLAS (what ``matmul_t`` runs there).
BWD_SWEEP = [schedule.Config(128, 64, 128, 8, 3)]
DEQUANT_BLOCKS = ((8, 128, 4), (16, 64, 4))


def sweep(layer: Layer) -> list[dict]:
    out = []
    for m, cfgs in SWEEP.items():
        x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
        for cfg in cfgs:
            cfg = schedule.decode_config(m, layer.n, layer.k, x.device, cfg)
            out.append(
                {
                    "M": m,
                    "kind": "fwd",
                    "config": {"kernel": type(cfg).__name__, **cfg.__dict__},
                    "time_us": graph_time(layer.fwd_fns(x, cfg)) * 1e6,
                }
            )
    gy = torch.randn(4096, layer.n, device="cuda", dtype=torch.bfloat16)
    for cfg in BWD_SWEEP:
        out.append(
            {"M": 4096, "kind": "bwd", "config": cfg.__dict__, "time_us": graph_time(layer.bwd_fns(gy, cfg)) * 1e6}
        )
    out.append(
        {"M": 4096, "kind": "bwd", "config": "dequantize+cuBLAS", "time_us": graph_time(layer.dq_bwd_fns(gy)) * 1e6}
    )
    for block in DEQUANT_BLOCKS:
        out.append(
            {"M": 0, "kind": "dequantize", "config": list(block), "time_us": graph_time(layer.dequant_fns(block)) * 1e6}
        )
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, kind in zip(axes, ("fwd", "bwd"), strict=True):
        for r in {(r["model"], r["layer"]) for r in rows}:
            pts = sorted((x["M"], x[kind]["speedup_vs_bf16"]) for x in rows if (x["model"], x["layer"]) == r)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1, label=f"{r[0]} {r[1]}")
        peer = sorted(
            (x["M"], x[kind]["vllm_marlin_speedup_vs_bf16"])
            for x in rows
            if (x["model"], x["layer"]) == SUMMARY_SHAPE and "vllm_marlin_speedup_vs_bf16" in x[kind]
        )
        if peer:
            ax.plot(
                [p[0] for p in peer],
                [p[1] for p in peer],
                "k--",
                marker="x",
                ms=4,
                lw=1.2,
                label=f"vLLM Marlin NVFP4, {SUMMARY_SHAPE[0]} {SUMMARY_SHAPE[1]}",
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_title(f"NVFP4 {kind} vs torch bf16 matmul (H200)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup (bf16 time / nvfp4 time)")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)


def write(out: Path, rows: list[dict], sweep_rows: list[dict], copy_bw: float, complete: bool) -> dict:
    """kernels.json (temp file, then rename) and the speedup plot, from the rows measured so far."""
    pick = {r["M"]: r for r in rows if (r["model"], r["layer"]) == SUMMARY_SHAPE}
    summary = {
        "shape": {"model": SUMMARY_SHAPE[0], "layer": SUMMARY_SHAPE[1], "N": pick[1]["N"], "K": pick[1]["K"]},
        "copy_bw_GBps": copy_bw / 1e9,
        "m1_bw_fraction": pick[1]["fwd"]["weight_bw_fraction_of_copy"],
        **(
            {
                "m1_bw_fraction_no_pdl": pick[1]["fwd"]["weight_bw_fraction_of_copy"]
                * pick[1]["fwd"]["time_us"]
                / pick[1]["fwd"]["time_us_no_pdl"]
            }
            if "time_us_no_pdl" in pick[1]["fwd"]
            else {}
        ),
        **{
            f"m{m}_speedup_no_pdl": pick[m]["fwd"]["bf16_time_us"] / pick[m]["fwd"]["time_us_no_pdl"]
            for m in (1, 16, 64)
            if "time_us_no_pdl" in pick[m]["fwd"]
        },
        "m1_speedup": pick[1]["fwd"]["speedup_vs_bf16"],
        "m16_speedup": pick[16]["fwd"]["speedup_vs_bf16"],
        "m64_speedup": pick[64]["fwd"]["speedup_vs_bf16"],
        "m4096_fwd_ratio": pick[4096]["fwd"]["speedup_vs_bf16"],
        "m4096_bwd_ratio": pick[4096]["bwd"]["speedup_vs_bf16"],
        "m1024_fwd_ratio": pick[1024]["fwd"]["speedup_vs_bf16"],
        "m1024_bwd_ratio": pick[1024]["bwd"]["speedup_vs_bf16"],
    }
    if "vllm_marlin_time_us" in pick[1]["fwd"]:
        summary["vllm_marlin"] = {
            "m1_bw_fraction": pick[1]["fwd"]["vllm_marlin_weight_bw_fraction_of_copy"],
            **{f"m{m}_speedup": pick[m]["fwd"]["vllm_marlin_speedup_vs_bf16"] for m in (1, 16, 64)},
            **{f"ours_over_marlin_m{m}": pick[m]["fwd"]["speedup_vs_vllm_marlin"] for m in (1, 16, 64)},
        }
    result = {
        "date": utc_now(),
        "device": torch.cuda.get_device_name(),
        "versions": {**versions("triton", "vllm"), "cuda": torch.version.cuda},
        "command": command("benchmarks.gemm"),
        "method": "CUDA graph of R calls rotating over weight copies (>256 MB), median of 15 replays / R; "
        "baseline: F.linear(x, W_bf16) and grad_y @ W_bf16 on the dequantized weight, same run; "
        "copy bandwidth = max(eager copy_, in-graph SM copy kernel); decode GEMMs in the Gluon K order launched "
        "with programmatic dependent launch as the engine launches them (time_us_no_pdl: without, same run)",
        "complete": complete,
        "summary": summary,
        "sweep_7b_down": sweep_rows,
        "rows": rows,
    }
    write_json(out / "kernels.json", result, indent=1)
    plot(rows, out / "kernels_speedup.png")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="folder for kernels.json and kernels_speedup.png")
    ap.add_argument("--quick", action="store_true", help="only the summary shape (smoke run)")
    ap.add_argument("--plot", type=Path, help="only redraw the PNG beside an existing kernels.json (any machine)")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text())["rows"], args.plot.with_name("kernels_speedup.png"))
        return
    if not torch.cuda.is_available() or not backend.HAS_TRITON:
        sys.exit("benchmarks/gemm.py: needs a CUDA device and triton")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    bws = copy_bandwidth()
    copy_bw = bws["max"]
    print(f"copy bandwidth {', '.join(f'{k} {v / 1e12:.2f}' for k, v in bws.items())} TB/s", flush=True)
    rows: list[dict] = []
    sweep_rows: list[dict] = []
    # The summary shape first, and the JSON rewritten after every shape: a run cut short still reports.
    order = [SUMMARY_SHAPE] + [(m, name) for m, ls in MODELS.items() for name in ls if (m, name) != SUMMARY_SHAPE]
    if args.quick:
        order = [SUMMARY_SHAPE]
    total = len(order) * len(MS)
    done: dict[tuple[int, int], list[dict]] = {}
    summary: dict = {}
    for model, name in order:
        n, k = MODELS[model][name]
        if (n, k) not in done:  # q/o and gate/up share shapes: measure once, report under both names
            layer, marlin = Layer(n, k), marlin_peer(n, k)
            done[(n, k)] = [measure(layer, m, copy_bw, marlin) for m in MS]
            del marlin
            if (model, name) == SUMMARY_SHAPE:
                sweep_rows = sweep(layer)
                for s in sweep_rows:
                    print(f"  sweep M={s['M']:5d} {s['kind']} {s['time_us']:9.1f} us  {s['config']}", flush=True)
            layer.free()
            torch.cuda.empty_cache()
        for r in done[(n, k)]:
            rows.append({"model": model, "layer": name, **r})
            peer = f"  marlin {r['fwd']['vllm_marlin_time_us']:9.1f} us" if "vllm_marlin_time_us" in r["fwd"] else ""
            print(
                f"{model:12s} {name:8s} M={r['M']:5d}  fwd {r['fwd']['time_us']:9.1f} us x{r['fwd']['speedup_vs_bf16']:.2f}"
                f"  bwd {r['bwd']['time_us']:9.1f} us x{r['bwd']['speedup_vs_bf16']:.2f}  "
                f"wbw {r['fwd']['weight_bw_fraction_of_copy']:.2f}{peer}",
                flush=True,
            )
        summary = write(out, rows, sweep_rows, copy_bw, complete=len(rows) == total)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
