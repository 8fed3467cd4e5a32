"""The RMSNorm + LoRA shrink kernel's two splits side by side (H200): over the row's columns (``rb=0``: partials
summed by the row's last program) and over u's ranks (``rb`` ranks a program, each normalising the whole row),
with the plain RMSNorm as the floor, at the Qwen2.5-7B q/k/v (R=48) and gate/up (R=32) shapes and 1..32 rows.

Each time is a CUDA graph rotating over copies of A larger than L2 (A from DRAM, as in a decode step; the
row itself is small and comes from L2). Every by-rank setting is also checked against the column split: the
residual and the normalised row bitwise equal, u's largest difference relative to its largest value.

    python -m benchmarks.shrink --out benchmarks/results/shrink_rank_probe.json
    python -m benchmarks.shrink --rows 64 96 128 --out benchmarks/results/shrink_rank_probe_64_128.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import command, device_name, graph_time, utc_now, versions, write_json

K = 3584
SHAPES = ((48, (16, 32)), (32, (16, 32)))  # (R, lora bounds): q/k/v, gate/up at r=16
ROWS = (1, 2, 4, 8, 16, 32)


def measure(rank: int, bounds: tuple[int, int], m: int, a_copies: list[torch.Tensor], w: torch.Tensor) -> dict:
    from qerl.kernels import step_norm

    dev = w.device
    h = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
    d = torch.randn(m, K, device=dev, dtype=torch.bfloat16)

    def shrink(a: torch.Tensor, rb: int) -> tuple[torch.Tensor, ...]:
        return step_norm.rms_norm_shrink(h, d, w, 1e-6, a, bounds, gluon_k=True, rb=rb)

    ref = shrink(a_copies[0], 0)
    row = {
        "R": rank,
        "rows": m,
        "rank_block_rule": step_norm.rank_block(m, rank, K),
        "plain_norm_us": graph_time([lambda: step_norm.rms_norm(h, None, w, 1e-6, gluon_k=True)]) * 1e6,
        "column_split_us": graph_time([lambda a=a: shrink(a, 0) for a in a_copies]) * 1e6,
        "by_rank": {},
    }
    default_warps = step_norm.RANK_WARPS
    try:
        for warps in (4, 8, 16):
            step_norm.RANK_WARPS = warps
            for rb in (1, 2, 4, 8):
                got = shrink(a_copies[0], rb)
                err = ((got[2].float() - ref[2].float()).abs().max() / ref[2].float().abs().max()).item()
                row["by_rank"][f"w{warps}_rb{rb}"] = {
                    "us": graph_time([lambda a=a, rb=rb: shrink(a, rb) for a in a_copies]) * 1e6,
                    "outputs_equal": torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]),
                    "u_rel_err": err,
                }
    finally:
        step_norm.RANK_WARPS = default_warps
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="decode rows to time")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for rank, bounds in SHAPES:
        copies = max(8, (96 << 20) // (rank * K * 2))
        a_copies = [torch.randn(rank, K, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
        w = (torch.randn(K, device=dev) * 0.3 + 1).to(torch.bfloat16)
        for m in args.rows:
            row = measure(rank, bounds, m, a_copies, w)
            best = min((v["us"], k) for k, v in row["by_rank"].items())
            print(
                f"R={rank} rows={m}: plain {row['plain_norm_us']:.2f} us, columns {row['column_split_us']:.2f}, "
                f"best by rank {best[0]:.2f} ({best[1]})",
                flush=True,
            )
            rows.append(row)
    write_json(
        args.out,
        {
            "benchmark": "RMSNorm + LoRA shrink: column split vs by-rank split (us a launch)",
            "date": utc_now(),
            "device": device_name(dev),
            "versions": versions("triton"),
            "command": command("benchmarks.shrink", argv),
            "K": K,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
