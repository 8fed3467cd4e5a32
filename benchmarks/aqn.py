"""Does AQN help? A paired-seed experiment with the power to say so, on the embedded SmolLM2-135M.

    python -m benchmarks.aqn --out runs/aqn --settings main --seeds 0-19 [--parallel 2] [--records FILE ...]
    python -m benchmarks.aqn --out runs/aqn --settings hard --seeds 0-9
    python -m benchmarks.aqn --out runs/aqn --aggregate-only --records benchmarks/results/aqn_runs.jsonl

Arms, all with the training setup of ``training/compare_smollm2.sh`` (the same hyperparameters for every arm;
AQN "on" is the paper's schedule, our default: sigma 1e-2 -> 1e-4 over 10 stages on the RMSNorm weights that feed
q/k/v and gate/up):

* ``main`` setting (easy arithmetic): NVFP4 rtn off / on, NVFP4 gptq off / on, bf16 off / on (does the noise help
  without quantization?);
* ``hard`` setting (``--arithmetic-level long``: sums of operands up to 999, where the base model's greedy held-out
  accuracy is far lower): NVFP4 gptq off / on.

Seeds are paired: within a seed every arm sees the same data order, held-out set and sampling seed (one call of
compare_smollm2.sh per seed runs its arms side by side); ``--parallel`` seeds run at once, so a call of the GPU
machine runs 6 x ``--parallel`` trainings of the 135M model together.

Each finished run becomes one line of ``OUT/aqn_runs.jsonl`` (setting, arm, seed, held-out greedy accuracy before
and after, and per step the reward, the policy entropy and the AQN sigma the run logged), appended as soon as its
seed ends; a (setting, seed) whose arms are all recorded there or in ``--records`` files is not run again, so the
experiment can be cut anywhere and continued on another machine from the committed records.

Statistics, per setting and per quantization (rtn, gptq, bf16), over the seeds where both arms finished: the paired
difference AQN on - off in held-out accuracy after training, in reward AUC (the mean reward over all steps), and in
mean entropy over the first 50 steps, each with its mean, 95% confidence interval (Student t over seeds) and the
smallest difference the experiment could detect at 80% power and 5% two-sided level (``(t_0.975 + t_0.8) * sd /
sqrt(n)``). ``OUT/aqn.json`` and ``OUT/aqn.png`` (mean reward and entropy per step per arm with standard-error
bands; the paired differences with their intervals).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import command, device_name, run_stoppable_group, save_figure, utc_now, versions, write_json
from benchmarks.learning import ROOT, mean_se, merge_seed_rows, prepare, seed_call, seed_rows
from qerl.fsutil import append_whole
from qerl.train.plot import read_run

#: arm -> (run name in training/compare_smollm2.sh, quantization, AQN on)
ARMS: dict[str, tuple[str, str, bool]] = {
    "rtn_off": ("nvfp4_lora", "rtn", False),
    "rtn_on": ("qerl_nvfp4_aqn", "rtn", True),
    "gptq_off": ("best_lora", "gptq", False),
    "gptq_on": ("qerl_best_aqn", "gptq", True),
    "bf16_off": ("bf16_lora", "bf16", False),
    "bf16_on": ("bf16_aqn", "bf16", True),
}


@dataclass(frozen=True)
class Setting:
    arms: tuple[str, ...]
    extra: tuple[str, ...]  # qerl.train.run flags after compare_smollm2.sh's own
    min_seeds: int  # what the experiment is planned for


SETTINGS = {
    "main": Setting(tuple(ARMS), (), 20),
    "hard": Setting(("gptq_off", "gptq_on"), ("--arithmetic-level", "long"), 10),
}
#: Steps over which the entropy difference is taken (the paper's claim: AQN raises entropy early).
EARLY_STEPS = 50


# ---------------------------------------------------------------------------------------------- statistics


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom: bisection on its CDF, which is
    1/2 + the integral of the density from 0 (Simpson's rule; the density is smooth, so 2,000 panels give ~1e-9)."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile: expected 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, panels: int = 2000) -> float:
        h = x / panels
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(panels + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def paired(differences: list[float]) -> dict[str, Any]:
    """Mean of per-seed differences, its 95% interval (t over seeds) and the smallest true difference this many
    seeds detect with 80% power at a two-sided 5% level, given the differences' spread."""
    n = len(differences)
    mean = sum(differences) / n if n else None
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "ci95": None, "mde80": None, "values": differences}
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    se = sd / math.sqrt(n)
    t975 = t_quantile(0.975, n - 1)
    return {
        "n": n,
        "mean": mean,
        "sd": sd,
        "ci95": [mean - t975 * se, mean + t975 * se],
        "mde80": (t975 + t_quantile(0.8, n - 1)) * se,
        "values": differences,
    }


