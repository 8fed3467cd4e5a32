"""benchmarks/rollout.py's merge of rows measured in other device calls (vLLM, transformers + NF4;
benchmarks/rollout_report.py): what the README's rollout table and the issue's summary ratios are built from;
and benchmarks/rollout_vllm.py's driver keeping those rows when a time limit stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from argparse import Namespace
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="module")
def rollout() -> ModuleType:
    from benchmarks import rollout_report

    return rollout_report


def _row(engine: str, weights: str, ms: float, **extra: object) -> dict:
    return {
        "shape": "7b",
        "engine": engine,
        "weights": weights,
        "lora": True,
        "batch": 8,
        "tokens": 1024,
        "ms_per_step": ms,
        "floor_ms": None,
        "weight_gb": None,
        "lora_gb": None,
        "kv_gb_mean": None,
        **extra,
    }


def test_merge_fills_floors_stamps_dates_and_replaces_same_rows(rollout: ModuleType, tmp_path: Path) -> None:
    native = _row("native", "nvfp4", 4.1, floor_ms=1.2, weight_gb=4.7, lora_gb=0.08, kv_gb_mean=0.35)
    old_vllm = _row("vllm", "nvfp4", 5.0, measured="yesterday")
    extra = tmp_path / "vllm.json"
    extra.write_text(
        json.dumps(
            {
                "date": "2026-11-30T00:39:54+00:00",
                "device": "H200",
                "versions": {"vllm": "0.26.0"},
                "results": [_row("vllm", "nvfp4", 4.9)],
            }
        )
    )
    rows, env = rollout.with_extra_rows([native, old_vllm], [extra], {"device": "H200", "versions": {"torch": "2.11"}})
    assert len(rows) == 2  # the vLLM row replaced, not duplicated
    vllm = next(r for r in rows if r["engine"] == "vllm")
    assert vllm["ms_per_step"] == 4.9 and vllm["measured"] == "2026-11-30T00:39:54+00:00"
    assert (vllm["floor_ms"], vllm["weight_gb"], vllm["kv_gb_mean"]) == (1.2, 4.7, 0.35)  # same bytes as native
    assert env["versions"] == {"torch": "2.11", "vllm": "0.26.0"}


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"date": "d", "device": "H200", "results": [_row("hf", "bf16", 1.0)]}, "expected rollout_vllm.py's"),
        ({"date": "d", "device": "A100", "results": [_row("vllm", "bf16", 1.0)]}, "was measured on A100"),
    ],
)
def test_merge_refuses_foreign_rows(rollout: ModuleType, tmp_path: Path, doc: dict, message: str) -> None:
    extra = tmp_path / "rows.json"
    extra.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=message):
        rollout.with_extra_rows([], [extra], {"device": "H200", "versions": {}})


def test_long_completion_rows_merge_beside_the_main_run(rollout: ModuleType, tmp_path: Path) -> None:
    """A ``--tokens 4096`` run's native rows and vLLM's rows at 4096 tokens merge into the 1024-token result: rows are
    keyed by their token count, the main summary keeps reading the run's own length, the t4096 keys the long rows."""
    main = [_row("native", "nvfp4", 2.0, batch=64), _row("vllm", "nvfp4", 3.0, batch=64)]
    long = tmp_path / "t4096.json"
    long.write_text(
        json.dumps(
            {
                "date": "d",
                "device": "H200",
                "results": [
                    _row("native", "nvfp4", 4.0, batch=64, tokens=4096),
                    _row("vllm", "nvfp4", 8.0, batch=64, tokens=4096),
                    _row("native", "nvfp4", 5.0, batch=128, tokens=4096),
                ],
            }
        )
    )
    rows, env = rollout.with_extra_rows(main, [long], {"device": "H200", "versions": {}})
    assert len(rows) == 5
    result = rollout.build_result(rows, 4e12, Namespace(tokens=1024, hf_tokens=32), env)
    summary = result["summary"]
    assert summary["over_vllm_nvfp4_lora_b64"] == 1.5  # the 1024-token rows, not the long ones
    assert summary["over_vllm_nvfp4_lora_b64_t4096"] == 2.0 and summary["over_vllm_nvfp4_lora_b128_t4096"] is None


def _sigterm_self_once(path: Path) -> None:
    """From a thread: SIGTERM this process (as ``timeout`` would) once ``path`` exists (at most 20 s)."""

    def stop() -> None:
        for _ in range(400):
            if path.exists():
                break
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()


