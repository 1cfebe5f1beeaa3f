"""Writing GGUF files: streamed tensor by tensor, under a temporary name.

Both conversion (tensors produced from safetensors) and grafting (tensors copied
from another GGUF) describe their tensors up front as `OutTensor`s, so the header is
written first and then each tensor's bytes are produced, written and dropped.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from . import contract as C
from .errors import ConversionError
from .vocab import Vocab

GT = gguf.GGMLQuantizationType
Progress = Callable[[str, int, int, str], None]  # (stage, done, total, item)


@dataclass(frozen=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    qtype: GT
    data: Callable[[], np.ndarray]  # exactly the tensor's bytes (any dtype), produced on demand

    @property
    def n_bytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape, dtype=np.int64)) // block * type_size


def storage_type(name: str, shape: tuple[int, ...], wanted: GT) -> GT:
    """The type a tensor is stored in when `wanted` is asked for (llama.cpp's converter rules)."""
    if len(shape) <= 1 or name.endswith(C.F32_ONLY_SUFFIXES):
        return GT.F32
    if shape[-1] % gguf.GGML_QUANT_SIZES[wanted][0]:
        return GT.F16  # rows not whole blocks: llama.cpp's converter falls back to F16 too
    return wanted


def encode(x: np.ndarray, qtype: GT) -> np.ndarray:
    """float32 values -> the bytes of `qtype` (numpy quantizers of gguf-py)."""
    if qtype == GT.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if qtype == GT.F16:
        return np.ascontiguousarray(x, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)


def check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise ConversionError(
            f"{directory} has {free / 2**30:.1f} GiB free; this conversion needs about {needed / 2**30:.1f} GiB"
        )


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


@contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A scratch folder beside `out` (same disk), removed whatever happens."""
    path = out.with_name(f".{out.name}.{os.getpid()}.stage")
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_metadata(
    w: gguf.GGUFWriter,
    *,
    name: str,
    hparams: dict[str, object],
    vocab: Vocab,
    file_type: int,
    head: C.HeadConfig | None,
    reference_sha256: str = "",
) -> None:
    """Key-values of a Clef file (head given) or of a plain qwen35 backbone (head None)."""
    arch = C.ARCH if head is not None else C.BACKBONE_ARCH
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for suffix in C.BACKBONE_KEY_SUFFIXES:
        key, value = f"{arch}.{suffix}", hparams[suffix]
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    if head is not None:
        w.add_string(C.KEY_DECISION_TYPE, C.DECISION_TYPE)
        w.add_string(C.KEY_BACKBONE_ARCH, C.BACKBONE_ARCH)
        w.add_string(C.KEY_VISION, C.VISION_NOT_CONVERTED)
        w.add_string(C.KEY_REFERENCE_SHA256, reference_sha256)
        w.add_string(C.KEY_NORMALIZER, vocab.normalizer)
        for field in C.HEAD_CONFIG_FIELDS:
            w.add_uint32(C.head_key(field), getattr(head, field))
        for key, text in C.PROMPT_TEMPLATE.items():
            w.add_string(C.prompt_key(key), text)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_eos_token_id(vocab.eos_id)
    if vocab.pad_id is not None:
        w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(False)


def write_gguf(
    path: Path,
    arch: str,
    metadata: Callable[[gguf.GGUFWriter], None],
    tensors: list[OutTensor],
    progress: Progress | None = None,
    stage: str = "writing",
) -> None:
    """Write a GGUF: header from the descriptions, then each tensor's bytes in order."""
    writer = gguf.GGUFWriter(path, arch)
    try:
        metadata(writer)
        for t in tensors:
            if t.qtype in (GT.F32, GT.F16):
                byte_shape, dtype = t.shape, np.dtype(np.float32 if t.qtype == GT.F32 else np.float16)
            else:
                byte_shape, dtype = gguf.quant_shape_to_byte_shape(t.shape, t.qtype), np.dtype(np.uint8)
            writer.add_tensor_info(t.name, byte_shape, dtype, t.n_bytes, raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, t in enumerate(tensors):
            data = t.data()
            if data.nbytes != t.n_bytes:
                raise ConversionError(f"tensor {t.name}: {data.nbytes} bytes produced, {t.n_bytes} expected")
            writer.write_tensor_data(data)
            if progress:
                progress(stage, i + 1, len(tensors), t.name)
        for f in writer.fout or []:
            f.flush()
            os.fsync(f.fileno())
    finally:
        writer.close()
