"""Hugging Face Clef release -> one Clef GGUF file.

Every output tensor is planned from the safetensors headers alone (name, shape,
type), so the GGUF header is written first; then each tensor is read, transformed
into llama.cpp's qwen35 layout, encoded and written, one at a time.

f32, f16, bf16 and q8_0 are encoded here (gguf-py's numpy quantizers). The K-quants,
their mixtures and IQ4 come from llama.cpp's own quantizer: the backbone is staged
as a bf16 qwen35 GGUF beside the output, quantized by llama.cpp, and grafted with
the head into the Clef file (graft.py), exactly as a downloaded backbone would be.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import gguf
import numpy as np

from ..errors import ConversionError, ReleaseError
from ..format import contract as C
from ..format import vision as V
from ..format.file_types import DEFAULT_FILE_TYPE, FILE_TYPES, LLAMA_FILE_TYPES
from ..outputs import refuse_inputs
from .graft import assemble, head_qtype, head_tensors, release_files, write_clef
from .lineage import Kv, source_keys
from .lora import checkpoint_files, is_checkpoint, needs_base, open_checkpoint
from .mmproj import MmprojPlan, no_tower_reason, plan_mmproj
from .mmproj import mmproj_type as resolve_mmproj_type
from .quantize import approx_bytes_per_weight, quantize
from .release import Release, backbone_hparams, open_release
from .vocab import Vocab, read_vocab
from .writer import (
    GT,
    OutTensor,
    Progress,
    atomic_output,
    check_free_space,
    check_output,
    encode,
    header_bytes,
    staging_dir,
    storage_type,
    write_gguf,
    write_metadata,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11; the annotation is never evaluated

NUMPY_FILE_TYPES: dict[str, tuple[GT, gguf.LlamaFileType]] = {
    "f32": (GT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (GT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (GT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (GT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


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
def backbone_tensors(release: Release, qtype: GT) -> list[OutTensor]:
    """The backbone in llama.cpp's names and layouts, in the contract's file order, produced on demand."""
    shape = release.backbone_shape()
    planned: list[OutTensor] = []
    used: set[str] = set()
    for tensor in C.backbone_tensors(shape):
        source = release.backbone.get(tensor.hf)
        if source is None:
            raise ReleaseError(f"{release.name}: tensor {tensor.hf} is missing")
        if int(np.prod(source.shape)) != int(np.prod(tensor.shape)):
            raise ReleaseError(f"{tensor.hf} has shape {list(source.shape)}, config.json implies {list(tensor.shape)}")
        qt = storage_type(tensor.gguf, tensor.shape, qtype)

        def produce(src=source, t=tensor, q=qt) -> np.ndarray:
            return encode(apply_transform(src.load(), t.transform, shape).reshape(t.shape), q)

        planned.append(OutTensor(tensor.gguf, tensor.shape, qt, produce))
        used.add(tensor.hf)
    unknown = [n for n in release.backbone if n not in used and n.startswith(C.HF_TEXT_PREFIX)]
    if unknown:
        raise ReleaseError(
            f"{release.name}: tensor {unknown[0]} is not part of a Qwen3.5 text backbone (and {len(unknown) - 1} more)"
        )
    return planned


def _n_weights(release: Release) -> int:
    return sum(int(np.prod(t.shape)) for t in release.backbone.values() if t.path.name.startswith("model"))


# --- Conversion ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Converted:
    """What a conversion wrote: the model, and its vision tower unless there was none or it was not asked for."""

    model: Path
    mmproj: Path | None
    note: str = ""  # why there is no mmproj, when the release has no vision tower


def default_mmproj_path(out: str | Path) -> Path:
    """Where convert writes the vision tower by default: `mmproj-<model stem>.gguf` beside the model, as llama.cpp names it."""
    out = Path(out)
    return out.with_name(V.default_mmproj_name(out.name))


def _mmproj_path(out: Path, mmproj: str | Path | bool | None) -> Path | None:
    if mmproj is None or mmproj is False:
        return None
    path = default_mmproj_path(out) if mmproj is True else Path(mmproj)
    if path.absolute() == out.absolute():
        raise ConversionError(f"the mmproj and the model cannot both be written to {out}")
    return path


class ConvertOptions(TypedDict, total=False):
    """convert_files' keyword arguments (and their defaults there), which convert passes on."""

    base: str | Path | None
    head_type: str
    imatrix: str | Path | None
    mmproj: str | Path | bool | None
    mmproj_type: str
    force: bool
    progress: Progress | None


def convert(source: str | Path, out: str | Path, file_type: str = DEFAULT_FILE_TYPE, **options: Unpack[ConvertOptions]) -> Path:
    """Convert a Clef release (folder or Hub repo id) to one Clef GGUF file at `out`; returns its path.

    The vision tower goes into llama.cpp's mmproj file: `mmproj=True` (the default) writes it beside
    `out` as `mmproj-<stem>.gguf` (default_mmproj_path), a path writes it there, False skips it. A release
    without a vision tower gets none, without an error (convert_files says so). `mmproj_type` is auto
    (the file type for f32/f16/bf16/q8_0, else f16) or one of those four. `head_type`, `imatrix`, `force`
    and `progress` are convert_files'.
    """
    return convert_files(source, out, file_type, **options).model


