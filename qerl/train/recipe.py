"""A ``--config`` recipe (``training/recipes/*.yaml``), read strictly before trl's parser sees it.

trl's parser reads a recipe with PyYAML and turns every value into a flag: it expanded a nested alias bomb of a few
lines past any memory, let a duplicate key's later value win without a word, and took any value for any key (a
list for ``lora_rank``), failing later with a traceback. :func:`load_recipe` refuses each of those in one line naming
the key; what it passes, trl parses as before (``qerl.train.args``).
"""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any

import yaml

#: What a recipe is, as its refusals say.
_FLAT = "a mapping of settings (key: value lines)"
#: A recipe is a page of settings: a larger file is refused before it is parsed.
MAX_RECIPE_BYTES = 1 << 20


class _RecipeLoader(yaml.SafeLoader):
    """YAML without anchors and aliases (a nested alias bomb of a few lines expands past any memory once trl turns
    its values into flags) and without duplicate keys (the later value silently won)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ValueError(f"line {event.start_mark.line + 1}: YAML anchors and aliases are not allowed in a recipe")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"line {key_node.start_mark.line + 1}: key {key} appears twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: str | Path, fields_of: tuple[type, ...]) -> dict[str, Any]:
    """The settings of recipe ``path``: a mapping read with :class:`_RecipeLoader`, every value of a known field of the
    ``fields_of`` dataclasses of that field's type (a string is left to the flag parser, which converts it as it
    converts a command line). ValueError (one line, naming the key) for anything else; unknown keys are the parser's."""
    path = Path(path)
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise ValueError(f"{path.stat().st_size} bytes; a recipe is at most {MAX_RECIPE_BYTES} bytes")
    try:
        recipe = yaml.load(path.read_text(encoding="utf-8"), Loader=_RecipeLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:  # a value nested thousands deep: the parser recurses once per level
        raise ValueError(f"nested too deeply to read; {_FLAT}") from None
    if not isinstance(recipe, dict):
        raise ValueError(f"expected {_FLAT}")
    hints = {name: hint for cls in fields_of for name, hint in typing.get_type_hints(cls).items()}
    for key, value in recipe.items():
        if key in hints and not isinstance(value, str) and _fits(value, hints[key]) is False:
            raise ValueError(f"key {key}: expected {_describe(hints[key])}, got {value!r}")
    return recipe


def _fits(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` (as YAML gives it) is of type ``hint``; None when the hint is not one this can judge."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_fits(value, arg) for arg in args]
        return True if True in verdicts else (False if all(v is False for v in verdicts) else None)
    if hint is type(None):
        return value is None
    if hint in (bool, int, float):
        numeric = (int, float) if hint is float else (int,)
        return isinstance(value, bool) if hint is bool else isinstance(value, numeric) and not isinstance(value, bool)
    if hint is str or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(isinstance(v, str) or _fits(v, args[0]) is not False for v in value)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    return None


def _describe(hint: Any) -> str:
    """``list[str] | None`` as 'a list of strings (or null)', for the refusal of a value of another type."""
    nouns = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "mapping"}
    words = []
    for arg in [a for a in typing.get_args(hint) if a is not type(None)] or [hint]:
        if typing.get_origin(arg) is list:
            words.append(f"a list of {nouns.get(typing.get_args(arg)[0], 'value')}s")
        else:
            noun = nouns.get(typing.get_origin(arg) or arg, getattr(arg, "__name__", str(arg)))
            words.append(("an " if noun[0] in "aeiou" else "a ") + noun)
    return " or ".join(words) + (" (or null)" if type(None) in typing.get_args(hint) else "")


__all__ = ["MAX_RECIPE_BYTES", "load_recipe"]
