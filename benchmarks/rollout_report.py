"""The result documents of benchmarks/rollout.py: its summary ratios, the merge of rows measured by
other device calls on the same machine (vLLM rows of benchmarks/rollout_vllm.py, transformers +
NF4 rows of ``--bnb-only``), the JSON of a run cut off at its time limit, and the bar plot.

Needs no device: ``python -m benchmarks.rollout --plot / --merge-into / --from-partial`` run it on
existing JSON files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import PROMPT, SHAPES, command, save_figure, utc_now

#: vLLM 0.26 NVFP4(Marlin)+LoRA r16 decode ms/step measured EARLIER on this H200 (issue 4), not in this run.
EARLIER_VLLM_NVFP4_LORA_MS = {("7b", 1): 4.94, ("7b", 8): 4.88, ("7b", 64): 8.25, ("32b", 8): 14.7}
#: (engine, weights) of rows that other device calls on the same machine measure and merging adds:
#: vLLM (needs its 3-part bundle), transformers + bitsandbytes NF4 (needs a 43 MB wheel), and native rows of
#: another run of this script (e.g. ``--tokens 4096``: rows are keyed by their token count too).
MERGEABLE = {("vllm", "nvfp4"), ("vllm", "bf16"), ("hf", "nf4"), ("native", "nvfp4"), ("native", "bf16")}
#: Completion length of the long-completion rows and their summary keys (``over_vllm_nvfp4_lora_b*_t4096``).
LONG_TOKENS = 4096


def with_extra_rows(rows: list[dict], files: list[Path] | None, env: dict) -> tuple[list[dict], dict]:
    """``rows`` plus the rows other device calls on the same machine measured (``MERGEABLE``: vLLM
    rows of benchmarks/rollout_vllm.py, transformers + NF4 rows of ``--bnb-only``), replacing same-key rows.

    Such a row's floor/bytes fields are taken from the native row of the same configuration (same
    bytes to read); the vLLM / bitsandbytes versions join ``env["versions"]``; each row keeps the
    date of the file it came from as ``measured`` (the document's own date is its native run's).
    """
    if not files:
        return rows, env
    key = ("shape", "weights", "lora", "batch", "tokens")
    merged = {tuple(r[k] for k in key) + (r["engine"],): r for r in rows}
    env = {**env, "versions": dict(env.get("versions") or {})}
    for path in files:
        try:
            data = json.loads(path.read_text())
            vrows = data["results"] if isinstance(data, dict) else data
            if not all(isinstance(r, dict) and (r.get("engine"), r.get("weights")) in MERGEABLE for r in vrows):
                raise ValueError("rows other than vLLM, transformers+NF4 or native rollout rows")
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(
                f"benchmarks/rollout.py: --vllm-rows {path}: expected rollout_vllm.py's, a --bnb-only or another run's JSON ({e})"
            )
        if isinstance(data, dict):
            for name in ("vllm", "bitsandbytes"):
                if (data.get("versions") or {}).get(name):
                    env["versions"][name] = data["versions"][name]
            if env.get("device") and data.get("device") and data["device"] != env["device"]:
                sys.exit(
                    f"benchmarks/rollout.py: --vllm-rows {path} was measured on {data['device']}, not {env['device']}"
                )
        for r in vrows:
            native = merged.get(tuple(r[k] for k in key) + ("native",))
            fill = {k: native[k] for k in ("floor_ms", "weight_gb", "lora_gb", "kv_gb_mean")} if native else {}
            stamp = {"measured": data["date"]} if isinstance(data, dict) and data.get("date") else {}
            merged[tuple(r[k] for k in key) + (r["engine"],)] = {
                **r,
                **{k: v for k, v in fill.items() if r.get(k) is None},
                **stamp,
            }
    return list(merged.values()), env


def build_result(rows: list[dict], bw: float, args: argparse.Namespace, env: dict, partial: str | None = None) -> dict:
    """The JSON document: ``env`` (device, versions), summary ratios (None where a row is missing), all rows."""

    def ms(shape: str, engine: str, weights: str, lora: bool, b: int, tokens: int | None = None) -> float | None:
        """The row's ms/step at ``tokens`` (default: the run's ``--tokens``, ``--hf-tokens`` for generate rows)."""
        tokens = tokens or (args.hf_tokens if engine == "hf" else args.tokens)
        for r in rows:
            if (r["shape"], r["engine"], r["weights"], r["lora"], r["batch"], r["tokens"]) == (
                shape,
                engine,
                weights,
                lora,
                b,
                tokens,
            ):
                return r["ms_per_step"]
        return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a / b, 3)

    def over_vllm(shape: str, b: int, tokens: int | None = None) -> float | None:
        """vLLM NVFP4+LoRA ms / native NVFP4+LoRA ms, both from this run's rows (None without them)."""
        return ratio(ms(shape, "vllm", "nvfp4", True, b, tokens), ms(shape, "native", "nvfp4", True, b, tokens))

    nv = {(s, b): ms(s, "native", "nvfp4", True, b) for s, b in EARLIER_VLLM_NVFP4_LORA_MS}
    lora1, nolora1 = ms("7b", "native", "nvfp4", True, 1), ms("7b", "native", "nvfp4", False, 1)
    summary = {
        "nvfp4_lora_b1_ms": ms("7b", "native", "nvfp4", True, 1),
        "over_vllm_nvfp4_lora_b1": over_vllm("7b", 1),
        "over_vllm_nvfp4_lora_b8": over_vllm("7b", 8),
        "over_vllm_nvfp4_lora_b64": over_vllm("7b", 64),
        "over_vllm_nvfp4_lora_b128": over_vllm("7b", 128),
        "over_vllm_nvfp4_lora_32b_b8": over_vllm("32b", 8),
        **{f"over_vllm_nvfp4_lora_qwen3_8b_b{b}": over_vllm("qwen3-8b", b) for b in (1, 8, 64)},
        **{f"over_vllm_nvfp4_lora_llama3_8b_b{b}": over_vllm("llama3.1-8b", b) for b in (1, 8, 64)},
        f"over_vllm_nvfp4_lora_b64_t{LONG_TOKENS}": over_vllm("7b", 64, LONG_TOKENS),
        f"over_vllm_nvfp4_lora_b128_t{LONG_TOKENS}": over_vllm("7b", 128, LONG_TOKENS),
        "nvfp4_over_bf16_b8": ratio(ms("7b", "native", "bf16", True, 8), ms("7b", "native", "nvfp4", True, 8)),
        "lora_overhead_b1": None if lora1 is None or nolora1 is None else round((lora1 - nolora1) / lora1, 4),
        "over_hf_generate_bf16_lora_b1": ratio(ms("7b", "hf", "bf16", True, 1), lora1),
        "over_hf_generate_nf4_lora_b1": ratio(ms("7b", "hf", "nf4", True, 1), lora1),
    }
    same_run_vllm = any(r["engine"] == "vllm" for r in rows)
    earlier = {
        "note": "vLLM 0.26 NVFP4+LoRA r16 ms/step measured EARLIER on this H200 (given in issue 4), NOT in this run"
        + ("; context only: the summary's over_vllm_* use this run's vLLM rows" if same_run_vllm else ""),
        "vllm_ms": {f"{s}_b{b}": v for (s, b), v in EARLIER_VLLM_NVFP4_LORA_MS.items()},
        "over_earlier_vllm": {f"{s}_b{b}": ratio(v, nv[(s, b)]) for (s, b), v in EARLIER_VLLM_NVFP4_LORA_MS.items()},
    }
    result = {
        "benchmark": "rollout decode ms/step",
        "date": utc_now(),
        **env,
        "command": command("benchmarks.rollout"),
        "setup": {
            "prompt_tokens": PROMPT,
            "new_tokens": args.tokens,
            "hf_new_tokens": args.hf_tokens,
            "lora_r": 16,
            "temperature": 1.0,
            "weights": "random (real shapes)",
            "model": "Qwen2.5 7B/32B shapes",
        },
        "copy_bandwidth_tb_s": round(bw / 1e12, 3),
        "summary": summary,
        "earlier_vllm_reference": earlier,
        "results": rows,
    }
    if partial is not None:
        result["partial"] = partial
    return result


