"""config.json is checked field by field before anything is built from it (issue 72): a wrong type, a zero, a size
the weights do not have or an unknown RoPE type is one line naming the file and the field, for load, eval, quantize
and export alike, before any allocation. Each case was seen to fail before the fix (a traceback, a huge allocation,
or minutes of work before the refusal)."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import eval_argv, one_error, with_config
from tiny_models import make_tiny_llama

pytestmark = pytest.mark.usefixtures("own_caches")


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("dense") / "bf16")


@contextmanager
def _within(seconds: int) -> Iterator[None]:
    """Fail the block when it runs longer than ``seconds`` (the refusal must come before the work)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


#: Each a config.json change and the field the error must name. The last ones agree with themselves but not with
#: the weights' headers (an intermediate size of 10^6 on 128-wide weights allocated gigabytes before torch refused).
CASES = {
    "hidden_size a string": ({"hidden_size": "64"}, "hidden_size"),
    "no attention heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "unknown rope type": ({"rope_parameters": {"rope_type": "warp", "rope_theta": 1e4}}, "rope_type"),
    "intermediate_size a float": ({"intermediate_size": 1e9}, "intermediate_size"),
    "intermediate_size past any model": ({"intermediate_size": 10**9}, "intermediate_size"),
    "heads that do not divide": (
        {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
        "num_attention_heads",
    ),
    "kv heads that do not divide the heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "vocab_size true": ({"vocab_size": True}, "vocab_size"),
    "rms_norm_eps NaN": ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    "intermediate_size not the weights'": ({"intermediate_size": 4096}, "intermediate_size"),
    "vocab_size not the weights'": ({"vocab_size": 512}, "vocab_size"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_field_is_named_before_any_work(dense, merge, tmp_path: Path, capsys, case: str) -> None:
    """load (dense and NVFP4), quantize and export each refuse the field in one line naming config.json."""
    from qerl import export
    from qerl.load.loader import load_model
    from qerl.quantize.run import main as quantize_main

    changes, field = CASES[case]
    for model in (dense, merge["model"]):
        bad = with_config(model, tmp_path / f"bad-{model.name}", **changes)
        with _within(30), pytest.raises(ValueError) as raised:
            load_model(bad, device="cpu")
        message = str(raised.value)
        assert str(bad / "config.json") in message and field in message and "\n" not in message, message
    bad_dense, bad_nvfp4 = tmp_path / f"bad-{dense.name}", tmp_path / f"bad-{merge['model'].name}"
    with _within(30):
        code = quantize_main(["--model", str(bad_dense), "--output", str(tmp_path / "q"), "--skip_generation"])
    assert field in one_error(code, capsys.readouterr().err)
    argv = ["--model", str(bad_nvfp4), "--lora", str(merge["adapter"]), "--output", str(tmp_path / "x")]
    with _within(30):
        code = export.main([*argv, "--allow-base-mismatch"])
    assert field in one_error(code, capsys.readouterr().err)
    assert not (tmp_path / "q").exists() and not (tmp_path / "x").exists()


def test_quantize_refuses_a_hundred_thousand_claimed_layers_at_once(dense, tmp_path: Path, capsys) -> None:
    """quantize took 177 s and 5 GB building a skeleton of 100,000 layers before refusing the config; now the layer
    count is compared with the weights' headers first."""
    from qerl.quantize.run import main as quantize_main

    bad = with_config(dense, tmp_path / "bad", num_hidden_layers=100_000)
    start = time.monotonic()
    with _within(60):
        code = quantize_main(["--model", str(bad), "--output", str(tmp_path / "q"), "--skip_generation"])
    assert "num_hidden_layers" in one_error(code, capsys.readouterr().err)
    assert time.monotonic() - start < 10


def test_a_sound_config_still_loads(dense, tmp_path: Path) -> None:
    """Optional fields left out (no head_dim) or spelt the old way (rope_theta beside rope_scaling: null) are what
    transformers makes of them, not errors."""
    from qerl.load.loader import check_supported

    model = shutil.copytree(dense, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config.pop("head_dim")
    config.update(rope_scaling=None, rope_theta=theta)
    (model / "config.json").write_text(json.dumps(config))
    assert check_supported(model).model_type == "llama"


# --- a config.json that does not describe the weights ----------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 3, -1, "2", 10**9])
def test_config_that_does_not_describe_the_weights_is_refused(
    qtiny, tiny_dense_dir, tmp_path: Path, capsys, layers: object
) -> None:
    """A config.json with fewer layers than the weights ran a truncated model with rc 0 (more: random layers, or
    gigabytes allocated first); -1 or a string: a traceback. Refused by load, eval and train before any allocation."""
    from eval import gsm8k
    from qerl.cli import run
    from qerl.load.loader import load_model
    from qerl.train import run as train

    for model in (qtiny, tiny_dense_dir):
        lying = with_config(model, tmp_path / f"lying-{model.name}", num_hidden_layers=layers)
        with pytest.raises(ValueError, match="num_hidden_layers"):
            load_model(lying, device="cpu")
    argv = eval_argv(lying, tmp_path)
    assert "num_hidden_layers" in one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    argv = [
        "--model-name",
        str(lying),
        "--dataset",
        "arithmetic",
        "--output-dir",
        str(tmp_path / "run"),
        "--report-to",
        "none",
        "--max_steps",
        "1",
    ]
    assert "num_hidden_layers" in one_error(run(train.main, argv), capsys.readouterr().err)
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "run").exists()
