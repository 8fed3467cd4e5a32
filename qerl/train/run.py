"""``python -m qerl.train``: one QeRL (or baseline) GRPO/DAPO run from a YAML recipe plus CLI flags.

    python -m qerl.train --config training/recipes/quickstart.yaml --output_dir runs/demo
    python -m qerl.train --model-name qmodel/Qwen2.5-7B-NVFP4A16 --dataset gsm8k --lora-rank 16 --ln True \\
        --sigma-start 1e-2 --sigma-end 1e-4 --num-stages 10 --output-dir runs/7b

Flags (``qerl.train.args``) are trl's ``TrlParser`` over ``ScriptArguments`` (model, data, LoRA) and ``QeRLConfig``
(everything trl's GRPOConfig knows, plus the rollout engine and AQN). Both ``--lora_rank`` and the
reference's ``--lora-rank`` spellings work. Reference flags that no longer do anything
(``--max-seq-length``, ``--fast-inference``, ``--random-state``, ``--load-in-4bit``, ...) are accepted
with a warning so that the reference's scripts still run. What a recipe leaves unset is the reference
scripts' choice: one epoch, the data set's completion budget (``qerl.train.data``), AQN for NVFP4 models only
(``qerl.train.config``), the data set's prompt (``--prompt-style``). ``--push_to_hub`` uploads only when a
Hugging Face token is configured; otherwise it logs one note and the run stays local.

A run into an ``output_dir`` that already holds one continues it from its newest complete checkpoint
(every file of it read back and checked first: a damaged one is refused in one line, or moved aside for the
one before with ``--damaged_checkpoint previous``), but only when the recorded settings (``run_config.json``: flags, data and model digests) match; a
finished run is a no-op, and different settings are refused in one line unless ``--resume force``
(``qerl.train.resume``; the record is written only once these checks pass); settings that may change (``--save_steps``, ``--logging_steps``) take effect on the
resumed run. The run writes the final adapter to ``output_dir/adapter`` (temp dir, then rename) with
the base model's digest (``qerl_base.json``; checkpoints have it in ``run_config.json`` beside them),
so that export and evaluation can refuse another base, logs every step to ``output_dir/metrics.jsonl``
and draws the curves with ``qerl.train.plot``. One run at a time holds ``output_dir`` (``qerl.runlock``), which
must be new, empty or a run's own, and neither a link nor the model's directory or inside it
(``qerl.train.resume.check_output_dir``). A failed save (a full disk) leaves no ``checkpoint-N`` that looks
complete: the incomplete one is moved aside before the error is reported.

Bad input (an unknown flag or recipe key, an unknown reward, a negative learning rate, a missing
file) stops before any work with ``error: <one line>`` and exit status 2 (``qerl.cli``), and so does a run whose
estimated peak GPU memory exceeds the card's free memory (``qerl.train.memory``; ``--force`` runs it anyway).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peft import get_peft_model_state_dict
from transformers import TrainerCallback

from qerl import hub
from qerl.cli import UsageError, one_line, run, usage_errors
from qerl.fingerprint import resolved_sha256, write_base_record
from qerl.fsutil import atomic_directory, atomic_write_text, remove_leftovers
from qerl.load.loader import check_supported, is_nvfp4_model, load_model, load_tokenizer
from qerl.load.lora import lora_config
from qerl.rollout import SamplingParams
from qerl.runlock import run_lock
from qerl.tasks import data_sets
from qerl.tasks.answers import judge
from qerl.tasks.prompts import encode_chat
from qerl.train import data, resume
from qerl.train.args import IGNORED_REFERENCE_FLAGS, ScriptArguments, parse_args
from qerl.train.checkpoint_check import sound_checkpoint
from qerl.train.host_memory import hand_back_large_blocks, peak_rss_gib
from qerl.train.memory import check_fits
from qerl.train.rewards import get_rewards
from qerl.train.trainer import QeRLConfig, QeRLTrainer, last_complete_checkpoint

logger = logging.getLogger("qerl.train")
__all__ = ["IGNORED_REFERENCE_FLAGS", "ScriptArguments", "main", "parse_args", "heldout_accuracy"]


def heldout_accuracy(trainer: QeRLTrainer, rows: Any, reading: str, max_new_tokens: int, batch: int = 64) -> float:
    """Greedy accuracy on held-out rows through the rollout engine, judged as evaluation judges
    (``qerl.tasks.answers.judge`` with the data set's reading), whatever rewards the run trains with."""
    if len(rows) == 0:
        return float("nan")
    tok = trainer.processing_class
    engine = trainer.rollout_engine()
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=list(trainer.eos_token_ids))
    correct = 0
    with trainer.inference_mode():  # the rollouts' toggle, without their AQN noise and metrics
        for start in range(0, len(rows), batch):
            chunk = rows.select(range(start, min(start + batch, len(rows))))
            ids = [encode_chat(tok, p) for p in chunk["prompt"]]
            out = engine.generate(ids, params, n=1)
            texts = tok.batch_decode(out.completion_ids, skip_special_tokens=True)
            correct += sum(judge(text, gold, reading) for text, gold in zip(texts, chunk["answer"], strict=True))
    return correct / len(rows)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def save_adapter(trainer: QeRLTrainer, out_dir: Path, model: str, digest: str | None) -> Path:
    """The final adapter (and tokenizer) in ``out_dir``, with the record of its base model
    (``qerl_base.json``), written to a temp dir first then renamed; the temp dirs a killed save left are removed
    first (only our marked ones: ``qerl.fsutil.remove_leftovers``; the caller holds the run's lock)."""
    remove_leftovers(out_dir)
    with atomic_directory(out_dir) as tmp:
        trainer.save_model(str(tmp))
        write_base_record(tmp, model, digest)
    return out_dir