#: Bar order and colour of the plot's series: (engine, weights, lora) -> (label, colour).
SERIES = {
    ("native", "nvfp4", True): ("qerl NVFP4 + LoRA", "C0"),
    ("native", "nvfp4", False): ("qerl NVFP4, LoRA off", "#9ecae1"),
    ("native", "bf16", True): ("qerl bf16 + LoRA", "C9"),
    ("vllm", "nvfp4", True): ("vLLM NVFP4 + LoRA", "C2"),
    ("vllm", "bf16", True): ("vLLM bf16 + LoRA", "#a1d99b"),
    ("hf", "bf16", True): ("transformers bf16 + LoRA", "C3"),
    ("hf", "nf4", True): ("transformers NF4 + LoRA", "#fc9272"),
}


def plot(path: Path) -> Path:
    """Grouped bars, one group per (shape, batch), one bar per engine/weights, the NVFP4 + LoRA
    bandwidth floor as a line over each group; saved beside the JSON (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    rows, base_tokens = data["results"], data["setup"]["new_tokens"]

    def group_of(r: dict) -> tuple[str, int, int]:
        """(shape, batch, tokens): rows longer than the run's own (merged ``--tokens 4096`` rows) group apart;
        the shorter generate rows join their batch's group."""
        return r["shape"], r["batch"], max(r["tokens"], base_tokens)

    groups = sorted({group_of(r) for r in rows}, key=lambda g: (list(SHAPES).index(g[0]), g[2], g[1]))
    series = [k for k in SERIES if any((r["engine"], r["weights"], r["lora"]) == k for r in rows)]
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 5))
    for j, key in enumerate(series):
        xs, ys = [], []
        for i, group in enumerate(groups):
            for r in rows:
                if group_of(r) == group and (r["engine"], r["weights"], r["lora"]) == key:
                    xs.append(i - 0.4 + (j + 0.5) * width)
                    ys.append(r["ms_per_step"])
        label, colour = SERIES[key]
        ax.bar(xs, ys, width=width, color=colour, label=label)
    for i, group in enumerate(groups):
        floor = next(
            (
                r["floor_ms"]
                for r in rows
                if (group_of(r), r["engine"], r["weights"], r["lora"]) == (group, "native", "nvfp4", True)
                and r.get("floor_ms")
            ),
            None,
        )
        if floor:
            ax.hlines(floor, i - 0.4, i + 0.4, color="k", label="NVFP4 + LoRA floor" if i == 0 else None, zorder=3)
        earlier = EARLIER_VLLM_NVFP4_LORA_MS.get(group[:2]) if group[2] == base_tokens else None
        if earlier and ("vllm", "nvfp4", True) not in series:  # no same-run vLLM rows: the earlier numbers
            ax.scatter(
                [i],
                [earlier],
                color="C1",
                marker="*",
                s=120,
                zorder=4,
                label="vLLM NVFP4+LoRA (earlier measurement)" if i == 0 else None,
            )
    ax.set_yscale("log")
    ax.set_ylim(top=8 * max(r["ms_per_step"] for r in rows))  # room for the legend above the bars
    ax.set_ylabel("decode ms / step (log)")
    ax.set_xticks(
        range(len(groups)),
        [f"{shape.upper()} b={b}" + (f"\n{t} tokens" if t != base_tokens else "") for shape, b, t in groups],
    )
    device = data.get("device") or "device not recorded"
    ax.set_title(f"qerl rollout decode, {device} ({data['date'][:10]}){' — PARTIAL run' if 'partial' in data else ''}")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out = path.with_suffix(".png")
    save_figure(fig, out)
    return out


