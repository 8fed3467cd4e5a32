"""An adapter directory is held to what a merge and an evaluation can use (issue 72): adapter_config.json's numbers
finite and in range, its rank / alpha patterns plain module names (no regular expression that could run for ever),
its weights a safetensors file. Export and eval read it through the same checks; each case was seen to fail before
the fix (NaN weights written with rc 0, a hang, a traceback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import EVAL_FLAGS, GOOD, data_file, one_error, run_module
from tiny_models import make_adapter

pytestmark = pytest.mark.usefixtures("own_caches")


@pytest.fixture(scope="module")
def adapter(qtiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(qtiny, tmp_path_factory.mktemp("adapter") / "adapter")


def _changed(adapter: Path, out: Path, **changes: object) -> Path:
    shutil.copytree(adapter, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return out


def _commands(model: Path, lora: Path, tmp_path: Path) -> dict[str, list[str]]:
    """The export and eval command lines (as ``python -m`` arguments) that read ``lora`` over ``model``."""
    data = data_file(tmp_path, [GOOD])
    return {
        "export": ["qerl.export", "--model", str(model), "--lora", str(lora), "--output", str(tmp_path / "x")],
        "eval": [
            "eval.gsm8k",
            *("--model", str(model), "--lora", str(lora), "--data", str(data)),
            *("--output", str(tmp_path / "r.jsonl"), *EVAL_FLAGS),
        ],
    }


#: adapter_config.json changes, and what the one line must say.
CASES = {
    "lora_alpha NaN": ({"lora_alpha": float("nan")}, "lora_alpha"),
    "lora_alpha 1e40": ({"lora_alpha": 1e40}, "lora_alpha"),
    "alpha_pattern NaN": ({"alpha_pattern": {"q_proj": float("nan")}}, "alpha_pattern"),
    "rank 0": ({"r": 0}, "r is 0"),
    "catastrophic alpha_pattern": ({"alpha_pattern": {"(([a-z_.0-9]+)+)+X": 4}}, "alpha_pattern"),
    "catastrophic rank_pattern": ({"rank_pattern": {"((.*)*)*X": 4}}, "rank_pattern"),
    "catastrophic target_modules": ({"target_modules": "((.*)*)*X"}, "target_modules"),
    "catastrophic exclude_modules": ({"exclude_modules": "(([a-z_.0-9]+)+)+X"}, "exclude_modules"),
    "target_modules not an expression": ({"target_modules": "q_proj("}, "target_modules"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_adapter_config_is_one_line_in_export_and_eval(qtiny, adapter, tmp_path: Path, case: str) -> None:
    """lora_alpha NaN or 1e40 made export write NaN/Inf weights with rc 0 and eval record garbage; a catastrophic
    pattern hung both. Now both refuse the field in one line, in seconds, and write nothing."""
    changes, field = CASES[case]
    bad = _changed(adapter, tmp_path / "bad", **changes)
    for command, argv in _commands(qtiny, bad, tmp_path).items():
        code, err = run_module(argv, tmp_path)
        line = one_error(code, err)
        assert "adapter_config.json" in line and field in line, (command, line)
    assert not (tmp_path / "x").exists() and not (tmp_path / "r.jsonl").exists()


def test_plain_patterns_still_merge(qtiny, adapter, tmp_path: Path) -> None:
    """A rank / alpha pattern keyed by a module name or a dotted suffix (peft's rule) is taken, as before."""
    from qerl.export import read_adapter

    patterned = _changed(adapter, tmp_path / "patterned", alpha_pattern={"layers.0.self_attn.q_proj": 2})
    merged = read_adapter(patterned)
    assert merged.deltas["model.layers.0.self_attn.q_proj"][2] == 0.5
    assert merged.deltas["model.layers.1.self_attn.q_proj"][2] == 2.0


def test_module_name_expressions_still_evaluate(qtiny, adapter, tmp_path: Path) -> None:
    """A string ``target_modules`` that peft matches as a regular expression (the usual kind) is taken: the check
    that stops a backtracking one lets it through, in eval and export."""
    argvs = _commands(
        qtiny,
        _changed(
            adapter, tmp_path / "expr", target_modules=r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
        ),
        tmp_path,
    )
    for command, argv in argvs.items():
        code, err = run_module(argv, tmp_path)
        assert code == 0, (command, err[-2000:])


def test_eval_of_a_bin_adapter_is_one_line(qtiny, adapter, tmp_path: Path, capsys) -> None:
    """An adapter holding only adapter_model.bin was a traceback in eval; now one line naming the file, as export."""
    from safetensors.torch import load_file

    from eval import gsm8k
    from qerl import export
    from qerl.cli import run

    legacy = shutil.copytree(adapter, tmp_path / "legacy")
    torch.save(load_file(legacy / "adapter_model.safetensors"), legacy / "adapter_model.bin")
    (legacy / "adapter_model.safetensors").unlink()
    commands = _commands(qtiny, legacy, tmp_path)
    for command in (lambda: run(gsm8k.main, commands["eval"][1:]), lambda: export.main(commands["export"][1:])):
        line = one_error(command(), capsys.readouterr().err)
        assert str(legacy / "adapter_model.bin") in line and "only safetensors adapters are read" in line, line