@contextmanager
def _sigterm_guard() -> Iterator[Callable]:
    """A SIGTERM handler that fails the test (instead of killing pytest) if the code under test installed
    none; yields it so the test can check that handler is back afterwards."""

    def guard(signum: int, frame: object) -> None:
        raise RuntimeError("SIGTERM reached the test: the code under test installed no handler")

    previous = signal.signal(signal.SIGTERM, guard)
    try:
        yield guard
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_vllm_driver_keeps_finished_rows_on_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``timeout`` sends SIGTERM to benchmarks/rollout_vllm.py's driver only: the driver must stop the running child
    (which would otherwise keep the GPU for whatever runs next), keep the rows that child had written, note the
    stop, and start no further configuration. The child here is a stand-in that writes one row and sleeps."""
    from benchmarks import common, rollout_vllm

    child_code = (
        "import json, os, sys, time\n"
        "out = sys.argv[1]\n"
        "doc = {'device': 'fake', 'versions': {}, 'rows': [{'shape': '7b', 'engine': 'vllm', 'batch': 1}]}\n"
        "open(out + '.tmp', 'w').write(json.dumps(doc)); os.replace(out + '.tmp', out)\n"
        "time.sleep(60)\n"
    )
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def fake_popen(cmd: list[str], **kwargs: object) -> subprocess.Popen:
        part = Path(cmd[cmd.index("--out") + 1])
        started.append(real_popen([sys.executable, "-c", child_code, str(part)], **kwargs))
        _sigterm_self_once(part)
        return started[-1]

    monkeypatch.setattr(common.subprocess, "Popen", fake_popen)
    out = tmp_path / "v.json"
    try:
        with _sigterm_guard() as guard:
            args = Namespace(
                shapes=["7b"], weights=["nvfp4", "bf16"], batches=[1], tokens=16, gpu_memory_utilization=0.5, out=out
            )
            result = rollout_vllm.drive(args)
            assert signal.getsignal(signal.SIGTERM) is guard  # the driver put the caller's handler back
    finally:
        for child in started:
            child.kill()
    assert len(started) == 1, "a configuration started after the stop"
    assert started[0].returncode == -signal.SIGTERM  # the child was terminated, not left running
    written = json.loads(out.read_text())
    assert written["results"] == result["results"] == [{"shape": "7b", "engine": "vllm", "batch": 1}]
    assert written["failures"] == ["7b:nvfp4 stopped by SIGTERM (rows it had finished are kept)"]


def test_run_stoppable_terminates_the_whole_child_group(tmp_path: Path) -> None:
    """A training driver's child is ``bash compare_smollm2.sh`` with python runs under it: on SIGTERM
    ``benchmarks.common.run_stoppable`` must end the grandchildren too, not only the shell."""
    from benchmarks.common import run_stoppable

    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}; wait"
    with _sigterm_guard() as guard:
        _sigterm_self_once(pid_file)
        code, stopped = run_stoppable(["bash", "-c", script])
        assert signal.getsignal(signal.SIGTERM) is guard
    assert stopped == "SIGTERM" and code == -signal.SIGTERM
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # gone, or a zombie waiting for a reaper that is not ours
        status = Path(f"/proc/{grandchild}/status")
        if not status.exists() or "\nState:\tZ" in status.read_text():
            break
        threading.Event().wait(0.05)
    else:
        os.kill(grandchild, signal.SIGKILL)
        raise AssertionError("the grandchild outlived the stop")


def test_ab_constants_parse_apply_and_restore() -> None:
    """``--ab-constant``: each spec becomes a (module, name, value) pair for the base and the variant, applied together
    and restored afterwards, even when the block raises."""
    from benchmarks import rollout_ab as bench
    from qerl.rollout import step_plan

    start = step_plan.FUSED_LORA_MAX_ROWS
    base, variant = bench.parse_ab_constants(
        ["qerl.rollout.step_plan.FUSED_LORA_MAX_ROWS=32:64", "qerl.rollout.step_plan.STACK_GROUPS=True:False"]
    )
    assert [(n, v) for _, n, v in base] == [("FUSED_LORA_MAX_ROWS", 32), ("STACK_GROUPS", True)]
    assert [(n, v) for _, n, v in variant] == [("FUSED_LORA_MAX_ROWS", 64), ("STACK_GROUPS", False)]
    with pytest.raises(RuntimeError), bench.applied(variant):
        assert (step_plan.FUSED_LORA_MAX_ROWS, step_plan.STACK_GROUPS) == (64, False)
        raise RuntimeError
    assert step_plan.FUSED_LORA_MAX_ROWS == start and step_plan.STACK_GROUPS is True


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("FUSED_LORA_MAX_ROWS=32:64", "expected MODULE.NAME=BASE:VARIANT"),
        ("qerl.rollout.step_plan.FUSED_LORA_MAX_ROWS=32", "expected MODULE.NAME=BASE:VARIANT"),
        ("qerl.rollout.nowhere.X=1:2", "cannot import qerl.rollout.nowhere"),
        ("qerl.rollout.step_plan.FUSED_LORA_MAX_ROW=32:64", "has no attribute FUSED_LORA_MAX_ROW"),
        ("qerl.rollout.step_plan.FUSED_LORA_MAX_ROWS=32:6.4", "expected two int literals"),
        ("qerl.rollout.step_plan.STACK_GROUPS=1:0", "expected two bool literals"),
    ],
)
def test_ab_constants_reject_bad_specs(spec: str, says: str) -> None:
    from benchmarks import rollout_ab as bench

    with pytest.raises(ValueError, match=says) as err:
        bench.parse_ab_constants([spec])
    assert spec in str(err.value) and "\n" not in str(err.value)


def test_constant_ab_times_each_variant_under_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The A/B driver on CPU (a 2-layer random Qwen2 through the eager engine; the timing stubbed to record what was
    in force while each engine ran): base / variant / base, each under its own values, the default back after."""
    import torch

    from benchmarks import common
    from benchmarks import rollout_ab as bench
    from benchmarks.rollout_models import with_lora
    from qerl.rollout import step_plan

    tiny = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    monkeypatch.setattr(
        bench,
        "build_model",
        lambda shape, nvfp4: with_lora(
            common.random_model(tiny, common.VOCAB, False, torch.device("cpu"), torch.float32)
        ),
    )
    seen = []

    def timing(engine: object, prompts: list, tokens: int) -> tuple[float, float]:
        seen.append(step_plan.FUSED_LORA_MAX_ROWS)
        return 1.0, 0.1

    monkeypatch.setattr(bench, "ms_per_step", timing)
    monkeypatch.setattr(bench, "environment", dict)
    start = step_plan.FUSED_LORA_MAX_ROWS
    args = Namespace(shapes=["7b"], batches=[1], tokens=8)
    result = bench.constant_ab(args, *bench.parse_ab_constants(["qerl.rollout.step_plan.FUSED_LORA_MAX_ROWS=5:7"]))
    assert seen == [5, 7, 5] and step_plan.FUSED_LORA_MAX_ROWS == start
    rows = result["results"]
    assert [r["variant"] for r in rows] == ["FUSED_LORA_MAX_ROWS=5", "FUSED_LORA_MAX_ROWS=7", "FUSED_LORA_MAX_ROWS=5"]
    assert all(r["greedy_rows_equal_to_base"] == 1.0 and r["ms_per_step"] == 1.0 for r in rows)


