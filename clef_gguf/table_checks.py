"""A settings table's values held to their types, bounds and paths (settings.py's tables call check_table in their
__post_init__): what the CLI's flags and a Ray config's pydantic check, for load()'s keywords, which reach the tables
unparsed. Apart from settings.py, which holds the settings themselves."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from .errors import SettingsError


def _allows(value: Any, hint: Any) -> bool:
    """Whether `value` is of the type `hint` names; a bool is no int here (True is no prompt limit)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_allows(value, h) for h in get_args(hint))
    if hint in (int, float):
        return isinstance(value, (int, hint)) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


def _named(hint: Any) -> str:
    names = [getattr(get_origin(h) or h, "__name__", str(h)) for h in get_args(hint) or (hint,)]
    return " or ".join("None" if n == "NoneType" else n for n in names)


def check_table(table: Any) -> None:
    """A table's values held to their types, bounds and paths, as the CLI's flags and a Ray config's pydantic hold
    them: load()'s keywords reach the tables unparsed. A SettingsError names the first value refused."""
    hints = get_type_hints(type(table))
    for f in fields(table):
        check_value(f.name, getattr(table, f.name), hints[f.name], f.metadata)


def check_value(name: str, value: Any, hint: Any, bounds: Mapping[str, Any]) -> None:
    """One setting's value held to its type hint and its bounds (`ge`, `le`); a path (a hint naming Path) not empty."""
    if not _allows(value, hint):
        raise SettingsError(f"{name} must be {_named(hint)}, not {value!r}")
    low, high = bounds.get("ge"), bounds.get("le")
    if isinstance(value, (int, float)) and ((low is not None and value < low) or (high is not None and value > high)):
        within = f">= {low}" if high is None else f"<= {high}" if low is None else f"between {low} and {high}"
        raise SettingsError(f"{name} must be {within}, not {value}")
    if value == "" and Path in (get_args(hint) or (hint,)):  # Path(""): the working directory, never meant
        raise SettingsError(f"{name} is an empty path")
