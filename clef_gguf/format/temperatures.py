"""llama.cpp's softmax temperatures for decisions (tools/server/server-decision.cpp:51-66 and :682-700 of b11434).

Every key `clef.decision.temperature.<name>` (contract.KEY_TEMPERATURE_PREFIX) holds one, a float > 0 (llama-server
refuses to load a file with one <= 0). A question's scores are divided by the temperature of `<type>.<bucket>`, else
of `<type>`, else by 1, before the softmax; the bucket is its option count's.
"""

from __future__ import annotations

from collections.abc import Mapping

# The question types and how many options each may have (TypeSafe's schema; runtime/prompt.py enforces it).
OPTION_COUNTS = {"noul": (2, 2), "choice": (2, 255), "score": (2, 10)}

TEMPERATURE_BUCKETS = (("2", 2), ("3_5", 5), ("6_10", 10), ("11", 255))  # (name, the largest option count in it)


def temperature_bucket(n_options: int) -> str:
    return next(name for name, top in TEMPERATURE_BUCKETS if n_options <= top)


def temperature_names(qtype: str, n_options: int) -> tuple[str, str]:
    """The names a question's temperature is looked up by, in llama.cpp's order."""
    return f"{qtype}.{temperature_bucket(n_options)}", qtype


def temperature_of(temperatures: Mapping[str, float], qtype: str, n_options: int) -> float:
    return next((temperatures[n] for n in temperature_names(qtype, n_options) if n in temperatures), 1.0)


def usable_temperature_names() -> set[str]:
    """Every name some question can be looked up by: noul.11 or score.11 never is (at most 2 and 10 options)."""
    names = set(OPTION_COUNTS)
    for qtype, (low, high) in OPTION_COUNTS.items():
        names |= {f"{qtype}.{temperature_bucket(n)}" for n in range(low, high + 1)}
    return names
