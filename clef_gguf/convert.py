"""Hugging Face Clef release -> one Clef GGUF file.

Two passes over the tensors: the first plans every output tensor (name, shape,
type) from the safetensors headers alone, so that the GGUF header can be written;
the second reads, transforms, quantizes and writes one tensor at a time. The file
is written under a temporary name beside the output and renamed at the end.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from . import contract as C
from .errors import ConversionError, ReleaseError
from .release import REFERENCE_CODE, Release, StoredTensor, open_release
from .vocab import Vocab, read_vocab

GT = gguf.GGMLQuantizationType
FILE_TYPES: dict[str, tuple[GT, gguf.LlamaFileType]] = {
    "f32": (GT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (GT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (GT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (GT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
Progress = Callable[[int, int, str], None]  # (done, total, tensor name)


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # GGUF name
    source: StoredTensor
    transform: C.Transform
    shape: tuple[int, ...]  # numpy order, after the transform
    qtype: GT


# --- Tensor transforms (llama.cpp's qwen35 layout) -----------------------------------------
def _v_head_order(x: np.ndarray, axis: int, k_heads: int, v_heads: int, head_dim: int) -> np.ndarray:
    """HF groups V heads by K head; ggml broadcasts K heads tiled: reorder grouped -> tiled."""
    shape = x.shape
    split = shape[:axis] + (k_heads, v_heads // k_heads, head_dim) + shape[axis + 1 :]
    return np.swapaxes(x.reshape(split), axis, axis + 1).reshape(shape)


def apply_transform(x: np.ndarray, t: C.Transform, s: C.BackboneShape) -> np.ndarray:
    def v_order(a: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
        return _v_head_order(a, axis, s.k_heads, s.v_heads, head_dim)

    qk_rows = 2 * s.k_heads * s.linear_head_dim
    match t:
        case C.Transform.NONE:
            return x
        case C.Transform.NORM_PLUS_ONE:
            return x + 1.0
        case C.Transform.NEG_EXP:
            return v_order(-np.exp(x), 0, 1)
        case C.Transform.V_HEADS_1D | C.Transform.V_HEAD_ROWS:
            return v_order(x, 0, 1)
        case C.Transform.V_ROWS:
            return v_order(x, 0, s.linear_head_dim)
        case C.Transform.V_COLUMNS:
            return v_order(x, 1, s.linear_head_dim)
        case C.Transform.QKV_ROWS:
            return np.concatenate([x[:qk_rows], v_order(x[qk_rows:], 0, s.linear_head_dim)])
        case C.Transform.CONV1D:
            x = x.reshape(x.shape[0], x.shape[-1])
            return np.concatenate([x[:qk_rows], v_order(x[qk_rows:], 0, s.linear_head_dim)])
    raise AssertionError(t)


# --- Planning ---------------------------------------------------------------------------------
def _qtype_for(name: str, shape: tuple[int, ...], qtype: GT) -> GT:
    if len(shape) <= 1 or name.endswith(C.F32_ONLY_SUFFIXES):
        return GT.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        return GT.F16  # rows not a multiple of the block: llama.cpp's converter falls back to F16 too
    return qtype


def plan_backbone(release: Release, qtype: GT) -> list[PlannedTensor]:
    shape = release.backbone_shape()
    expected = C.backbone_tensor_shapes(shape)
    rules = [(r, r.hf, r.gguf) for r in C.GLOBAL_RULES]
    for bid, recurrent in enumerate(shape.recurrent):
        rules += [(r, f"{C.HF_TEXT_PREFIX}layers.{bid}.{r.hf}", f"blk.{bid}.{r.gguf}") for r in C.layer_rules(recurrent)]
    planned: list[PlannedTensor] = []
    used: set[str] = set()
    for rule, hf_name, gguf_name in rules:
        if gguf_name not in expected:
            continue  # output.weight of a tied release
        source = release.backbone.get(hf_name)
        if source is None:
            raise ReleaseError(f"{release.name}: tensor {hf_name} is missing")
        out_shape = expected[gguf_name]
        if int(np.prod(source.shape)) != int(np.prod(out_shape)):
            raise ReleaseError(f"{hf_name} has shape {list(source.shape)}, config.json implies {list(out_shape)}")
        planned.append(PlannedTensor(gguf_name, source, rule.transform, out_shape, _qtype_for(gguf_name, out_shape, qtype)))
        used.add(hf_name)
    unknown = [n for n in release.backbone if n not in used and n.startswith(C.HF_TEXT_PREFIX)]
    if unknown:
        raise ReleaseError(
            f"{release.name}: tensor {unknown[0]} is not part of a Qwen3.5 text backbone (and {len(unknown) - 1} more)"
        )
    return planned


def plan_head(release: Release) -> list[PlannedTensor]:
    expected = C.head_tensor_shapes(release.head_config)
    if set(expected) != set(release.head):
        missing = sorted(set(expected) - set(release.head)) or sorted(set(release.head) - set(expected))
        raise ReleaseError(
            f"joint_head.safetensors does not match joint_head_config.json: {missing[0]} ({len(missing)} tensors differ)"
        )
    planned = []
    for name, shape in expected.items():
        source = release.head[name]
        if int(np.prod(source.shape)) != int(np.prod(shape)) or (source.shape and source.shape != shape):
            raise ReleaseError(f"head tensor {name} has shape {list(source.shape)}, joint_head_config.json implies {list(shape)}")
        planned.append(PlannedTensor(C.HEAD_PREFIX + name, source, C.Transform.NONE, shape, GT.F32))
    return planned


# --- Metadata -------------------------------------------------------------------------------------
def backbone_metadata(release: Release) -> dict[str, object]:
    c = release.text_config
    s = release.backbone_shape()
    rope = c.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    values: dict[str, object] = {
        "context_length": c.get("max_position_embeddings", 262144),
        "embedding_length": s.n_embd,
        "block_count": s.n_layer,
        "feed_forward_length": s.n_ff,
        "attention.head_count": s.n_head,
        "attention.head_count_kv": s.n_head_kv,
        "attention.key_length": s.head_dim,
        "attention.value_length": s.head_dim,
        "attention.layer_norm_rms_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        "attention.recurrent_layers": list(s.recurrent),
        "rope.freq_base": float(rope.get("rope_theta", c.get("rope_theta", 10_000_000.0))),
        "rope.dimension_count": int(s.head_dim * partial),
        "rope.dimension_sections": (sections + [0, 0, 0, 0])[:4],
        "ssm.conv_kernel": s.conv_kernel,
        "ssm.state_size": s.linear_head_dim,
        "ssm.group_count": s.k_heads,
        "ssm.time_step_rank": s.v_heads,
        "ssm.inner_size": s.v_heads * s.linear_head_dim,
        "full_attention_interval": c.get("full_attention_interval", 4),
    }
    assert set(values) == set(C.BACKBONE_KEY_SUFFIXES)
    return values


def _reference_sha256(release: Release) -> str:
    path = release.root / REFERENCE_CODE
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def write_metadata(w: gguf.GGUFWriter, release: Release, vocab: Vocab, ftype: gguf.LlamaFileType) -> None:
    w.add_name(release.name)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_string(C.KEY_DECISION_TYPE, C.DECISION_TYPE)
    w.add_string(C.KEY_BACKBONE_ARCH, C.BACKBONE_ARCH)
    w.add_string(C.KEY_VISION, C.VISION_NOT_CONVERTED)
    w.add_string(C.KEY_REFERENCE_SHA256, _reference_sha256(release))
    w.add_string(C.KEY_NORMALIZER, vocab.normalizer)
    for suffix, value in backbone_metadata(release).items():
        key = C.backbone_key(suffix)
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    for field in C.HEAD_CONFIG_FIELDS:
        w.add_uint32(C.head_key(field), getattr(release.head_config, field))
    for name, text in C.PROMPT_TEMPLATE.items():
        w.add_string(C.prompt_key(name), text)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_eos_token_id(vocab.eos_id)
    if vocab.pad_id is not None:
        w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(False)


# --- Writing -------------------------------------------------------------------------------------
def encode(x: np.ndarray, qtype: GT) -> np.ndarray:
    if qtype == GT.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if qtype == GT.F16:
        return np.ascontiguousarray(x, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)


def nbytes(shape: tuple[int, ...], qtype: GT) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * type_size


@contextmanager
def atomic_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary path beside `out`; rename it to `out` only on success."""
    if out.exists() and not force:
        raise ConversionError(f"{out} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise ConversionError(f"{out.parent} is not a directory")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def convert(
    source: str | Path,
    out: str | Path,
    file_type: str = "q8_0",
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Convert a Clef release (folder or Hub repo id) to one Clef GGUF file at `out`."""
    if file_type not in FILE_TYPES:
        raise ConversionError(f"unknown --type {file_type}; choose one of {', '.join(FILE_TYPES)}")
    out = Path(out)
    if out.exists() and not force:  # fail before any download or reading
        raise ConversionError(f"{out} exists; pass --force to overwrite it")
    qtype, ftype = FILE_TYPES[file_type]
    release = open_release(source)
    shape = release.backbone_shape()
    vocab = read_vocab(release.tokenizer, release.tokenizer_config, shape.n_vocab, release.text_config.get("eos_token_id"))
    if release.head_config.hidden_size != shape.n_embd:
        raise ReleaseError(f"head hidden_size {release.head_config.hidden_size} != backbone hidden_size {shape.n_embd}")
    # Backbone first and contiguous from offset 0: the runtime's qwen35 view needs it.
    planned = plan_backbone(release, qtype) + plan_head(release)
    with atomic_output(out, force) as tmp:
        writer = gguf.GGUFWriter(tmp, C.ARCH)
        try:
            write_metadata(writer, release, vocab, ftype)
            for t in planned:
                byte_shape = gguf.quant_shape_to_byte_shape(t.shape, t.qtype) if t.qtype not in (GT.F32, GT.F16) else t.shape
                dtype = {GT.F32: np.float32, GT.F16: np.float16}.get(t.qtype, np.uint8)
                writer.add_tensor_info(t.name, byte_shape, np.dtype(dtype), nbytes(t.shape, t.qtype), raw_dtype=t.qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for i, t in enumerate(planned):
                data = apply_transform(t.source.load(), t.transform, shape).reshape(t.shape)
                writer.write_tensor_data(encode(data, t.qtype))
                if progress:
                    progress(i + 1, len(planned), t.name)
            for f in writer.fout or []:
                f.flush()
                os.fsync(f.fileno())
        finally:
            writer.close()
    return out
