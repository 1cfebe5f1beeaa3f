"""llama-server as the peer: requests as it accepts them, and the placement flags that make it run our kernels."""

from __future__ import annotations

import unicodedata
from typing import Any


def nfc(value: Any) -> Any:
    """Every string in `value` in Unicode NFC."""
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, list):
        return [nfc(v) for v in value]
    if isinstance(value, dict):
        return {nfc(k): nfc(v) for k, v in value.items()}
    return value


def as_llama_server_accepts(request: dict[str, Any]) -> dict[str, Any]:
    """The request where llama-server departs from the reference (docs/format.md), made so that both answer alike:
    its text in NFC, and a question without instructions given its id as instructions (the reference's rule, which
    llama-server answers with HTTP 400 instead). clef-gguf answers the result as it answers the original."""
    request = nfc(request)  # (a copy: nfc builds new containers)
    for qid, q in request["questions"].items():
        if q.get("instructions") in (None, ""):
            q["instructions"] = qid
    return request


def placement_flags() -> list[str]:
    """llama-server's flags for the weights' placement clef-gguf makes on this CPU (llama/cpu_buffers.py): ggml's
    repacked layouts, both servers' default, unless the CPU has AMX, where clef-gguf keeps them off and
    llama-server aborts loading a K-quant file without --no-repack (FACTS). The same kernels then run in both."""
    from ..llama.cpu_buffers import AMX, extra_buffer_types

    return ["--no-repack"] if AMX in extra_buffer_types() else []