def convert_files(
    source: str | Path,
    out: str | Path,
    file_type: str = DEFAULT_FILE_TYPE,
    *,
    base: str | Path | None = None,
    head_type: str = "auto",
    imatrix: str | Path | None = None,
    mmproj: str | Path | bool | None = True,
    mmproj_type: str = "auto",
    force: bool = False,
    progress: Progress | None = None,
) -> Converted:
    """convert(), saying what it wrote: the model, the mmproj (or why none).

    `source` may be a clef-finetune checkpoint (adapter/ + joint_head.safetensors) with `base`, the release it was
    trained from: its LoRA is merged into the base's weights as they stream (lora.py), its head replaces the base's.
    """
    if file_type not in FILE_TYPES:
        raise ConversionError(f"unknown --type {file_type}; choose one of {', '.join(FILE_TYPES)}")
    head_qtype(head_type, None)  # an unknown --head-type fails before anything is read
    vision_type = resolve_mmproj_type(mmproj_type, file_type)  # an unknown type fails here too
    if imatrix is not None and file_type not in LLAMA_FILE_TYPES:
        raise ConversionError(f"--imatrix applies to llama.cpp's quantizations ({', '.join(LLAMA_FILE_TYPES)}), not {file_type}")
    out = Path(out)
    mmproj_out = _mmproj_path(out, mmproj)
    check_output(out, force)  # fail before any download or reading
    if mmproj_out is not None:
        check_output(mmproj_out, force)
    release, own_files = _open_source(source, base)
    # Before anything is written: where the weights came from, for the pairing of adapters (conversion/lineage.py).
    lineage = source_keys(release, open_release(base) if base is not None else None)
    inputs = [*release_files(release), *own_files, *([Path(imatrix)] if imatrix else [])]
    refuse_inputs(out, inputs)
    note = ""
    plan: MmprojPlan | None = None
    if mmproj_out is not None:
        refuse_inputs(mmproj_out, inputs)
        note = no_tower_reason(release) or ""
        # Planned before anything is written: a tower convert cannot write fails in seconds, not after the backbone.
        plan = None if note else plan_mmproj(release, vision_type)
    with ExitStack() as stack:
        if plan is not None and mmproj_out is not None:
            # Written first (it is small) under a temporary name, renamed only once the model is complete too,
            # so that a failed or interrupted conversion leaves neither file.
            tmp = stack.enter_context(atomic_output(mmproj_out, force))
            plan.write(tmp, release.name, progress)
        model = _convert_model(
            release, out, file_type, head_type=head_type, imatrix=imatrix, force=force, progress=progress, lineage=lineage
        )
    return Converted(model, mmproj_out if plan is not None else None, note + ": no mmproj written" if note else "")


def _open_source(source: str | Path, base: str | Path | None) -> tuple[Release, list[Path]]:
    """The release to convert, and the files besides the release's that the outputs must not overwrite."""
    path = Path(source).expanduser()
    if base is None:
        if path.is_dir() and is_checkpoint(path):
            raise needs_base(path)
        return open_release(source), []
    if path.is_symlink() and not path.exists():
        raise ReleaseError(f"{source}: a symbolic link that leads to no folder (a loop, or its target is gone)")
    if not (path.is_dir() and is_checkpoint(path)):
        raise ReleaseError(
            f"{source}: --base is for a clef-finetune checkpoint (adapter/ + joint_head.safetensors); this is not one"
        )
    return open_checkpoint(path, base), checkpoint_files(path)


def _convert_model(
    release: Release,
    out: Path,
    file_type: str,
    *,
    head_type: str,
    imatrix: str | Path | None,
    force: bool,
    progress: Progress | None,
    lineage: Kv,
) -> Path:
    shape = release.backbone_shape()
    vocab = read_vocab(release.tokenizer, release.tokenizer_config, shape.n_vocab, release.text_config.get("eos_token_id"))
    if release.head_config.hidden_size != shape.n_embd:
        raise ReleaseError(f"head hidden_size {release.head_config.hidden_size} != backbone hidden_size {shape.n_embd}")
    hparams = backbone_hparams(release)
    if file_type in LLAMA_FILE_TYPES:
        return _convert_with_llama(release, out, file_type, hparams, vocab, head_type, imatrix, force, progress, lineage)
    qtype, ftype = NUMPY_FILE_TYPES[file_type]
    tensors = backbone_tensors(release, qtype) + head_tensors(release, head_qtype(head_type, qtype))
    return write_clef(
        out,
        release,
        hparams,
        vocab,
        ftype,
        tensors,
        force=force,
        progress=progress,
        stage="converting",
        lineage=lineage,
    )


def _convert_with_llama(
    release: Release,
    out: Path,
    file_type: str,
    hparams: dict[str, object],
    vocab: Vocab,
    head_type: str,
    imatrix: str | Path | None,
    force: bool,
    progress: Progress | None,
    lineage: Kv,
) -> Path:
    n = _n_weights(release)
    # bf16 stage, quantized stage and output, each with its header
    check_free_space(out.parent, int(n * (2 + 2 * approx_bytes_per_weight(file_type))) + 3 * header_bytes(vocab, ()))
    with staging_dir(out) as stage:
        staged, quantized = stage / "backbone-bf16.gguf", stage / f"backbone-{file_type}.gguf"

        def metadata(w: gguf.GGUFWriter) -> None:
            write_metadata(
                w, name=release.name, hparams=hparams, vocab=vocab, file_type=gguf.LlamaFileType.MOSTLY_BF16, head=None
            )

        # bf16 is lossless for the released (bf16) weights and halves the staging disk.
        write_gguf(staged, C.BACKBONE_ARCH, metadata, backbone_tensors(release, GT.BF16), progress, "staging bf16")
        quantize(staged, quantized, file_type, Path(imatrix) if imatrix else None, progress)
        staged.unlink()
        return assemble(
            quantized,
            release,
            out,
            head_type=head_type,
            force=force,
            progress=progress,
            lineage=lineage,
        )
