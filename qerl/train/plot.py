"""``python -m qerl.plot RUN_DIR [RUN_DIR ...] [--out DIR]``: training curves as PNG and CSV.

Reads each run's ``metrics.jsonl`` (written by QeRLTrainer at every log step; the last record of
a step wins, so a resumed run's repeated steps do not duplicate) or, failing that, the
``log_history`` of its newest ``trainer_state.json``. Several runs are overlaid, labelled by their
directory name, which is how QeRL / NVFP4 LoRA / bf16 LoRA are compared. Writes
``curves.csv`` (one row per run and step) and ``reward.png``, ``entropy.png``, ``sigma.png``,
``completion_length.png`` (a panel is skipped when no run logged its metric).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from qerl.fsutil import atomic_file

#: (file stem, metric key, y label)
PANELS = (
    ("reward", "reward", "mean reward"),
    ("entropy", "entropy", "token entropy (nats)"),
    ("sigma", "aqn/sigma", "AQN sigma"),
    ("completion_length", "completions/mean_length", "mean completion length (tokens)"),
)
CSV_KEYS = (
    "reward",
    "reward_std",
    "entropy",
    "aqn/sigma",
    "completions/mean_length",
    "loss",
    "learning_rate",
    "rollout/tokens_per_s",
    "step_time",
    "memory/peak_gb",
)


def read_run(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> metrics of one run."""
    metrics = run_dir / "metrics.jsonl"
    records: list[dict] = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
    else:
        states = sorted(
            run_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1])
        )
        if not states:
            raise FileNotFoundError(f"{run_dir}: no metrics.jsonl and no checkpoint-*/trainer_state.json")
        records = json.loads(states[-1].read_text())["log_history"]
    by_step: dict[int, dict[str, float]] = {}
    for r in records:
        if "step" in r and "loss" in r:
            by_step[int(r["step"])] = {k: v for k, v in r.items() if isinstance(v, (int, float))}
    return dict(sorted(by_step.items()))


def write_plots(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Write curves.csv and one PNG per panel for the given runs; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {Path(d).name or str(d): read_run(Path(d)) for d in run_dirs}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_write_csv(runs, out_dir / "curves.csv")]
    for stem, key, label in PANELS:
        series = {name: [(s, m[key]) for s, m in steps.items() if key in m] for name, steps in runs.items()}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for name, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], label=name, linewidth=1.2)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def _write_csv(runs: dict[str, dict[int, dict[str, float]]], path: Path) -> Path:
    with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "step", *CSV_KEYS])
        for name, steps in runs.items():
            for step, m in steps.items():
                writer.writerow([name, step, *(m.get(k, "") for k in CSV_KEYS)])
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qerl.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (output_dir of qerl.train.run)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: RUN_DIR/plots for one run)")
    args = parser.parse_args(argv)
    for run in args.runs:
        if not run.is_dir():
            parser.error(f"{run}: not a directory")
    out = args.out or (args.runs[0] / "plots" if len(args.runs) == 1 else Path("plots"))
    for path in write_plots(args.runs, out):
        print(path)


if __name__ == "__main__":
    main()