# ---------------------------------------------------------------------------------------------- records


def run_record(run_dir: Path, row: dict[str, Any], setting: str, arm: str, seed: int) -> dict[str, Any]:
    """One finished run in a line: held-out accuracy and the per-step curves it logged (``metrics.jsonl``)."""
    steps = read_run(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
    curve = {
        key: [steps[s].get(name) for s in sorted(steps)]
        for key, name in (("reward", "reward"), ("entropy", "entropy"), ("sigma", "aqn/sigma"))
    }
    return {
        "setting": setting,
        "arm": arm,
        "seed": seed,
        "exit_code": row.get("exit_code"),
        "steps": sorted(steps),
        "heldout_accuracy_before": row.get("heldout_accuracy_before"),
        "heldout_accuracy_after": row.get("heldout_accuracy_after"),
        **curve,
    }


def read_records(paths: list[Path]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(setting, arm, seed) -> record, the last line winning; lines cut short by a kill are skipped."""
    records: dict[tuple[str, str, int], dict[str, Any]] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            records[(r["setting"], r["arm"], r["seed"])] = r
    return records


def finished(records: dict[tuple[str, str, int], dict[str, Any]], setting: str, arm: str, seed: int) -> bool:
    r = records.get((setting, arm, seed))
    return r is not None and r["exit_code"] == 0


# ---------------------------------------------------------------------------------------------- runs


def run_experiment(args: argparse.Namespace, extra: list[str], records_file: Path) -> bool:
    """Run the (setting, seed) pairs that lack records, ``--parallel`` seeds at a time; True if a SIGTERM
    stopped it (what had finished is recorded)."""
    records = read_records([*args.records, records_file])
    jobs = [
        (name, seed)
        for name in args.settings
        for seed in args.seeds
        if not all(finished(records, name, a, seed) for a in SETTINGS[name].arms)
    ]
    if not jobs:
        return False
    dirs = prepare(args.out, ["rtn", "best"], "gptq", args.gptq_dir, args.bf16_dir)
    for start in range(0, len(jobs), args.parallel):
        wave, calls = [], []
        for name, seed in jobs[start : start + args.parallel]:
            setting = SETTINGS[name]
            arms = [a for a in setting.arms if not finished(records, name, a, seed)]
            seed_dir = args.out / name / f"seed{seed}"
            earlier = seed_rows(seed_dir)
            call = seed_call(
                seed_dir, seed, [ARMS[a][0] for a in arms], dirs, args.steps, args.run_timeout, [*setting.extra, *extra]
            )
            if call is not None:
                wave.append((name, seed, seed_dir, earlier))
                calls.append((call[0], {"env": call[1], "cwd": ROOT}))
        t0 = time.perf_counter()
        codes, stopped = run_stoppable_group(calls)
        for (name, seed, seed_dir, earlier), code in zip(wave, codes, strict=True):
            merge_seed_rows(seed_dir, earlier)
            rows = seed_rows(seed_dir)
            for arm in SETTINGS[name].arms:
                run = ARMS[arm][0]
                if run in rows and not finished(records, name, arm, seed):
                    record = run_record(seed_dir / run, rows[run], name, arm, seed)
                    records_file.parent.mkdir(parents=True, exist_ok=True)
                    append_whole(records_file, json.dumps({**record, "command": command("benchmarks.aqn")}) + "\n")
                    records[(name, arm, seed)] = record
            print(f"{name} seed {seed}: exit {code} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if stopped:
            return True
    return False


# ---------------------------------------------------------------------------------------------- aggregate


def curve_stats(curves: list[list[float | None]]) -> list[list[float]]:
    """[step index, mean, standard error] over runs, for every step all runs logged."""
    out = []
    for i in range(min((len(c) for c in curves), default=0)):
        values = [c[i] for c in curves]
        if any(v is None for v in values):
            continue
        stats = mean_se(values)
        out.append([i + 1, stats["mean"], stats["se"] or 0.0])
    return out


def mean_of(values: list[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else float("nan")


def aggregate(records: dict[tuple[str, str, int], dict[str, Any]]) -> dict[str, Any]:
    """Per setting: the seeds where every arm finished (pairs stay whole), per-arm accuracy and curves, and per
    quantization the paired on - off differences."""
    result: dict[str, Any] = {}
    for name, setting in SETTINGS.items():
        seeds = sorted(
            {s for (n, _, s) in records if n == name and all(finished(records, name, a, s) for a in setting.arms)}
        )
        if not seeds:
            continue
        runs = {a: [records[(name, a, s)] for s in seeds] for a in setting.arms}
        arms = {}
        for a, rs in runs.items():
            arms[a] = {
                "run": ARMS[a][0],
                "quantization": ARMS[a][1],
                "aqn": ARMS[a][2],
                "heldout_accuracy_before": mean_se([r["heldout_accuracy_before"] for r in rs]),
                "heldout_accuracy_after": mean_se([r["heldout_accuracy_after"] for r in rs]),
                "reward_curve": curve_stats([r["reward"] for r in rs]),
                "entropy_curve": curve_stats([r["entropy"] for r in rs]),
                "sigma_applied_curve": curve_stats([[v or 0.0 for v in r["sigma"]] for r in rs]),
            }
        differences = {}
        for q in dict.fromkeys(ARMS[a][1] for a in setting.arms):
            on, off = runs[f"{q}_on"], runs[f"{q}_off"]
            pairs = list(zip(on, off, strict=True))
            differences[q] = {
                "heldout_accuracy_after": paired(
                    [a["heldout_accuracy_after"] - b["heldout_accuracy_after"] for a, b in pairs]
                ),
                "reward_auc": paired([mean_of(a["reward"]) - mean_of(b["reward"]) for a, b in pairs]),
                f"entropy_first_{EARLY_STEPS}": paired(
                    [mean_of(a["entropy"][:EARLY_STEPS]) - mean_of(b["entropy"][:EARLY_STEPS]) for a, b in pairs]
                ),
            }
        result[name] = {
            "seeds": seeds,
            "planned_seeds": setting.min_seeds,
            "arms": arms,
            "aqn_on_minus_off": differences,
        }
    return result


def plot(result: dict[str, Any], path: Path, smooth: int = 10) -> Path:
    """Per setting: mean reward and entropy per step per arm (moving average, band +-1 SE); the paired
    differences with their 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result)
    fig, axes = plt.subplots(len(names), 3, figsize=(17, 4.2 * len(names)), squeeze=False)
    for row, name in zip(axes, names, strict=True):
        setting = result[name]
        for ax, key, label in ((row[0], "reward_curve", "mean reward"), (row[1], "entropy_curve", "entropy (nats)")):
            for a, arm in setting["arms"].items():
                curve = arm[key]
                k = max(1, min(smooth, len(curve)))
                steps = [c[0] for c in curve][k - 1 :]
                mean = [sum(c[1] for c in curve[i - k + 1 : i + 1]) / k for i in range(k - 1, len(curve))]
                se = [sum(c[2] for c in curve[i - k + 1 : i + 1]) / k for i in range(k - 1, len(curve))]
                (line,) = ax.plot(steps, mean, label=a, linewidth=1.2, linestyle="-" if arm["aqn"] else "--")
                ax.fill_between(
                    steps,
                    [m - s for m, s in zip(mean, se, strict=True)],
                    [m + s for m, s in zip(mean, se, strict=True)],
                    color=line.get_color(),
                    alpha=0.12,
                )
            ax.set_title(f"{name}: {label} over {len(setting['seeds'])} seeds ({k}-step average, +-1 SE)")
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        labels, means, lows, highs = [], [], [], []
        for q, diffs in setting["aqn_on_minus_off"].items():
            for metric, d in diffs.items():
                if d["ci95"] is not None:
                    labels.append(f"{q}: {metric}")
                    means.append(d["mean"])
                    lows.append(d["mean"] - d["ci95"][0])
                    highs.append(d["ci95"][1] - d["mean"])
        row[2].errorbar(means, range(len(labels)), xerr=[lows, highs], fmt="o", capsize=3)
        row[2].axvline(0, color="k", linewidth=0.8)
        row[2].set_yticks(range(len(labels)), labels, fontsize=7)
        row[2].set_title(f"{name}: AQN on - off, paired (95% CI)")
        row[2].grid(alpha=0.3, axis="x")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- CLI


def seed_list(text: str) -> list[int]:
    """``0-19`` or ``3`` (argparse type; several may be given)."""
    lo, _, hi = text.partition("-")
    try:
        return list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a seed or a range like 0-19, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.aqn", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["main"])
    p.add_argument("--seeds", type=seed_list, nargs="+", default=[list(range(20))])
    p.add_argument("--parallel", type=int, default=2, help="seeds run at once (each runs its arms side by side)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--run-timeout", type=int, default=None, help="seconds per run (compare_smollm2.sh RUN_TIMEOUT)")
    p.add_argument(
        "--records", type=Path, nargs="*", default=[], help="earlier aqn_runs.jsonl files to count and merge"
    )
    p.add_argument("--gptq-dir", type=Path, default=None, help="a prepared gptq checkpoint (default: made under OUT)")
    p.add_argument("--bf16-dir", type=Path, default=None, help="the source model (default: the embedded SmolLM2)")
    p.add_argument("--aggregate-only", action="store_true")
    args = p.parse_args(own)
    args.seeds = sorted({s for group in args.seeds for s in group})
    if args.parallel < 1:
        p.error(f"--parallel: expected at least 1, got {args.parallel}")
    records_file = args.out / "aqn_runs.jsonl"
    stopped = False if args.aggregate_only else run_experiment(args, extra, records_file)
    result = {
        "benchmark": "AQN on vs off, paired seeds, SmolLM2-135M-Instruct (training/compare_smollm2.sh setup)",
        "date": utc_now(),
        "device": device_name(None if torch.cuda.is_available() else torch.device("cpu")),
        "versions": versions("transformers", "trl", "peft"),
        "command": command("benchmarks.aqn", argv),
        "steps": args.steps,
        "records": [str(f) for f in [*args.records, records_file]],
        "settings": aggregate(read_records([*args.records, records_file])),
    }
    write_json(args.out / "aqn.json", result, indent=1)
    if result["settings"]:
        plot(result["settings"], args.out / "aqn.png")
    for name, setting in result["settings"].items():
        for q, diffs in setting["aqn_on_minus_off"].items():
            for metric, d in diffs.items():
                ci = "-" if d["ci95"] is None else f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"
                mde = "-" if d["mde80"] is None else f"{d['mde80']:.3f}"
                print(f"{name} {q:5s} {metric:28s} on - off {d['mean']:+.4f}  95% CI {ci}  MDE80 {mde}  n={d['n']}")
    return int(stopped)


if __name__ == "__main__":
    sys.exit(main())
