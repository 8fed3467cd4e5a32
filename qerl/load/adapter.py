"""What a LoRA adapter directory must be before peft or a merge reads it; export and evaluation both ask here, so an
adapter one of them refuses the other refuses too.

* ``adapter_config.json``: a regular file within ``qerl.fsutil.SMALL_FILE_BYTES`` whose numbers are in range: ``r``
  and ``rank_pattern`` values integers in [1, :data:`MAX_RANK`], ``lora_alpha`` and ``alpha_pattern`` values finite
  numbers in (0, :data:`MAX_ALPHA`]. A NaN or 1e40 alpha made export write NaN / Inf weights with exit status 0 and
  evaluation score garbage.
* Pattern keys: peft matches each key of ``rank_pattern`` / ``alpha_pattern`` as a regular expression against every
  module name (``re.match(rf"(.*\\.)?({key})$", name)``, ``peft.utils.other.get_pattern_key``), so a key with nested
  quantifiers backtracks for ever and hung both commands. A key must therefore be a plain module name or dotted
  suffix (letters, digits, ``_`` and ``.``, at most :data:`MAX_PATTERN_KEY` characters), which is what peft's suffix
  rule matches and what peft and qerl write; without quantifiers or groups such a key cannot backtrack.
* Module-name expressions: peft also builds regular expressions from a string ``target_modules`` or
  ``exclude_modules`` and from each ``modules_to_save`` and ``layers_pattern`` item, and matches them against every
  module name of the model when it wraps it (``((.*)*)*X`` as ``target_modules`` hung evaluation). These are used as
  given, but first matched here over the model's module names within :data:`PATTERN_BUDGET_S`
  (:func:`check_patterns`; the regex engine lets a signal interrupt it): real expressions take milliseconds.
* Weights: ``adapter_model.safetensors``, a regular file. A pickled ``adapter_model.bin`` is not read.
"""

from __future__ import annotations

import math
import re
import signal
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qerl.fsutil import check_regular, read_json

if TYPE_CHECKING:
    from peft import PeftConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: The largest LoRA rank taken (real adapters: 8 to 256).
MAX_RANK = 1 << 14
#: The largest LoRA alpha taken (real adapters: up to a few times the rank).
MAX_ALPHA = float(1 << 16)
#: The longest pattern key (a full module name of a 100-layer model is under 60 characters).
MAX_PATTERN_KEY = 256
_PLAIN_KEY = re.compile(rf"[A-Za-z0-9_.]{{1,{MAX_PATTERN_KEY}}}")
#: How long matching an adapter's module-name expressions over all of a model's module names may take.
PATTERN_BUDGET_S = 2.0


def adapter_files(path: Path, flag: str = "--lora") -> tuple[Path, Path]:
    """(``adapter_config.json``, ``adapter_model.safetensors``) of the adapter directory ``path``, each a regular file,
    or a one-line error naming what is missing (a ``.bin`` adapter is named as such)."""
    if not path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: not a directory; expected a peft adapter directory")
    config, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config.exists():
        raise FileNotFoundError(f"{flag} {path}: no {CONFIG_FILE}; expected a peft adapter directory")
    if not weights.exists():
        legacy = path / "adapter_model.bin"
        if legacy.exists():
            raise ValueError(f"{flag} {legacy}: only safetensors adapters are read (no {WEIGHTS_FILE} beside it)")
        raise FileNotFoundError(f"{flag} {path}: no {WEIGHTS_FILE} (only safetensors adapters are read)")
    check_regular(weights)
    return config, weights


