"""Launch the NVFP4 decode kernel on one Qwen2.5-7B layer shape a few times, for Nsight Compute.

Timing lives in gemm.py / decode_tune.py; this script only gives `ncu` a short, clean program to
read counters from (warp stall reasons, issue-slot use, DRAM throughput) for the question the timings
cannot answer: what a K step of ``_decode_kernel`` waits on (docs/kernels.md, "What limits the decode
kernels"). On the H200 (Firecracker runtime; keep the clocks alone):

    ncu --clock-control none -k regex:_decode_kernel -s 3 -c 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section MemoryWorkloadAnalysis python3 -m benchmarks.profile_decode --shape down --m 1
"""

from __future__ import annotations

import argparse
import sys

import torch

from qerl import nvfp4

#: (N, K) of the 7B layers the decode notes discuss.
SHAPES = {"down": (3584, 18944), "gate_up": (37888, 3584), "q": (3584, 3584)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="down")
    parser.add_argument("--m", type=int, default=1, help="tokens (1..128: the decode kernel's range)")
    parser.add_argument("--launches", type=int, default=5, help="launches (skip the first ones in ncu: -s)")
    parser.add_argument(
        "--kernel",
        choices=["triton", "gluon", "direct"],
        default="triton",
        help="gluon: the Gluon kernel (x pre-permuted, as the engine hands it; ncu -k regex:_decode_gluon); "
        "direct: the mma.sync kernel for M <= 8 (fp4_direct, x pre-permuted; ncu -k regex:_direct)",
    )
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="gluon / direct: the build the engine launches (programmatic dependent launch, qerl/kernels/pdl.py: "
        "first weights loaded before griddepcontrol.wait); ncu runs kernels one at a time, so this "
        "profiles that build's instruction stream, not its overlap with the kernel before it",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/profile_decode.py: needs a CUDA device")
    from qerl.kernels import fp4_gemm as fg  # Triton: GPU machines only
    from qerl.kernels import schedule

    if not 1 <= args.m <= schedule.DECODE_MAX_M:
        sys.exit(f"benchmarks/profile_decode.py: --m: expected 1..{schedule.DECODE_MAX_M}, got {args.m}")
    n, k = SHAPES[args.shape]
    q = nvfp4.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float64).t()
    if args.kernel == "gluon":
        from qerl.kernels import fp4_gluon, gluon_layout

        xp = gluon_layout.to_gluon_k(x)
        launch = lambda: fp4_gluon.matmul(  # noqa: E731
            xp, q, gluon_k=True, pdl=args.pdl
        )
    elif args.kernel == "direct":
        from qerl.kernels import fp4_direct, gluon_layout

        xp = gluon_layout.to_gluon_k(x)
        launch = lambda: fp4_direct.matmul(xp, q, pdl=args.pdl)  # noqa: E731
    else:
        launch = lambda: fg.matmul(  # noqa: E731
            x, q, config=schedule.default_decode(args.m)
        )
    for _ in range(args.launches):
        y = launch()
    torch.cuda.synchronize()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    what = f"the {args.kernel} kernel" if args.kernel != "triton" else schedule.decode_config(args.m, n, k, x.device)
    print(f"{args.shape} N={n} K={k} M={args.m}: {args.launches} launches of {what}, rel err {err:.1e}")
    if not err < 1e-2:
        sys.exit("benchmarks/profile_decode.py: the kernel's result is off (rel err >= 1e-2)")


if __name__ == "__main__":
    main()
