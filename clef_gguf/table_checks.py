"""A settings table's values held to their types, bounds and paths (settings.py's tables call check_table in their
__post_init__): what the CLI's flags and a Ray config's pydantic check, for load()'s keywords, which reach the tables
unparsed; and a SIZE flag's text read as bytes (parse_size). Apart from settings.py, which holds the settings themselves."""

from __future__ import annotations

import re
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


def parse_size(text: str) -> int:
    """'8GiB', '8 GB', '7.5G', '8192MiB' -> bytes (binary units: a card's "8 GB" is 8 GiB)."""
    m = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*([KMGTPE]?)(i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise SettingsError(f"not a size: {text!r} (try 8GiB)")
    size = float(m[1]) * 1024 ** " KMGTPE".index(m[2].upper() or " ")
    if size >= 2**63:  # 8 EiB: what no machine has, and no C int64 (llama.cpp's sizes) holds
        raise SettingsError(f"{text.strip()} is too large a size: sizes are below 8EiB")
    return int(size)