def read_adapter_config(path: Path, flag: str = "--lora") -> tuple[PeftConfig, Path]:
    """The adapter's peft config (a ``LoraConfig`` for a LoRA adapter) and weights file, once :func:`check_values`
    passed on the raw JSON (peft does not look at the numbers, nor bound the patterns)."""
    from peft import PeftConfig  # peft is slow to import: only when an adapter is read

    config_file, weights = adapter_files(path, flag)
    raw = read_json(config_file)
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} {config_file}: expected a JSON object, got {type(raw).__name__}")
    check_values(raw, f"{flag} {config_file}")
    try:
        config = PeftConfig.from_pretrained(str(path))
    except Exception as e:  # peft raises TypeError/ValueError/KeyError for foreign configs
        raise ValueError(f"{flag} {config_file}: not a peft adapter config ({str(e).splitlines()[0]})") from None
    return config, weights


def check_values(raw: dict[str, Any], where: str) -> None:
    """Raise a one-line ``ValueError`` naming ``where`` and the field unless ranks, alphas and their patterns are
    in range and the pattern keys plain module names (see the module docstring)."""
    _check_number(raw.get("r", 8), "r", where, rank=True)
    _check_number(raw.get("lora_alpha", 8), "lora_alpha", where, rank=False)
    for field, rank in (("rank_pattern", True), ("alpha_pattern", False)):
        pattern = raw.get(field) or {}
        if not isinstance(pattern, dict):
            raise ValueError(f"{where}: {field} is {pattern!r}; expected an object of module names")
        for key, value in pattern.items():
            if not _PLAIN_KEY.fullmatch(key):
                raise ValueError(
                    f"{where}: {field} key {key[:80]!r} is not a plain module name (letters, digits, '_' and '.', "
                    f"at most {MAX_PATTERN_KEY} characters; regular expressions are not taken)"
                )
            _check_number(value, f"{field}[{key!r}]", where, rank=rank)


def _check_number(value: object, field: str, where: str, *, rank: bool) -> None:
    if rank:
        good = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_RANK
        expected = f"an integer from 1 to {MAX_RANK}"
    else:
        good = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_ALPHA
        expected = f"a finite number in (0, {MAX_ALPHA:g}]"  # NaN compares false: refused too
    if not good or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{where}: {field} is {value!r}; expected {expected}")


def peft_expressions(config: PeftConfig) -> list[tuple[str, str]]:
    """(field, regular expression) for each expression peft builds from ``config`` and matches against every module
    name when it wraps a model (peft's ``check_target_module_exists``), in peft's own templates."""
    found = []
    for field in ("target_modules", "exclude_modules"):
        value = getattr(config, field, None)
        if isinstance(value, str):
            found.append((field, rf"(?:{value})\Z"))
    for item in getattr(config, "modules_to_save", None) or []:
        found.append(("modules_to_save", rf"(^|.*\.){item}($|\..*)"))
    layers = getattr(config, "layers_pattern", None)
    for item in [layers] if isinstance(layers, str) else layers or []:
        found.append(("layers_pattern", rf"(?:^|.*?\.){item}\.(?P<idx>\d+)\."))
    return found


def check_patterns(config: PeftConfig, names: Iterable[str], where: str) -> None:
    """Raise a one-line ``ValueError`` naming ``where`` and the field when one of ``config``'s module-name expressions
    is not a regular expression, or does not get through ``names`` within :data:`PATTERN_BUDGET_S` (it backtracks:
    peft would never return). Outside the main thread no alarm can be set, and only the syntax is checked."""
    checks: list[tuple[str, Callable[[str], object]]] = []
    for field, expression in peft_expressions(config):
        try:
            checks.append((field, re.compile(expression).match))
        except (re.error, RecursionError, OverflowError) as e:
            raise ValueError(f"{where}: {field} is not a regular expression ({e})") from None
    if not checks or threading.current_thread() is not threading.main_thread():
        return
    names = list(names)

    def late(signum: int, frame: object) -> None:
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, PATTERN_BUDGET_S)
    try:
        while checks:
            for name in names:
                checks[0][1](name)
            checks.pop(0)
    except TimeoutError:
        raise ValueError(
            f"{where}: {checks[0][0]} does not match the model's {len(names)} module names within {PATTERN_BUDGET_S:g} s "
            "(a regular expression that backtracks, such as nested repeats); expected module names or a simple "
            "expression"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
