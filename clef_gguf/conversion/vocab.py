"""The release's tokenizer.json in llama.cpp's conventions for Qwen3.5.

llama.cpp tokenizes Qwen3.5 as byte-level BPE (`gpt2`) with the `qwen35`
pre-tokenizer. It does not apply tokenizer.json's normalizer, so the file records
it (`clef.tokenizer.normalizer`) and the runtime normalizes before tokenizing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import TokenType

from ..errors import ReleaseError

# Qwen3.5's split regex: what llama.cpp's `qwen35` pre-tokenizer implements.
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int
    pad_id: int | None
    normalizer: str  # "NFC" or "none"


def _split_patterns(node: dict[str, Any] | None) -> list[str]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get("pretokenizers", []) for p in _split_patterns(child)]
    if node.get("type") == "Split":
        pattern = node.get("pattern", {})
        return [pattern.get("Regex") or pattern.get("String") or ""]
    return []


def _normalizer(node: dict[str, Any] | None) -> str:
    if not node:
        return "none"
    kinds = [n.get("type") for n in node.get("normalizers", [])] if node.get("type") == "Sequence" else [node.get("type")]
    unknown = [k for k in kinds if k != "NFC"]
    if unknown:
        raise ReleaseError(f"tokenizer.json: normalizer {unknown[0]} is not supported (llama.cpp applies none)")
    return "NFC" if kinds else "none"


def _looks_special(text: str) -> bool:
    return text.startswith("<|") and text.endswith("|>")


def _token_id(config: dict[str, Any], key: str, ids: dict[str, int]) -> int | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return ids.get(value) if isinstance(value, str) else None


def read_vocab(tokenizer: dict[str, Any], tokenizer_config: dict[str, Any], n_vocab: int, eos_id: int | None) -> Vocab:
    model = tokenizer.get("model", {})
    if model.get("type") != "BPE":
        raise ReleaseError(f"tokenizer.json: model type {model.get('type')} is not byte-level BPE")
    if QWEN35_SPLIT not in _split_patterns(tokenizer.get("pre_tokenizer")):
        raise ReleaseError("tokenizer.json: the pre-tokenizer is not Qwen3.5's split regex (llama.cpp's qwen35)")
    ids: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in tokenizer.get("added_tokens", [])}
    ids |= {t["content"]: i for i, t in added.items()}
    if max(ids.values()) >= n_vocab:
        raise ReleaseError(f"tokenizer has token id {max(ids.values())} but the model's vocab_size is {n_vocab}")
    text_of = {i: t for t, i in ids.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i not in text_of:  # the embedding matrix is padded beyond the tokenizer
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(text_of[i])
            special = added[i].get("special") or _looks_special(text_of[i])
            types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        else:
            tokens.append(text_of[i])
            types.append(TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        raise ReleaseError("tokenizer.json has no BPE merges (llama.cpp refuses such a vocabulary)")
    eos = eos_id if eos_id is not None else _token_id(tokenizer_config, "eos_token", ids)
    if eos is None:
        raise ReleaseError("no end-of-sequence token in config.json or tokenizer_config.json")
    return Vocab(
        tokens=tokens,
        token_types=[int(t) for t in types],
        merges=merges,
        eos_id=eos,
        pad_id=_token_id(tokenizer_config, "pad_token", ids),
        normalizer=_normalizer(tokenizer.get("normalizer")),
    )
