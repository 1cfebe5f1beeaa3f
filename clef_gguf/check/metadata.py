"""The tokenizer llama.cpp builds, and the decision metadata: architecture, decision type, prompt template."""

from __future__ import annotations

import math
from itertools import repeat

import gguf
from gguf import GGUFValueType as VT
from gguf import Keys

from ..errors import ModelFileError
from ..format import contract as C
from ..format import temperatures as T
from ..format.header import Header
from ..format.template import TEMPLATE_SPECIAL_TOKENS, PromptTemplate
from .report import Problem

# clef-gguf 0.1.0 wrote its own layout under the same architecture name: recognized, and refused with the remedy.
OLD_DECISION_TYPE = "joint_schema"
OLD_HEAD_PREFIX = "head."
OLD_LAYOUT_MESSAGE = (
    "this file is in clef-gguf 0.1.0's own layout (clef.decision.type 'joint_schema', head.* tensors), which "
    "llama.cpp does not read: convert the release again with `clef-gguf convert`"
)

# Template special tokens must be parsed as one token each: llama.cpp does so for these types.
_SPECIAL_TOKEN_TYPES = frozenset({gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED})


def _string_array(h: Header, key: str) -> list[str] | None:
    f = h.fields.get(key)
    return f.value if f is not None and f.type == VT.ARRAY and f.item_type == VT.STRING else None


def check_tokenizer(h: Header) -> list[Problem]:
    """llama.cpp's BPE vocabulary (tokens, types, merges) and the special tokens the prompt template uses."""
    bad = []
    if h.get(Keys.Tokenizer.MODEL) != "gpt2":
        bad.append(f"{Keys.Tokenizer.MODEL} is {h.get(Keys.Tokenizer.MODEL)!r}, not 'gpt2' (byte-level BPE)")
    if h.get(Keys.Tokenizer.PRE) != C.BACKBONE_ARCH:
        bad.append(f"{Keys.Tokenizer.PRE} is {h.get(Keys.Tokenizer.PRE)!r}, not 'qwen35': prompts would tokenize differently")
    tokens = _string_array(h, Keys.Tokenizer.LIST)
    if not tokens:
        return [Problem("tokenizer", m) for m in [*bad, f"{Keys.Tokenizer.LIST} is missing or not a list of strings"]]
    types_field = h.fields.get(Keys.Tokenizer.TOKEN_TYPE)
    types = types_field.value if types_field is not None and types_field.item_type == VT.INT32 else None
    if types is None or len(types) != len(tokens):
        bad.append(f"{Keys.Tokenizer.TOKEN_TYPE} must be {len(tokens)} INT32 values, one per token")
        types = None
    elif min(types) < 1 or max(types) > max(gguf.TokenType):
        bad.append(f"{Keys.Tokenizer.TOKEN_TYPE} holds values that are not token types")
    merges = _string_array(h, Keys.Tokenizer.MERGES)
    if not merges:
        bad.append(f"{Keys.Tokenizer.MERGES} is missing or empty: llama.cpp refuses a BPE vocabulary without merges")
    elif min(map(str.find, merges, repeat(" "), repeat(1))) < 0:  # str.find(m, " ", 1) over ~250k merges, in C
        bad.append(f"{Keys.Tokenizer.MERGES} holds entries that are not two tokens separated by a space")
    # llama.cpp renames an empty token i to "[EMPTY_i]" and asserts (aborts) when two tokens share a text.
    if len(set(t or f"[EMPTY_{i}]" for i, t in enumerate(tokens))) != len(tokens):
        bad.append(f"{Keys.Tokenizer.LIST} holds the same token twice (llama.cpp reads an empty token i as [EMPTY_i])")
    for key in (k for k in h.fields if k.startswith(C.KEY_TOKENIZER_PREFIX) and k.endswith("_token_id")):
        f = h.fields[key]
        if f.type != VT.UINT32 or not 0 <= f.value < len(tokens):
            bad.append(f"{key} = {f.value!r} is not a UINT32 token id below {len(tokens)}")
    bad += _template_tokens(tokens, types)
    return [Problem("tokenizer", m) for m in bad]


def _template_tokens(tokens: list[str], types: list[int] | None) -> list[str]:
    ids = {t: tokens.index(t) for t in TEMPLATE_SPECIAL_TOKENS if t in tokens}
    missing = [t for t in TEMPLATE_SPECIAL_TOKENS if t not in ids]
    if missing:
        return [f"the vocabulary lacks the prompt template's special tokens {', '.join(missing)}"]
    plain = [t for t, i in ids.items() if types is not None and types[i] not in _SPECIAL_TOKEN_TYPES]
    if plain:
        return [
            f"the prompt template's special tokens {', '.join(plain)} are not CONTROL or USER_DEFINED tokens: "
            "llama.cpp would split them"
        ]
    return []


def check_decision_metadata(h: Header) -> tuple[list[Problem], PromptTemplate | None]:
    """The decision contract: architecture, decision type, and a systemone template the runtime renders (compiled)."""
    bad, template = [], None
    for key, want in {Keys.General.ARCHITECTURE: C.ARCH, C.KEY_DECISION_TYPE: C.DECISION_TYPE}.items():
        if h.get(key) != want:
            bad.append(f"{key} is {h.get(key)!r}; a Clef decision model has {want!r}")
    if h.get(C.KEY_NORMALIZER, "NFC") not in ("NFC", "none"):
        bad.append(f"{C.KEY_NORMALIZER} is {h.get(C.KEY_NORMALIZER)!r}, not 'NFC' or 'none'")
    text = h.get(C.KEY_TEMPLATE)
    if not isinstance(text, str):
        bad.append(f"{C.KEY_TEMPLATE} (the prompt) is missing")
    else:
        try:
            template = PromptTemplate(text)
        except ModelFileError as e:
            bad.append(str(e))
    return [Problem("decision", m) for m in bad], template


def check_temperatures(h: Header) -> tuple[list[Problem], list[str], dict[str, float]]:
    """The softmax temperatures (`clef.decision.temperature.<name>`): a problem for a value that is not a finite
    number > 0 (llama-server refuses <= 0, and would take NaN and infinity), a note for a name no question can use."""
    bad, notes, temperatures = [], [], {}
    usable = T.usable_temperature_names()
    for key, f in h.fields.items():
        if not key.startswith(C.KEY_TEMPERATURE_PREFIX):
            continue
        name, value = key[len(C.KEY_TEMPERATURE_PREFIX) :], f.value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            bad.append(f"{key} = {value!r}: a temperature must be a finite number > 0")
            continue
        temperatures[name] = float(value)
        if name not in usable:
            notes.append(
                f"{key} is used by no question (names: <type> or <type>.<bucket>, buckets 2, 3_5, 6_10, 11 by option count; "
                "noul has 2 options, score at most 10)"
            )
    return [Problem("decision", m) for m in bad], notes, dict(sorted(temperatures.items()))


def old_layout(h: Header) -> bool:
    """A file in clef-gguf 0.1.0's own layout (decision type joint_schema, head.* tensors)."""
    return h.get(C.KEY_DECISION_TYPE) == OLD_DECISION_TYPE or any(n.startswith(OLD_HEAD_PREFIX) for n in h.tensors)
