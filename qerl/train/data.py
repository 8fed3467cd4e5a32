"""Training data: every data set becomes rows of ``prompt`` (chat messages) and ``answer`` (gold).

``prompt`` is built as the reference built it for that data set unless ``--prompt-style`` says
otherwise (``qerl.tasks.prompts``): GSM8K the bare question, BigMath the tag instruction, DAPO-Math the
row's own ``source_prompt``; trl applies the tokenizer's chat template itself. ``answer`` is what the
rewards in ``qerl.train.rewards`` and the held-out accuracy compare against, through the data set's answer
reading (``qerl.tasks.answers``). What each named set is (its source, prompt style, rewards, reading and completion
budget) is ``qerl.tasks.data_sets``' table; this module reads the rows.

Sources: a local file (``.jsonl``/``.json``/``.parquet``, or a directory holding ``train.*``) or a
hub id, for GSM8K, BigMath, DAPO-Math; plus ``arithmetic``, a synthetic set generated from a seed
for models too small to get any GSM8K reward (SmolLM2-135M solves ~2% of GSM8K). Its difficulty
level (``ARITHMETIC_LEVELS``) exists because GRPO learns only from groups whose rewards differ: the
original ``hard`` mix (``36 * 47 * 24``) left SmolLM2-135M ~1% rewarded and nearly every group
all-zero, so a 200-step run learned nothing.
"""

from __future__ import annotations

import codecs
import json
import logging
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset
from datasets.fingerprint import generate_random_fingerprint

from qerl.checkpoint import read_config
from qerl.hub import path_shaped
from qerl.tasks.answers import gsm8k_gold
from qerl.tasks.data_sets import DatasetSpec, canonical, prompt_style, spec
from qerl.tasks.prompts import SOURCE_STYLE, chat_messages, encode_chat

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _read_local(path: Path) -> Dataset:
    if path.is_dir():
        candidates = [path / f"train{ext}" for ext in (".jsonl", ".json", ".parquet")]
        found = [c for c in candidates if c.exists()]
        if not found:
            raise FileNotFoundError(f"--dataset_path {path}: directory has no train.jsonl, train.json or train.parquet")
        path = found[0]
    if path.suffix not in LOCAL_SUFFIXES:
        raise ValueError(f"--dataset_path {path}: expected a .jsonl, .json or .parquet file")
    if path.suffix != ".parquet":
        _check_text(path)
    read = Dataset.from_parquet if path.suffix == ".parquet" else Dataset.from_json
    # datasets converts the file to an arrow copy in its cache, there for good (706 MB for a 700 MB file): the copy
    # goes to a directory of ours instead, removed once the rows are in memory.
    with tempfile.TemporaryDirectory(prefix="qerl-data-") as scratch:
        try:
            return read(str(path), cache_dir=scratch, keep_in_memory=True)
        except Exception as e:  # datasets wraps the reader's error (binary file, bad JSON) in its own types
            raise ValueError(f"--dataset_path {path}: not a readable {path.suffix} file ({_reason(e)})") from e


#: The longest line (one record) a JSON data file may have. The reader takes a record whole, growing its block until
#: the record fits: one 1 GiB line was killed for memory. A GSM8K or DAPO-Math row is a few kB.
MAX_RECORD_BYTES = 16 << 20
#: How much of a data file :func:`_check_text` reads at a time.
READ_CHUNK = 1 << 20


