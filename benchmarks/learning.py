"""Does the quantization method decide how much an NVFP4 LoRA run learns? A controlled, seeded comparison.

    python -m benchmarks.learning --out runs/learning --seeds 0 1 2 [--steps 200] [--best-method gptq]
                                  [--arms bf16 dequant rtn best qerl] [--run-timeout S] [-- extra qerl.train.run flags]
    python -m benchmarks.learning --out runs/learning --aggregate-only    # tables and plot from finished seeds

Five arms on the embedded SmolLM2-135M, all with the training setup of ``training/compare_smollm2.sh``
(arithmetic, 200 held-out questions, greedy accuracy before and after; that script is what runs
them, one call per seed, the arms side by side):

* ``bf16``: LoRA on the source bf16 weights;
* ``dequant``: LoRA on the rtn NVFP4 weights dequantized to bf16 (dense code path, 4-bit values);
* ``rtn``: NVFP4 + LoRA, round-to-nearest weights (what the reference does);
* ``best``: NVFP4 + LoRA on ``--best-method`` weights (gptq by default, or a prepared ``--best-dir``);
* ``qerl``: ``best`` plus AQN, i.e. QeRL on the better weights.

Seeds are paired: within a seed every arm gets the same data order, held-out set and sampling seed,
so arm differences are measured within seeds. Each arm's held-out accuracy before, after and gain is
reported as mean and standard error over seeds, with each arm's gain relative to the bf16 arm's (the
ratio of mean gains; its standard error by the delta method with the paired covariance).

Checkpoints are made once under ``OUT/checkpoints`` (gptq needs llm-compressor, the ``quantize``
extra); a seed whose ``OUT/seed<S>/results.json`` lists every arm with exit 0 is not run again, so
the seeds can go to separate calls (the GPU machine's 10-minute command limit) and a last
``--aggregate-only`` writes ``OUT/learning.json`` and ``OUT/learning.png`` (mean reward per step
with its standard-error band, and held-out accuracy before/after).

CPU smoke (about 7 minutes on 2 cores; extra flags after ``--`` override compare_smollm2.sh's):

    python -m benchmarks.learning --out /tmp/learn --seeds 0 1 --steps 2 --best-method mse -- --num-samples 40 \
        --heldout 4 --heldout-max-tokens 16 --per-device-train-batch-size 4 --num-generations 2 --max-completion-length 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import command, device_name, run_stoppable, save_figure, utc_now, versions, write_json
from qerl.fsutil import atomic_directory, atomic_write_text
from qerl.train.plot import read_run

ROOT = Path(__file__).resolve().parents[1]
COMPARE = ROOT / "training" / "compare_smollm2.sh"
#: arm -> (run name in compare_smollm2.sh, label)
ARMS = {
    "bf16": ("bf16_lora", "bf16 + LoRA"),
    "dequant": ("dequant_lora", "bf16 + LoRA on dequantized rtn weights"),
    "rtn": ("nvfp4_lora", "NVFP4 rtn + LoRA"),
    "best": ("best_lora", "NVFP4 {best} + LoRA"),
    "qerl": ("qerl_best_aqn", "QeRL: NVFP4 {best} + LoRA + AQN"),
}


def dequantized_copy(src: Path, out: Path) -> Path:
    """``src``'s NVFP4 weights as a dense bf16 checkpoint: ``qerl.export``'s merge with no adapter."""
    from qerl.export import Adapter, merge_to_dense

    with atomic_directory(out) as tmp:
        merge_to_dense(src, Adapter(src), tmp)
    return out


def prepare(
    out: Path, arms: list[str], best_method: str, best_dir: Path | None, bf16_dir: Path | None
) -> dict[str, Path]:
    """The checkpoints the seeds share (bf16 source, rtn, its dequantized copy, the best method's),
    made once under ``out/checkpoints``, and only those the ``arms`` need."""
    from qerl.hub import embedded_model_dir
    from qerl.quantize.pipeline import quantize_checkpoint

    root = out / "checkpoints"
    dirs = {
        "bf16": bf16_dir or embedded_model_dir(),
        "rtn": root / "rtn",
        "dequant": root / "rtn-dequantized",
        "best": best_dir or root / best_method,
    }
    if {"rtn", "dequant"} & set(arms) and not (dirs["rtn"] / "config.json").exists():
        quantize_checkpoint(dirs["bf16"], dirs["rtn"])
    if "dequant" in arms and not (dirs["dequant"] / "config.json").exists():
        dequantized_copy(dirs["rtn"], dirs["dequant"])
    if {"best", "qerl"} & set(arms) and not (dirs["best"] / "config.json").exists():
        quantize_checkpoint(dirs["bf16"], dirs["best"], method=best_method)
    return dirs


def seed_rows(seed_dir: Path) -> dict[str, dict]:
    """run name -> compare_smollm2.sh's results.json row, for one seed (empty before it ran)."""
    path = seed_dir / "results.json"
    return {r["run"]: r for r in json.loads(path.read_text())} if path.exists() else {}


def seed_call(
    seed_dir: Path,
    seed: int,
    runs: list[str],
    dirs: dict[str, Path],
    steps: int,
    run_timeout: int | None,
    extra: list[str],
) -> tuple[list[str], dict[str, str]] | None:
    """The compare_smollm2.sh call (command, environment) that runs ``runs`` side by side with ``--seed seed``
    into ``seed_dir``, leaving out the runs that finished (exit 0) in an earlier call; None when none is left.
    The call is recorded in ``seed_dir/calls.json`` before it starts."""
    earlier = seed_rows(seed_dir)
    pending = [r for r in runs if earlier.get(r, {}).get("exit_code") != 0]
    if not pending:
        return None
    env = {
        **os.environ,
        "BF16_DIR": str(dirs["bf16"]),
        "NVFP4_DIR": str(dirs["rtn"]),
        "DEQUANT_DIR": str(dirs["dequant"]),
        "BEST_DIR": str(dirs["best"]),
        "QERL_OUT": str(seed_dir),
        "STEPS": str(steps),
        "PYTHON": sys.executable,
        "RUNS": " ".join(pending),
    }
    if run_timeout:
        env["RUN_TIMEOUT"] = str(run_timeout)
    call = ["bash", str(COMPARE), "--seed", str(seed), *extra]
    calls = json.loads((seed_dir / "calls.json").read_text()) if (seed_dir / "calls.json").exists() else []
    calls.append(
        {
            "runs": env["RUNS"],
            "steps": steps,
            "run_timeout": run_timeout,
            "command": call,
            "checkpoints": {k: str(v) for k, v in dirs.items()},
        }
    )
    seed_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(seed_dir / "calls.json", json.dumps(calls, indent=1))
    return call, env


def merge_seed_rows(seed_dir: Path, earlier: dict[str, dict]) -> None:
    """Keep the rows of runs an earlier call finished beside those the last call rewrote in results.json."""
    merged = {**earlier, **seed_rows(seed_dir)}
    atomic_write_text(seed_dir / "results.json", json.dumps(list(merged.values()), indent=1))


def run_seed(
    out: Path, seed: int, arms: list[str], dirs: dict[str, Path], steps: int, run_timeout: int | None, extra: list[str]
) -> tuple[int, bool]:
    """One call of compare_smollm2.sh for the arms this seed lacks (``seed_call``). Returns the call's status and
    whether a SIGTERM stopped it (``run_stoppable``: its runs are terminated, the rows they wrote kept)."""
    seed_dir = out / f"seed{seed}"
    earlier = seed_rows(seed_dir)
    call = seed_call(seed_dir, seed, [ARMS[a][0] for a in arms], dirs, steps, run_timeout, extra)
    if call is None:
        print(f"seed {seed}: every arm finished before, skipped")
        return 0, False
    status, stopped = run_stoppable(call[0], env=call[1], cwd=ROOT)
    merge_seed_rows(seed_dir, earlier)
    return status, stopped is not None


def mean_se(values: list[float]) -> dict[str, Any]:
    """Mean and standard error (sample standard deviation / sqrt(n)) of per-seed values."""
    n = len(values)
    mean = sum(values) / n if n else float("nan")
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else None
    return {"mean": mean, "se": se, "n": n, "values": values}


def ratio_se(num: list[float], den: list[float]) -> dict[str, Any]:
    """mean(num) / mean(den) over paired seeds, and its standard error by the delta method:
    Var(a/b) ~ Var(a)/b^2 + a^2 Var(b)/b^4 - 2 a Cov(a, b)/b^3, with the variances of the means."""
    n = len(num)
    a, b = sum(num) / n, sum(den) / n
    if n < 2 or b == 0:
        return {"ratio": a / b if b else None, "se": None}
    var_a = sum((x - a) ** 2 for x in num) / (n - 1) / n
    var_b = sum((y - b) ** 2 for y in den) / (n - 1) / n
    cov = sum((x - a) * (y - b) for x, y in zip(num, den, strict=True)) / (n - 1) / n
    var = var_a / b**2 + a * a * var_b / b**4 - 2 * a * cov / b**3
    return {"ratio": a / b, "se": math.sqrt(max(var, 0.0))}


def aggregate(out: Path, arms: list[str], best: str) -> dict[str, Any]:
    """Per-arm accuracy statistics over the finished, paired seeds, and reward curves."""
    rows: dict[int, dict[str, dict]] = {}
    for seed_dir in out.glob("seed*"):
        table = seed_rows(seed_dir)
        if seed_dir.name[4:].isdigit() and all(table.get(ARMS[a][0], {}).get("exit_code") == 0 for a in arms):
            rows[int(seed_dir.name[4:])] = table  # a seed counts only when every arm finished: pairs stay whole
    paired = sorted(rows)
    result: dict[str, Any] = {"seeds": paired, "arms": {}}
    gains: dict[str, list[float]] = {}
    for a in arms:
        runs = [rows[s][ARMS[a][0]] for s in paired]
        before = [r["heldout_accuracy_before"] for r in runs]
        after = [r["heldout_accuracy_after"] for r in runs]
        gains[a] = [y - x for x, y in zip(before, after, strict=True)]
        result["arms"][a] = {
            "label": ARMS[a][1].format(best=best),
            "run": ARMS[a][0],
            "heldout_accuracy_before": mean_se(before),
            "heldout_accuracy_after": mean_se(after),
            "gain": mean_se(gains[a]),
            "steps": [r["steps"] for r in runs],
            "train_runtime_s": [r["train_runtime_s"] for r in runs],
        }
    if "bf16" in arms and paired:
        for a in arms:
            result["arms"][a]["gain_vs_bf16"] = ratio_se(gains[a], gains["bf16"])
    result["calls"] = {s: json.loads(p.read_text()) for s in paired if (p := out / f"seed{s}" / "calls.json").exists()}
    result["reward_curves"] = {a: reward_curve([out / f"seed{s}" / ARMS[a][0] for s in paired]) for a in arms}
    return result


def reward_curve(run_dirs: list[Path]) -> list[list[float]]:
    """[step, mean reward over seeds, standard error] for every step all seeds logged."""
    per_run = [{s: m["reward"] for s, m in read_run(d).items() if "reward" in m} for d in run_dirs]
    steps = sorted(set.intersection(*(set(r) for r in per_run))) if per_run else []
    curve = []
    for s in steps:
        stats = mean_se([r[s] for r in per_run])
        curve.append([s, stats["mean"], stats["se"] or 0.0])
    return curve


def plot(result: dict[str, Any], path: Path, smooth: int = 10) -> Path:
    """Mean reward per step (moving average over ``smooth`` steps, band = +-1 SE) and accuracy bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    k = max(1, min([smooth, *(len(c) for c in result["reward_curves"].values() if c)]))
    for a, arm in result["arms"].items():
        curve = result["reward_curves"][a]
        if not curve:
            continue
        steps = [c[0] for c in curve][k - 1 :]
        mean = [sum(c[1] for c in curve[i - k + 1 : i + 1]) / k for i in range(k - 1, len(curve))]
        se = [sum(c[2] for c in curve[i - k + 1 : i + 1]) / k for i in range(k - 1, len(curve))]
        (line,) = left.plot(steps, mean, label=arm["label"], linewidth=1.3)
        left.fill_between(
            steps,
            [m - s for m, s in zip(mean, se, strict=True)],
            [m + s for m, s in zip(mean, se, strict=True)],
            color=line.get_color(),
            alpha=0.15,
        )
    left.set_xlabel("optimizer step")
    left.set_ylabel(f"mean reward ({k}-step moving average)")
    left.set_title(f"reward, mean over seeds {result['seeds']} (band: +-1 SE)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    names = list(result["arms"])
    for i, key in enumerate(("heldout_accuracy_before", "heldout_accuracy_after")):
        means = [result["arms"][a][key]["mean"] for a in names]
        ses = [result["arms"][a][key]["se"] or 0.0 for a in names]
        right.bar(
            [j + 0.4 * i for j in range(len(names))],
            means,
            0.4,
            yerr=ses,
            capsize=3,
            label=key.replace("heldout_accuracy_", "held-out accuracy "),
        )
    right.set_xticks([j + 0.2 for j in range(len(names))], names)
    right.set_ylabel("greedy held-out accuracy (mean +- SE)")
    right.grid(alpha=0.3, axis="y")
    right.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--best-method", default="gptq", choices=["mse", "gptq"])
    p.add_argument("--best-dir", type=Path, default=None, help="a prepared checkpoint for the best/qerl arms")
    p.add_argument("--bf16-dir", type=Path, default=None, help="the source model (default: the embedded SmolLM2)")
    p.add_argument("--run-timeout", type=int, default=None, help="seconds per run (compare_smollm2.sh RUN_TIMEOUT)")
    p.add_argument("--aggregate-only", action="store_true")
    args = p.parse_args(own)
    status = 0
    if not args.aggregate_only:
        dirs = prepare(args.out, args.arms, args.best_method, args.best_dir, args.bf16_dir)
        for seed in args.seeds:
            code, stopped = run_seed(args.out, seed, args.arms, dirs, args.steps, args.run_timeout, extra)
            status |= code != 0 or stopped
            if stopped:  # aggregate what the finished runs wrote, start no further seed
                break
    result = aggregate(args.out, args.arms, args.best_method)
    result.update(
        {
            "benchmark": "paired-seed GRPO runs on SmolLM2-135M-Instruct, arms side by side per seed "
            "(training/compare_smollm2.sh setup)",
            "best_method": args.best_method,
            "date": utc_now(),
            "device": device_name(None if torch.cuda.is_available() else torch.device("cpu")),
            "versions": versions("transformers", "trl", "peft", "compressed_tensors", "llmcompressor"),
            "command": command("benchmarks.learning", argv),
        }
    )
    write_json(args.out / "learning.json", result, indent=1)
    if result["seeds"]:
        plot(result, args.out / "learning.png")
    for a, arm in result["arms"].items():
        ratio = arm.get("gain_vs_bf16") or {}
        print(
            f"{a:8s} held-out accuracy {_pm(arm['heldout_accuracy_before'])} -> {_pm(arm['heldout_accuracy_after'])}, "
            f"gain {_pm(arm['gain'])} over {arm['gain']['n']} seeds"
            + ("" if ratio.get("ratio") is None else f", gain / bf16 gain {_pm(ratio, 'ratio')}")
        )
    return int(status)


def _pm(stats: dict[str, Any], key: str = "mean") -> str:
    """``0.412 +- 0.031`` (``+- -`` where one seed gives no standard error)."""
    se = stats.get("se")
    return f"{stats[key]:.3f} +- {'-' if se is None else f'{se:.3f}'}"


if __name__ == "__main__":
    sys.exit(main())