class CurrentIntervals(TrainerCallback):
    """The logging / saving intervals of *this* invocation: transformers restores ``save_steps``,
    ``logging_steps`` and ``eval_steps`` from the checkpoint it resumes, so a changed ``--save_steps``
    (a resumable setting, ``qerl.train.resume``) was reported and then ignored."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        state.compute_steps(args, state.max_steps)


def is_main_launch_process() -> bool:
    """Whether this process writes the run's files: the only one, or rank 0 under ``accelerate launch``."""
    return os.environ.get("RANK", "0") == "0"


def end_process_group() -> None:
    """Under ``accelerate launch``, after a run that succeeded: wait for every rank, then close the process group.

    Left open, the group is torn down by the interpreter's exit in whatever order the ranks get there: rank 0, which
    hosts the rendezvous store, can be gone while another rank's gloo threads still talk to it, and that rank aborts
    ("terminate called without an active exception") with a non-zero exit after a good run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hand_back_large_blocks()  # a step's freed activations go back to the system (qerl.train.host_memory)
    script, config = parse_args(argv)
    for name in IGNORED_REFERENCE_FLAGS:
        if getattr(script, name) is not None:
            logger.warning("--%s is a reference leftover and is ignored", name.replace("_", "-"))

    out = Path(config.output_dir)
    model = _resolved(script.model_name)
    resume.check_output_dir(out, script.model_name, model)
    if not is_main_launch_process():
        summary = _train(script, config, out, model)
    else:
        with run_lock(out, "--output_dir"):
            summary = _train(script, config, out, model)
    end_process_group()
    return summary


def _resolved(model: str) -> Path | str:
    """``--model_name`` resolved once for the run (a local directory or a hub id: ``qerl.hub.resolve_model``)."""
    try:
        return hub.resolve_model(model)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model_name {model}: {one_line(e)}") from None


def _tokenizer(model: str, resolved: Path | str, trust_remote_code: bool) -> tuple[Path, Any]:
    """(the model's directory, its tokenizer), once the model is known to be supported and to have a chat template
    (every prompt is rendered through it: without one, trl failed in the first step with a traceback); code the model
    directory names runs only with ``--trust_remote_code`` (trl's flag, ``qerl.model_files``)."""
    try:
        model_dir = hub.local_dir(resolved)
        check_supported(model_dir, trust_remote_code=trust_remote_code)  # before the tokenizer, hashing and the data
        tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model_name {model}: {one_line(e)}") from None
    if not tokenizer.chat_template:
        raise UsageError(
            f"--model_name {model}: has no chat template (chat_template.jinja or tokenizer_config.json's "
            "chat_template); training renders every prompt through it"
        )
    return model_dir, tokenizer


def _rows(script: ScriptArguments, config: QeRLConfig, tokenizer: Any, budget: int) -> tuple[Any, Any]:
    """(training rows, held-out rows), every prompt within ``budget`` tokens (``data.prompt_budget``; longer ones
    dropped, by characters first: a huge question is never tokenized whole)."""
    rows = data.load_dataset(
        script.dataset,
        script.dataset_path,
        num_samples=script.num_samples,
        seed=config.seed,
        arithmetic_level=script.arithmetic_level,
        style=script.prompt_style,
    )
    kept = data.filter_prompt_length(rows, tokenizer, budget)
    if len(kept) < len(rows):
        flag = "--max_prompt_length" if script.max_prompt_length else "the default --max_prompt_length"
        logger.warning(
            "dropped %d of %d rows whose prompt is longer than %d tokens (%s)",
            len(rows) - len(kept),
            len(rows),
            budget,
            flag,
        )
    if not len(kept):
        raise ValueError(f"--max_prompt_length {budget}: no prompt of the data set is that short")
    where = data.data_name(script.dataset, script.dataset_path)
    train, heldout = data.train_heldout_split(kept, script.heldout, seed=config.seed, where=where)
    prompts = config.generation_batch_size // config.num_generations  # trl's sampler drops a generation short of it
    if len(train) < prompts:
        raise ValueError(
            f"{where}: {len(train)} training row(s), fewer than the {prompts} prompts one generation takes "
            "(--per_device_train_batch_size x processes x --steps_per_generation / --num_generations); "
            "no step would train"
        )
    return train, heldout


@dataclass
class Prepared:
    """What :func:`prepare` hands to :func:`fit` and :func:`finish`: the trainer and the run's inputs and record."""

    trainer: QeRLTrainer
    train_rows: Any
    heldout_rows: Any
    reward_names: list[str]
    wanted: dict[str, Any]
    base_digest: str | None
    summary: dict[str, Any]


def _train(script: ScriptArguments, config: QeRLConfig, out: Path, model: Path | str) -> dict[str, Any]:
    """The run itself, once ``out`` is this process's to write: a finished run's summary, or prepare, fit, finish."""
    prepared = prepare(script, config, out, model)
    if isinstance(prepared, dict):
        return prepared
    fit(script, prepared, out)
    return finish(script, prepared, out)


def prepare(script: ScriptArguments, config: QeRLConfig, out: Path, model: Path | str) -> Prepared | dict[str, Any]:
    """Inputs, settings record and trainer, or the summary of a run that already finished (``model``: ``--model_name``
    resolved). Everything that fails here is the user's input (paths, names, values), reported in one line; nothing
    is written yet."""
    model_dir, tokenizer = _tokenizer(script.model_name, model, config.trust_remote_code)
    with usage_errors(ValueError, OSError):
        budget = data.prompt_budget(script.max_prompt_length, config.max_completion_length, model_dir)
        check_fits(script, config, budget, model_dir)  # refused before the data, the model's digest and the model
        train_rows, heldout_rows = _rows(script, config, tokenizer, budget)
        reward_names = script.rewards or list(data_sets.spec(script.dataset).rewards)
        rewards = get_rewards(reward_names)
        unrecorded = (*IGNORED_REFERENCE_FLAGS, "force")  # --force: how to start, not what the run is
        used = {k: v for k, v in dataclasses.asdict(script).items() if k not in unrecorded}
        base_digest = resolved_sha256(model)
        wanted = resume.run_config(
            used,
            config.to_dict(),
            rewards=reward_names,
            model_sha256=base_digest,
            data_sha256=resume.rows_sha256(train_rows, heldout_rows),
        )
        todo = resume.continuation(out, wanted, script.resume, config.max_steps)
        if todo.finished is not None:
            logger.info(
                "%s: this run finished at step %s; nothing to do (summary.json)", out, todo.finished.get("global_step")
            )
            return todo.finished
        trainer = build_trainer(script, config, rewards, train_rows, tokenizer, model_dir)
    summary: dict[str, Any] = {
        "model": script.model_name,
        "nvfp4": is_nvfp4_model(trainer.model),
        "dataset": script.dataset,
        "train_rows": len(train_rows),
        "heldout_rows": len(heldout_rows),
        "rewards": reward_names,
    }
    if todo.changed:
        summary["resumed_with_changes"] = todo.changed
    return Prepared(trainer, train_rows, heldout_rows, reward_names, wanted, base_digest, summary)


def build_trainer(
    script: ScriptArguments, config: QeRLConfig, rewards: list[Any], train_rows: Any, tokenizer: Any, model_dir: Path
) -> QeRLTrainer:
    """The model (``model_dir``: ``--model_name``'s directory) on this process's device and the trainer around it,
    with LoRA as the flags ask."""
    peft = lora_config(
        script.lora_rank, script.lora_alpha, script.lora_dropout, script.target_modules, train_norms=script.ln
    )
    # This process's device: cuda:LOCAL_RANK under `accelerate launch` (one process per GPU), cuda
    # alone, else CPU. Loading straight there keeps N processes from all filling the first GPU.
    model = load_model(model_dir, device=config.device, load=script.load, trust_remote_code=config.trust_remote_code)
    logger.info("model %s: %s", script.model_name, "NVFP4 base" if is_nvfp4_model(model) else "dense base")
    if config.rollout_engine == "vllm":  # vLLM serves the same checkpoint the trainer loaded
        engine_kwargs = dict(config.rollout_engine_kwargs or {})
        engine_kwargs.setdefault("checkpoint", str(model.config.name_or_path))
        engine_kwargs.setdefault("gpu_memory_utilization", config.vllm_gpu_memory_utilization)
        config = copy.copy(config)  # the parsed flags stay as the user gave them (the run record holds those)
        config.rollout_engine_kwargs = engine_kwargs
    trainer = QeRLTrainer(
        model, rewards, config, train_dataset=train_rows, processing_class=tokenizer, peft_config=peft
    )
    trainer.add_callback(CurrentIntervals())
    return trainer


def fit(script: ScriptArguments, run: Prepared, out: Path) -> None:
    """The checkpoint to resume checked, then (only then: a refused resume leaves the run as it was) the settings
    recorded, the held-out rows written and measured, and the training itself."""
    trainer = run.trainer
    with trainer.accelerator.main_process_first():  # it may move checkpoints aside: one process at a time
        shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(trainer.model).items()}
        checkpoint = sound_checkpoint(out, shapes, take_previous=script.damaged_checkpoint == "previous")
    out.mkdir(parents=True, exist_ok=True)
    if trainer.is_world_process_zero():
        resume.save(out, run.wanted)
    if len(run.heldout_rows) and trainer.accelerator.is_main_process:  # rows `python -m eval.gsm8k` / eval.math score
        write_jsonl(
            out / "heldout.jsonl",
            [
                {"question": p[-1]["content"], "answer": a}
                for p, a in zip(run.heldout_rows["prompt"], run.heldout_rows["answer"], strict=True)
            ],
        )
    _measure_heldout(script, run, "before")
    if checkpoint:
        logger.info("resuming from %s", checkpoint)
    try:
        result = trainer.train(resume_from_checkpoint=checkpoint)
    except BaseException:
        if trainer.accelerator.is_main_process:  # a save cut short (full disk, Ctrl-C) must not stay as checkpoint-N
            _hide_incomplete_checkpoints(out)
        raise
    run.summary["train_runtime_s"] = result.metrics.get("train_runtime")
    run.summary["global_step"] = trainer.state.global_step


def finish(script: ScriptArguments, run: Prepared, out: Path) -> dict[str, Any]:
    """The final adapter, the held-out accuracy after training, the plots and ``summary.json``."""
    main_process = run.trainer.accelerator.is_main_process
    run.summary["adapter"] = str(
        save_adapter(run.trainer, out / "adapter", script.model_name, run.base_digest)
        if main_process
        else out / "adapter"
    )
    _measure_heldout(script, run, "after")
    if not main_process:
        return run.summary
    if script.plot:
        from qerl.train.plot import write_plots

        run.summary["plots"] = [str(p) for p in write_plots([out], out / "plots")]
    run.summary["peak_rss_gib"] = round(peak_rss_gib(), 2)
    summary = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in run.summary.items()}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    logger.info("run summary: %s", json.dumps(summary))
    return summary


def _measure_heldout(script: ScriptArguments, run: Prepared, when: str) -> None:
    """``heldout_accuracy_{when}`` in the summary (and the log), when rows are held out."""
    if not len(run.heldout_rows):
        return
    reading = data_sets.spec(script.dataset).reading
    accuracy = heldout_accuracy(run.trainer, run.heldout_rows, reading, script.heldout_max_tokens)
    run.summary[f"heldout_accuracy_{when}"] = accuracy
    logger.info("held-out accuracy %s training: %.4f", when, accuracy)


def _hide_incomplete_checkpoints(out: Path) -> None:
    """Move checkpoints without their completion marker aside (``last_complete_checkpoint`` does), as
    far as the file system still lets us; the next run would do it too."""
    try:
        last_complete_checkpoint(out)
    except OSError as e:
        logger.warning("%s: could not move an incomplete checkpoint aside (%s); the next run will", out, e)


if __name__ == "__main__":
    sys.exit(run(main))
