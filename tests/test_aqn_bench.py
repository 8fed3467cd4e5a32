"""benchmarks.aqn's statistics and bookkeeping: Student t quantiles, paired differences with their interval and
detectable effect, one record per finished run, seeds that resume from records, and the concurrent seed calls
(the training itself runs on the GPU; here a stand-in command writes what compare_smollm2.sh writes)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks import aqn


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [(0.975, 1, 12.7062), (0.975, 9, 2.26216), (0.975, 19, 2.09302), (0.8, 19, 0.86095), (0.975, 1000, 1.96234)],
)
def test_t_quantile_matches_the_tables(p: float, df: int, expected: float) -> None:
    assert aqn.t_quantile(p, df) == pytest.approx(expected, abs=2e-5)


def test_t_quantile_refuses_lower_tail() -> None:
    with pytest.raises(ValueError, match="0.5 <= p < 1"):
        aqn.t_quantile(0.3, 5)


def test_paired_interval_and_detectable_difference() -> None:
    d = [0.10, 0.20, 0.00, 0.15, 0.05]
    s = aqn.paired(d)
    se = s["sd"] / math.sqrt(5)
    assert s["mean"] == pytest.approx(0.10) and s["sd"] == pytest.approx(math.sqrt(0.025 / 4))
    assert s["ci95"] == pytest.approx([0.10 - 2.77645 * se, 0.10 + 2.77645 * se], abs=1e-5)
    assert s["mde80"] == pytest.approx((2.77645 + 0.94096) * se, abs=1e-5)
    assert aqn.paired([0.3])["ci95"] is None  # one seed: no spread, no interval


def _write_run(
    seed_dir: Path, run: str, after: float, reward: float, entropy: float, sigma: float, steps: int = 60
) -> dict:
    (seed_dir / run).mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"step": s, "loss": 0.0, "reward": reward, "entropy": entropy, "aqn/sigma": sigma})
        for s in range(1, steps + 1)
    ]
    (seed_dir / run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return {"run": run, "exit_code": 0, "steps": steps, "heldout_accuracy_before": 0.2, "heldout_accuracy_after": after}


def test_aggregate_pairs_arms_within_seeds(tmp_path: Path) -> None:
    records = {}
    for seed, delta in enumerate([0.02, 0.04, 0.06]):
        seed_dir = tmp_path / f"seed{seed}"
        for arm in aqn.SETTINGS["hard"].arms:
            on = aqn.ARMS[arm][2]
            row = _write_run(
                seed_dir, aqn.ARMS[arm][0], 0.3 + delta * on, 0.5 + 2 * delta * on, 1.0 + 0.1 * on, 1e-2 * on
            )
            records[("hard", arm, seed)] = aqn.run_record(seed_dir / row["run"], row, "hard", arm, seed)
    del records[("hard", "gptq_on", 2)]  # an unfinished arm drops its seed: pairs stay whole
    result = aqn.aggregate(records)["hard"]
    assert result["seeds"] == [0, 1]
    diffs = result["aqn_on_minus_off"]["gptq"]
    assert diffs["heldout_accuracy_after"]["values"] == pytest.approx([0.02, 0.04])
    assert diffs["reward_auc"]["mean"] == pytest.approx(0.06)
    assert diffs["entropy_first_50"]["mean"] == pytest.approx(0.1)
    assert result["arms"]["gptq_on"]["sigma_applied_curve"][0][1] == pytest.approx(1e-2)
    assert result["arms"]["gptq_off"]["sigma_applied_curve"][0][1] == 0.0


FAKE_COMPARE = """
import json, os, sys
from pathlib import Path
out = Path(os.environ["QERL_OUT"]); out.mkdir(parents=True, exist_ok=True)
seed = int(sys.argv[sys.argv.index("--seed") + 1])
rows = []
for run in os.environ["RUNS"].split():
    (out / run).mkdir(exist_ok=True)
    (out / run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.0, "reward": seed, "entropy": 1.0}) + "\\n")
    rows.append({"run": run, "exit_code": 0, "steps": 1, "heldout_accuracy_before": 0.1, "heldout_accuracy_after": 0.2})
(out / "results.json").write_text(json.dumps(rows))
"""


def test_seeds_run_concurrently_and_resume_from_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_call(seed_dir: Path, seed: int, runs: list[str], *rest: object) -> tuple[list[str], dict[str, str]]:
        calls.append((seed, tuple(runs), rest[-1]))
        return [sys.executable, "-c", FAKE_COMPARE, "--seed", str(seed)], {
            "QERL_OUT": str(seed_dir),
            "RUNS": " ".join(runs),
        }

    monkeypatch.setattr(aqn, "seed_call", fake_call)
    monkeypatch.setattr(aqn, "prepare", lambda *a: {})
    args = aqn.argparse.Namespace(
        out=tmp_path,
        settings=["hard"],
        seeds=[0, 1, 2],
        parallel=2,
        steps=1,
        run_timeout=None,
        records=[],
        gptq_dir=None,
        bf16_dir=None,
    )
    records_file = tmp_path / "aqn_runs.jsonl"
    assert aqn.run_experiment(args, [], records_file) is False
    assert sorted(c[0] for c in calls) == [0, 1, 2]
    assert all(c[2] == ["--arithmetic-level", "long"] for c in calls)  # the setting's flags reach the call
    records = aqn.read_records([records_file])
    assert sorted(records) == [("hard", a, s) for a in ("gptq_off", "gptq_on") for s in (0, 1, 2)]
    assert records[("hard", "gptq_on", 2)]["reward"] == [2]
    # Everything recorded: nothing runs again, and the checkpoints are not even prepared.
    monkeypatch.setattr(aqn, "prepare", lambda *a: pytest.fail("prepared with nothing to run"))
    calls.clear()
    assert aqn.run_experiment(args, [], records_file) is False and calls == []
    # Records from another machine count too: a fresh output dir with them runs nothing.
    args.out, args.records = tmp_path / "elsewhere", [records_file]
    assert aqn.run_experiment(args, [], args.out / "aqn_runs.jsonl") is False and calls == []


def test_seed_ranges() -> None:
    assert aqn.seed_list("0-3") == [0, 1, 2, 3] and aqn.seed_list("7") == [7]
    with pytest.raises(aqn.argparse.ArgumentTypeError, match="range like 0-19"):
        aqn.seed_list("a-b")
