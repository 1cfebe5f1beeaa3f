"""Clef-flash's real shapes with no weights downloaded: Qwen3.5-9B's backbone as *sparse* GGUF files (a real
header, a hole for the data), and the types llama.cpp's quantizer gives its tensors (a dry run).

tools/plan_reference.py (the README's memory table), tools/plan_vision.py (a sparse mmproj) and tools/shaped_model.py
(a Clef-flash-shaped file with random weights) start from these.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import gguf

from ..conversion.vocab import Vocab
from ..conversion.writer import GT, write_metadata
from ..format import contract as C
from ..llama import log as llama_log

# Qwen3.5-9B's text config (the Clef-flash backbone).
QWEN35_9B = C.BackboneShape(
    n_vocab=248320,
    n_embd=4096,
    n_ff=12288,
    n_layer=32,
    n_head=16,
    n_head_kv=4,
    head_dim=256,
    recurrent=tuple((i + 1) % 4 != 0 for i in range(32)),
    conv_kernel=4,
    k_heads=16,
    v_heads=32,
    linear_head_dim=128,
    tied=False,
)
HPARAMS: dict[str, object] = {
    "context_length": 262144,
    "embedding_length": 4096,
    "block_count": 32,
    "feed_forward_length": 12288,
    "attention.head_count": 16,
    "attention.head_count_kv": 4,
    "attention.key_length": 256,
    "attention.value_length": 256,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "attention.recurrent_layers": list(QWEN35_9B.recurrent),
    "rope.freq_base": 10_000_000.0,
    "rope.dimension_count": 64,
    "rope.dimension_sections": [11, 11, 10, 0],
    "ssm.conv_kernel": 4,
    "ssm.state_size": 128,
    "ssm.group_count": 16,
    "ssm.time_step_rank": 32,
    "ssm.inner_size": 4096,
    "full_attention_interval": 4,
}
_DRY_RUN_LINE = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s.*?(?:->\s+[\d.]+ MiB \((\w+)\)|size =\s+[\d.]+ MiB\n)", re.S)


def byte_level_vocab(n_vocab: int) -> Vocab:
    """GPT-2's byte alphabet, one merge, and unused padding up to the real vocabulary size."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    alphabet, extra = [], 0
    for b in range(256):
        alphabet.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    tokens = [*alphabet, "Ġt", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    padding = n_vocab - len(tokens)
    return Vocab(
        tokens=tokens + [f"[PAD{i}]" for i in range(len(tokens), n_vocab)],
        token_types=[int(t) for t in types] + [int(gguf.TokenType.UNUSED)] * padding,
        merges=["Ġ t"],
        eos_id=len(tokens) - 1,
        pad_id=None,
        normalizer="NFC",
    )


def write_sparse(path: Path, types: dict[str, GT]) -> None:
    """A qwen35 GGUF whose data section is a hole: real header, real size, no weights."""
    shapes = C.backbone_tensor_shapes(QWEN35_9B)
    writer = gguf.GGUFWriter(path, C.BACKBONE_ARCH)
    vocab = byte_level_vocab(QWEN35_9B.n_vocab)
    write_metadata(writer, name="Qwen3.5-9B (shapes only)", hparams=HPARAMS, vocab=vocab, file_type=0, head=None)
    finish_sparse(writer, path, {name: (shape, types[name]) for name, shape in shapes.items()})


def finish_sparse(writer: gguf.GGUFWriter, path: Path, tensors: dict[str, tuple[tuple[int, ...], GT]]) -> int:
    """Write a GGUF's tensor infos after the keys already added, and a hole for its data; the data's bytes."""
    total = 0
    for name, (shape, qtype) in tensors.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = int(gguf.np.prod(shape)) // block * size
        byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype) if qtype not in (GT.F32, GT.F16) else shape
        dtype = {GT.F32: gguf.np.float32, GT.F16: gguf.np.float16}.get(qtype, gguf.np.uint8)
        writer.add_tensor_info(name, byte_shape, gguf.np.dtype(dtype), n_bytes, raw_dtype=qtype)
        total += -(-n_bytes // 32) * 32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    header_end = writer.fout[0].tell()
    writer.close()
    os.truncate(path, -(-header_end // 32) * 32 + total)
    return total


def mixture(bf16: Path, file_type: int) -> dict[str, GT]:
    """The type llama.cpp's quantizer gives every tensor (a dry run: nothing is quantized)."""
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = file_type
    params.dry_run = True
    lines: list[str] = []
    with llama_log.capture_info(lines.append):
        status = L.llama_model_quantize(str(bf16).encode(), str(bf16.with_suffix(".out")).encode(), ctypes.byref(params))
    assert status == 0, llama_log.last_error("dry run failed")
    types = {}
    for m in _DRY_RUN_LINE.finditer("".join(lines)):
        types[m[1]] = GT[m[2].upper()] if m[2] else GT.F32
    return types