def test_qwen3_shapes_reach_vllm_configs_adapters_and_floors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Qwen3 rows' plumbing (issue 50): vLLM's config-only dir is a Qwen3 config transformers reads with the
    shape's head width and vocabulary; the adapter's q/o widths are heads x head_dim (32B: 8192, not the hidden
    5120); the floors count the same Linear parameters as a real Qwen3-32B module tree (built on the meta device)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks import common, rollout_vllm
    from benchmarks.grpo_floors import shape_counts

    config = AutoConfig.from_pretrained(rollout_vllm.write_model_dir(tmp_path, "qwen3-8b", "nvfp4"))
    assert (config.model_type, config.head_dim, config.vocab_size) == ("qwen3", 128, 151936)
    assert config.quantization_config["format"] == "nvfp4-pack-quantized"

    tiny = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    monkeypatch.setitem(common.SHAPES, "tiny-qwen3", tiny)
    adapter = rollout_vllm.write_adapter_dir(tmp_path, "tiny-qwen3")
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        layer = "base_model.model.model.layers.0.self_attn"
        assert f.get_slice(f"{layer}.q_proj.lora_B.weight").get_shape() == [128, 16]
        assert f.get_slice(f"{layer}.o_proj.lora_A.weight").get_shape() == [16, 128]

    real = AutoConfig.for_model("qwen3", vocab_size=151936, tie_word_embeddings=False, **common.SHAPES["qwen3-32b"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(real)
    linears = sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in name
    )
    assert shape_counts(common.SHAPES["qwen3-32b"], 151936, 16)["linear_params"] == linears


def test_the_llama3_shape_reaches_vllm_configs_the_random_model_and_floors(tmp_path: Path) -> None:
    """The Llama-3.1-8B rows' plumbing (issue 73): vLLM's config-only dir is a Llama config transformers reads with
    the shape's vocabulary, 128k context and ``llama3`` RoPE scaling; the benchmark's random model gets the same RoPE
    (checked on a 2-layer model of that family config: its inverse frequencies are llama3's, not plain theta's); the
    floors count the Linear parameters of a real Llama-3.1-8B module tree (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks import common, rollout_vllm
    from benchmarks.grpo_floors import shape_counts

    config = AutoConfig.from_pretrained(rollout_vllm.write_model_dir(tmp_path, "llama3.1-8b", "nvfp4"))
    assert (config.model_type, config.architectures, config.vocab_size) == ("llama", ["LlamaForCausalLM"], 128256)
    assert config.max_position_embeddings == 131072 and config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.quantization_config is not None

    tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    family = common.family_config("llama3.1-8b")
    scaled = common.random_model(tiny, 100, False, torch.device("cpu"), torch.float32, "llama", **family)
    plain = common.random_model(tiny, 100, False, torch.device("cpu"), torch.float32, "llama", rope_theta=500000.0)
    low = scaled.model.rotary_emb.inv_freq[-1] / plain.model.rotary_emb.inv_freq[-1]
    assert scaled.config.rope_parameters["factor"] == 8.0 and low == pytest.approx(1 / 8)  # the lowest frequencies / 8

    real = AutoConfig.for_model("llama", vocab_size=128256, tie_word_embeddings=False, **common.SHAPES["llama3.1-8b"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(real)
    linears = sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in name
    )
    assert shape_counts(common.SHAPES["llama3.1-8b"], 128256, 16)["linear_params"] == linears == 6_979_321_856