def merge_into(args: argparse.Namespace) -> dict:
    """``--merge-into``: the result JSON ``args.merge_into`` with the rows of ``--vllm-rows`` merged in
    (its date and command kept, this merge's command appended)."""
    if not args.vllm_rows or args.out is None:
        sys.exit("benchmarks/rollout.py: --merge-into needs --vllm-rows FILE... and --out PATH")
    try:
        data = json.loads(args.merge_into.read_text())
        rows, bw, setup = data["results"], data["copy_bandwidth_tb_s"], data["setup"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"benchmarks/rollout.py: --merge-into {args.merge_into}: expected this script's result JSON ({e})")
    rows, env = with_extra_rows(rows, args.vllm_rows, {k: data.get(k) for k in ("device", "versions", "decode_config")})
    args.tokens, args.hf_tokens = setup["new_tokens"], setup["hf_new_tokens"]
    result = build_result(rows, bw * 1e12, args, env, partial=data.get("partial"))
    result["date"], result["command"] = data["date"], f"{data['command']} ; merged: {result['command']}"
    return result


def from_partial(args: argparse.Namespace) -> dict:
    """``--from-partial``: the result JSON of a run cut off at its time limit, from the rows it saved
    (a ``.partial.json``, or a bare list of rows with ``--bandwidth-tb-s``)."""
    data = json.loads(args.from_partial.read_text())
    rows, bw = (data, args.bandwidth_tb_s) if isinstance(data, list) else (data["rows"], data["copy_bandwidth_tb_s"])
    if bw is None or args.out is None:
        sys.exit("benchmarks/rollout.py: --from-partial needs --out and the run's bandwidth (--bandwidth-tb-s)")
    env = (
        {k: data.get(k) for k in ("device", "versions")}
        if isinstance(data, dict)
        else {"device": None, "versions": None}
    )
    rows, env = with_extra_rows(rows, args.vllm_rows, env)
    return build_result(rows, bw * 1e12, args, env, partial=args.partial_note)