def _check_text(path: Path) -> None:
    """Refuse a JSON file that is not UTF-8 text (naming the byte: datasets reads such a file and the bad bytes
    surface later as a UnicodeDecodeError that names neither the file nor the flag) or that has a line longer than
    :data:`MAX_RECORD_BYTES`, reading it a chunk at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines, current = 0, 0, 0  # bytes read, newlines seen, length of the line not yet ended
    with path.open("rb") as f:
        while block := f.read(min(READ_CHUNK, MAX_RECORD_BYTES)):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                raise ValueError(f"--dataset_path {path}: not UTF-8 text (near byte {offset + e.start})") from None
            first, last = block.find(b"\n"), block.rfind(b"\n")  # lines between them are shorter than a chunk
            if current + (len(block) if first < 0 else first) > MAX_RECORD_BYTES:
                raise ValueError(
                    f"--dataset_path {path}: line {lines + 1} is longer than {MAX_RECORD_BYTES} bytes "
                    "(one record per line)"
                )
            lines += block.count(b"\n")
            current = current + len(block) if first < 0 else len(block) - last - 1
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"--dataset_path {path}: not UTF-8 text (it ends inside a character)") from None


def _reason(e: BaseException) -> str:
    """The first line of the innermost error (datasets' own message only says that one occurred)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]


def _read_source(name: str, source: str | None, split: str) -> Dataset:
    """A local path, else a hub id (the spec's own when ``source`` is None)."""
    s = spec(name)
    if source is not None and Path(source).expanduser().exists():
        return _read_local(Path(source).expanduser())
    hub_id = source or s.hub_id
    if hub_id is None:
        raise ValueError(f"--dataset {name}: needs --dataset_path (a local file or a hub id)")
    if source is not None and path_shaped(source, LOCAL_SUFFIXES):
        raise FileNotFoundError(f"--dataset_path {source}: no such file or directory")
    import datasets

    try:
        return datasets.load_dataset(hub_id, s.config if source is None else None, split=split)
    except Exception as e:  # datasets raises many unrelated types for "cannot get it"
        where = f"--dataset_path {source}: no such local file or directory, and" if source else f"--dataset {name}:"
        raise FileNotFoundError(
            f"{where} loading hub data set {hub_id} failed ({_reason(e)}); "
            "pass a local .jsonl/.json/.parquet file as --dataset_path"
        ) from e


def _pick(row: dict[str, Any], fields: tuple[str, ...], what: str, columns: list[str]) -> Any:
    for f in fields:
        if row.get(f) is not None:
            return row[f]
    raise ValueError(f"data set row has no {what} column; expected one of {fields}, found {columns}")


def _is_conversation(messages: Any) -> bool:
    """Whether ``messages`` is a non-empty list of role/content messages (their text strings)."""
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def _conversation(row: dict[str, Any], columns: list[str]) -> list[dict[str, str]]:
    """A row's own prompt (``source_prompt``: a list of role/content messages), checked."""
    messages = row.get("source_prompt")
    if not _is_conversation(messages):
        raise ValueError(
            f"--prompt-style {SOURCE_STYLE}: data set row has no source_prompt conversation (a list of "
            f"role/content messages), found columns {columns}; use --prompt-style dapo"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _unhashed() -> dict[str, Any]:
    """Keyword arguments for a ``datasets`` transform of ours: a fingerprint given, so that ``datasets`` does not
    pickle our function to derive one (that hashing runs under a bare ``except:``, which swallowed a Ctrl-C landing
    in it: the training then ran to its end with status 0), and the result kept in memory, since a fingerprint not
    derived from the inputs must not name a cache file (these transforms take well under a second to redo)."""
    return {"new_fingerprint": generate_random_fingerprint(), "keep_in_memory": True}


def to_rows(raw: Dataset, s: DatasetSpec, style: str, where: str = "data set") -> Dataset:
    """Normalise a raw data set to ``prompt`` (messages in ``style``) + ``answer`` (gold string); ``where`` names
    the data (``--dataset_path FILE``) in the refusal of a row whose question or answer is not text."""
    columns = list(raw.column_names)

    def text(row: dict[str, Any], index: int, fields: tuple[str, ...], what: str) -> str:
        value = _pick(row, fields, what, columns)
        if what == "question" and isinstance(value, list) and _is_conversation(value):
            value = value[-1]["content"]  # already a conversation: keep its last turn's text
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(
                f"{where}: row {index}'s {what} is a {type(value).__name__}, expected text"
                f"{' or a list of chat messages' if what == 'question' else ''}"
            )
        return str(value)

    def convert(row: dict[str, Any], index: int) -> dict[str, Any]:
        if style == SOURCE_STYLE:
            prompt = _conversation(row, columns)
        else:
            prompt = chat_messages(text(row, index, s.question_fields, "question"), style)
        gold = text(row, index, s.answer_fields, "answer")
        return {"prompt": prompt, "answer": gsm8k_gold(gold) if s.reading == "numeric" else gold}

    return raw.map(convert, with_indices=True, remove_columns=columns, **_unhashed())


@dataclass(frozen=True)
class ArithmeticLevel:
    """How hard the synthetic questions are: ``a op b [op c]`` with operands in ``[1, max_operand]``."""

    term_counts: tuple[int, ...]
    ops: tuple[str, ...]
    max_operand: int
    non_negative: bool  # drop questions whose answer is negative (a 135M model mostly drops the sign)


#: Difficulty levels. ``hard`` is the original generator (same seeded stream). ``easy`` is what
#: SmolLM2-135M sampled at temperature 1.0 gets right often enough for GRPO groups to mix (measured on
#: CPU: 11% of samples rewarded, 30% of groups of 4 mixed; hard: 1-2%): see training/compare_smollm2.sh.
ARITHMETIC_LEVELS: dict[str, ArithmeticLevel] = {
    "easy": ArithmeticLevel((2,), ("+", "-"), 20, non_negative=True),
    "medium": ArithmeticLevel((2,), ("+", "-", "*"), 20, non_negative=False),
    "hard": ArithmeticLevel((2, 3), ("+", "-", "*"), 50, non_negative=False),
    # easy's operations on three-digit operands: a harder setting where exploration matters more (benchmarks.aqn)
    "long": ArithmeticLevel((2,), ("+", "-"), 999, non_negative=True),
}
#: Draws allowed per requested question before concluding that a level has too few distinct ones.
_MAX_DRAWS_PER_QUESTION = 50  # collecting all 610 easy ones takes ~9 per question on average


def arithmetic_level(name: str) -> ArithmeticLevel:
    if name not in ARITHMETIC_LEVELS:
        raise ValueError(f"--arithmetic-level: unknown {name!r}; expected one of {sorted(ARITHMETIC_LEVELS)}")
    return ARITHMETIC_LEVELS[name]


def arithmetic(num_samples: int = 2000, seed: int = 0, level: str = "hard") -> Dataset:
    """``num_samples`` distinct synthetic problems with integer answers, reproducible from ``seed``.

    Questions are distinct so that a held-out split never shares a question with the training rows.
    They are the first distinct ones of one seeded stream, so ``hard`` yields the original
    generator's rows with its repeats (~5% of 4000) dropped. ValueError when the level has fewer than
    ``num_samples`` distinct questions (``easy`` has 610).
    """
    lv = arithmetic_level(level)
    rng = random.Random(seed)
    questions: dict[str, str] = {}  # question -> answer, in draw order
    for _ in range(_MAX_DRAWS_PER_QUESTION * num_samples):
        if len(questions) == num_samples:
            break
        terms = [rng.randint(1, lv.max_operand) for _ in range(rng.choice(lv.term_counts))]
        ops = [rng.choice(lv.ops) for _ in terms[1:]]
        expr = " ".join([str(terms[0])] + [f"{op} {t}" for op, t in zip(ops, terms[1:], strict=True)])
        value = eval(expr, {"__builtins__": {}})  # noqa: S307 - digits and + - * only, built above
        if not (lv.non_negative and value < 0):
            questions.setdefault(f"What is {expr}?", str(value))
    if len(questions) < num_samples:
        raise ValueError(
            f"--num-samples {num_samples}: arithmetic level {level!r} has only {len(questions)} distinct questions"
        )
    return Dataset.from_dict({"question": list(questions), "answer": list(questions.values())})


def load_dataset(
    name: str,
    source: str | None = None,
    *,
    split: str = "train",
    num_samples: int | None = None,
    seed: int = 0,
    arithmetic_level: str | None = None,
    style: str | None = None,
) -> Dataset:
    """The named data set as ``prompt``/``answer`` rows; ``num_samples`` keeps the first N after a seeded shuffle.

    ``arithmetic_level`` (default ``hard``) applies to the generated ``arithmetic`` set only; ``style``
    (default: the set's own, ``prompt_style``) is the prompt style.
    """
    s = spec(name)
    style = prompt_style(name, style)
    generated = canonical(name) == "arithmetic" and source is None
    if arithmetic_level is not None and not generated:
        raise ValueError(f"--arithmetic-level: applies only to the generated --dataset arithmetic, not {name!r}")
    if generated:
        raw = arithmetic(num_samples or 2000, seed, arithmetic_level or "hard")
    else:
        raw = _read_source(name, source, split)
        if num_samples is not None:
            raw = raw.shuffle(seed=seed).select(range(min(num_samples, len(raw))))
    return to_rows(raw, s, style, data_name(name, source))


def data_name(name: str, source: str | None) -> str:
    """How messages name the data: ``--dataset_path FILE`` when one was given, else ``--dataset NAME``."""
    return f"--dataset_path {source}" if source is not None else f"--dataset {name}"


#: The default prompt budget in tokens, where the model's context leaves that much: the reference data sets' prompts
#: are far shorter (GSM8K's under 300 tokens), and unbounded ones (four 64 KB questions) ran a run out of memory.
DEFAULT_MAX_PROMPT_TOKENS = 4096


def prompt_budget(max_prompt_length: int | None, max_completion_length: int | None, model_dir: Path) -> int:
    """The longest prompt a run takes, in tokens (:func:`filter_prompt_length` drops longer ones): ``max_prompt_length``
    (``--max_prompt_length``), else the smaller of :data:`DEFAULT_MAX_PROMPT_TOKENS` and what the model's context
    (``max_position_embeddings`` of ``model_dir``'s config) leaves after ``max_completion_length``."""
    if max_prompt_length:
        return max_prompt_length
    context = read_config(model_dir).get("max_position_embeddings")
    if not isinstance(context, int) or isinstance(context, bool):
        return DEFAULT_MAX_PROMPT_TOKENS
    room = context - (max_completion_length or 0)
    if room < 1:  # the data set's default budget can exceed a small model's context: the context alone bounds
        logger.warning(
            "--max_completion_length %s is not less than the model's context (%d positions): prompts are "
            "bounded by the context alone",
            max_completion_length,
            context,
        )
        room = context
    return min(DEFAULT_MAX_PROMPT_TOKENS, room)


def filter_prompt_length(ds: Dataset, tokenizer: Any, max_tokens: int) -> Dataset:
    """Drop rows whose chat-templated prompt exceeds ``max_tokens`` (trl no longer truncates prompts).

    A prompt with more characters than ``max_tokens`` times the longest vocabulary entry certainly has more
    tokens, so it is dropped without tokenizing it (as eval bounds its prompts, ``eval.prompting``): one 64 MB
    question ran the tokenizer out of memory here."""
    if max_tokens is None or max_tokens <= 0:
        return ds
    max_chars = max_tokens * max(len(t) for t in tokenizer.get_vocab())

    def short(row: dict[str, Any]) -> bool:
        chars = sum(len(message["content"]) for message in row["prompt"])
        return chars <= max_chars and len(encode_chat(tokenizer, row["prompt"])) <= max_tokens

    return ds.filter(short, **_unhashed())


def train_heldout_split(ds: Dataset, heldout: int, seed: int = 0, where: str = "data set") -> tuple[Dataset, Dataset]:
    """A seeded split into (train, held-out) with ``heldout`` rows held out for before/after accuracy.

    Rows that repeat an earlier row's prompt are dropped first, with one warning naming ``where``: a copy on each
    side of the split measured the held-out accuracy on questions the run trained on. (Without held-out rows the
    data is trained as given: repeats are the user's weighting.)"""
    if heldout <= 0:
        return ds, ds.select([])
    first: dict[str, int] = {}
    for i, prompt in enumerate(ds["prompt"]):
        first.setdefault(json.dumps(prompt, sort_keys=True), i)
    if len(first) < len(ds):
        logger.warning(
            "dropped %d of %d rows of %s that repeat an earlier prompt, so that no held-out question is trained on",
            len(ds) - len(first),
            len(ds),
            where,
        )
        ds = ds.select(sorted(first.values()), **_unhashed())
    if heldout >= len(ds):
        raise ValueError(f"--heldout {heldout}: must be smaller than the data set ({len(ds)} rows)")
    parts = ds.train_test_split(test_size=heldout, seed=seed, shuffle=True)
    return parts["train"], parts["test"]
