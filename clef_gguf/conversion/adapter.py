"""A clef-finetune checkpoint -> a Clef adapter file over its base release (`convert CHECKPOINT --base R --to-adapter`).

Instead of merging the LoRA (lora.py), its pairs are written in llama.cpp's adapter layout (format/adapter.py):
each lora_A / lora_B follows the layout transform its weight follows in a model file (convert.apply_transform: a
row permutation of W applies to B's rows, a column permutation to A's columns), and PEFT's per-module scale
(rsLoRA, rank_pattern, alpha_pattern) is folded into B, since llama.cpp applies one alpha per file as alpha / rank.
The head is converted as a model's is (graft.head_tensors); only the tensors that differ from the base's are stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..errors import ConversionError, ReleaseError
from ..format import adapter as A
from ..format import contract as C
from ..format import lineage as L
from ..format.file_types import ADAPTER_FILE_TYPES, DEFAULT_ADAPTER_TYPE
from ..outputs import refuse_inputs
from .convert import NUMPY_FILE_TYPES, apply_transform, backbone_tensors
from .graft import head_qtype, head_tensors, release_files
from .lineage import release_digest
from .lora import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    MergedTensor,
    checkpoint_files,
    is_checkpoint,
    module_lora,
    open_checkpoint,
    read_adapter_config,
)
from .release import Release, open_release, reference_sha256
from .writer import GT, OutTensor, Progress, check_output, encode, storage_type, write_file


@dataclass(frozen=True)
class LoraPair:
    """One adapted weight: its GGUF tensor, the checkpoint's A and B, and the factor folded into B."""

    tensor: C.BackboneTensor
    merged: MergedTensor
    factor: float  # s_m * r_m / alpha_file: exactly 1 for a module with the file's alpha and no rsLoRA

    @property
    def rank(self) -> int:
        return int(self.merged.a.shape[0])


def release_fingerprint(release: Release) -> str:
    """format/adapter.model_fingerprint of the release's conversion, computed from the release (its norms, as a model
    file stores them)."""
    norms = [t for t in backbone_tensors(release, GT.F32) if A.is_fingerprint_tensor(t.name)]
    return A.norms_fingerprint((t.name, t.shape, t.data()) for t in norms)


def _order(t: C.BackboneTensor, shape: C.BackboneShape, axis: int) -> np.ndarray:
    """The model file's layout as a permutation of the release's along `axis`: its index i is the release's order[i]."""
    n = t.shape[axis]
    index = np.arange(n)
    if axis == 0 and t.transform in A.ROW_TRANSFORMS:
        return apply_transform(index.reshape(n, 1), t.transform, shape).reshape(n)
    if axis == 1 and t.transform in A.COLUMN_TRANSFORMS:
        return apply_transform(index.reshape(1, n), t.transform, shape).reshape(n)
    return index


def _sample_rows(pairs: list[LoraPair], shape: C.BackboneShape) -> list[tuple[LoraPair, int]]:
    """The (pair, model file row) whose update is largest per value, SAMPLE_ROWS_PER_TENSOR at most of one matrix,
    within SAMPLE_BUDGET values: where a merged LoRA stands out most from a quantization's error."""
    candidates = []
    for p in pairs:
        a, b = p.merged.a.load().astype(np.float64), p.merged.b.load().astype(np.float64)
        energy = np.einsum("ir,rs,is->i", b, a @ a.T, b)[_order(p.tensor, shape, 0)]  # |row i of B A|^2
        width = p.tensor.shape[1]
        candidates += [(float(energy[i]) / width, p, int(i)) for i in np.argsort(-energy)[: L.SAMPLE_ROWS_PER_TENSOR]]
    chosen, used = [], 0
    for score, p, row in sorted(candidates, key=lambda c: -c[0]):
        if score > 0 and used + p.tensor.shape[1] <= L.SAMPLE_BUDGET:
            chosen.append((p, row))
            used += p.tensor.shape[1]
    order = {id(p): i for i, p in enumerate(pairs)}
    return sorted(chosen, key=lambda c: (order[id(c[0])], c[1]))


def base_sample(pairs: list[LoraPair], shape: C.BackboneShape) -> dict[str, tuple[str, object]]:
    """The sample keys of format/lineage.py: rows of the base release's weights, in the model file's layout, and of
    the pair's update (PEFT's scale x B @ A, which alpha / r x B'A' applies) for the content check of a pair."""
    tensors, rows, widths, weights, delta = [], [], [], [], []
    chosen = _sample_rows(pairs, shape)
    for p in dict.fromkeys(p for p, _ in chosen):
        width, source, columns = p.tensor.shape[1], _order(p.tensor, shape, 0), _order(p.tensor, shape, 1)
        a, b = p.merged.a.load().astype(np.float64), p.merged.b.load().astype(np.float64) * p.merged.scale
        for row in (r for q, r in chosen if q is p):
            tensors.append(p.tensor.gguf)
            rows.append(row)
            widths.append(width)
            weights += p.merged.base.load_span(int(source[row]) * width, width)[columns].tolist()
            delta += (b[source[row]] @ a).astype(np.float32)[columns].tolist()
    return {
        L.KEY_SAMPLE_TENSORS: ("array", tensors),
        L.KEY_SAMPLE_ROWS: ("array", rows),
        L.KEY_SAMPLE_WIDTHS: ("array", widths),
        L.KEY_SAMPLE_WEIGHTS: ("array", weights),
        L.KEY_SAMPLE_DELTA: ("array", delta),
    }


def lora_pairs(tuned: Release, config: dict, alpha: float) -> list[LoraPair]:
    """The checkpoint's pairs in file order, each refused unless llama.cpp can apply it to a model tensor as it is."""
    shape = tuned.backbone_shape()
    targets = {t.hf: t for t in C.backbone_tensors(shape)}
    adaptable = A.adaptable(shape)
    pairs = []
    for hf, t in tuned.backbone.items():
        if not isinstance(t, MergedTensor):
            continue
        target = targets.get(hf)
        if target is None or target.gguf not in adaptable:
            raise ConversionError(
                f"the adapter adapts {hf}, which llama.cpp applies no LoRA to in a Clef model (only the layers' "
                "attention, linear attention and MLP projections): convert without --to-adapter to merge it"
            )
        lora = module_lora(config, hf.removesuffix(".weight"))
        factor = lora.alpha / alpha * (math.sqrt(lora.r) if config.get("use_rslora") else 1.0)
        pairs.append(LoraPair(target, t, factor))
    order = {name: i for i, name in enumerate(adaptable)}
    return sorted(pairs, key=lambda p: order[p.tensor.gguf])


def _lora_tensors(pairs: list[LoraPair], shape: C.BackboneShape, qtype: GT) -> list[OutTensor]:
    out = []
    for p in pairs:
        t = p.tensor
        a_shape, b_shape = (p.rank, t.shape[1]), (t.shape[0], p.rank)
        qa, qb = storage_type(t.gguf + A.LORA_A, a_shape, qtype), storage_type(t.gguf + A.LORA_B, b_shape, qtype)

        def lora_a(p: LoraPair = p, q: GT = qa) -> np.ndarray:
            a = p.merged.a.load()
            return encode(apply_transform(a, p.tensor.transform, shape) if p.tensor.transform in A.COLUMN_TRANSFORMS else a, q)

        def lora_b(p: LoraPair = p, q: GT = qb) -> np.ndarray:
            b = p.merged.b.load()
            if p.factor != 1.0:
                b = (b.astype(np.float64) * p.factor).astype(np.float32)
            return encode(apply_transform(b, p.tensor.transform, shape) if p.tensor.transform in A.ROW_TRANSFORMS else b, q)

        out += [OutTensor(t.gguf + A.LORA_A, a_shape, qa, lora_a), OutTensor(t.gguf + A.LORA_B, b_shape, qb, lora_b)]
    return out


def changed_head(tuned: Release, base: Release, qtype: GT) -> list[OutTensor]:
    """The fine-tune's head tensors whose converted float32 values differ from the base's, in `qtype`."""
    ours = {t.name: t for t in head_tensors(tuned, GT.F32)}
    theirs = {t.name: t for t in head_tensors(base, GT.F32)}
    return [t for t in head_tensors(tuned, qtype) if not np.array_equal(ours[t.name].data(), theirs[t.name].data())]


def _metadata(
    tuned: Release, base: Release, name: str, alpha: float, ftype: gguf.LlamaFileType, pairs: list[LoraPair], llama_server: bool
) -> dict[str, tuple[str, object]]:
    """The adapter's key-values beyond general.architecture: key -> (gguf-py value type, value)."""
    head, shape = tuned.head_config, tuned.backbone_shape()
    kv: dict[str, tuple[str, object]] = {
        gguf.Keys.General.NAME: ("string", name),
        A.KEY_GENERAL_TYPE: ("string", A.GENERAL_TYPE),
        gguf.Keys.General.FILE_TYPE: ("uint32", int(ftype)),
        gguf.Keys.General.QUANTIZATION_VERSION: ("uint32", gguf.GGML_QUANT_VERSION),
        A.KEY_ADAPTER_TYPE: ("string", A.ADAPTER_TYPE),
        A.KEY_ALPHA: ("float32", alpha),
        A.KEY_BASE_FINGERPRINT: ("string", release_fingerprint(base)),
        A.KEY_BASE_NAME: ("string", base.name),
        A.KEY_RANK: ("uint32", max(p.rank for p in pairs)),
        L.KEY_BASE_DIGEST: ("string", release_digest(base)),
        A.KEY_EMBEDDING_LENGTH: ("uint32", shape.n_embd),
        A.KEY_HEAD_WIDTH: ("uint32", head.width),
        A.KEY_HEAD_FEEDFORWARD: ("uint32", head.feedforward),
    }
    if not llama_server:  # the head's keys, as a model file has them (writer.write_metadata)
        kv |= {
            C.KEY_DECISION_TYPE: ("string", C.DECISION_TYPE),
            C.KEY_ROUTING_BLOCKS: ("uint32", head.routing_layers),
            C.KEY_JOINT_BLOCKS: ("uint32", head.layers),
            C.KEY_HEAD_COUNT: ("uint32", head.heads),
            C.KEY_HEAD_NORM_EPS: ("float32", head.norm_eps),
            C.KEY_REFERENCE_SHA256: ("string", reference_sha256(tuned)),
        }
    return kv | base_sample(pairs, shape)


def convert_adapter(
    checkpoint: str | Path,
    base: str | Path,
    out: str | Path,
    file_type: str = DEFAULT_ADAPTER_TYPE,
    *,
    head_type: str = "auto",
    llama_server: bool = False,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Write the Clef adapter file of a clef-finetune checkpoint trained over `base` (a release folder or repo id).

    `llama_server`: the variant llama-server's `--lora` loads (only the LoRA tensors and the adapter's keys; its
    loader aborts on any other tensor name), without the head.
    """
    if file_type not in ADAPTER_FILE_TYPES:
        raise ConversionError(f"an adapter's --type is one of {', '.join(ADAPTER_FILE_TYPES)}, not {file_type}")
    head_qtype(head_type, None)  # an unknown --head-type fails before anything is read
    out, path = Path(out), Path(checkpoint).expanduser()
    check_output(out, force)
    if not (path.is_dir() and is_checkpoint(path)):
        raise ReleaseError(f"{checkpoint}: --adapter converts a clef-finetune checkpoint (adapter/ + joint_head.safetensors)")
    tuned, base_release = open_checkpoint(path, base), open_release(base)
    refuse_inputs(out, [*release_files(base_release), *checkpoint_files(path)])
    config = read_adapter_config(path / ADAPTER_DIR / ADAPTER_CONFIG)
    alpha = float(config.get("lora_alpha", 8))
    qtype, ftype = NUMPY_FILE_TYPES[file_type]
    pairs = lora_pairs(tuned, config, alpha)
    tensors = _lora_tensors(pairs, tuned.backbone_shape(), qtype)
    if not llama_server:
        tensors += changed_head(tuned, base_release, head_qtype(head_type, qtype))
    kv = _metadata(tuned, base_release, path.name, alpha, ftype, pairs, llama_server)

    def metadata(w: gguf.GGUFWriter) -> None:
        for key, (kind, value) in kv.items():
            getattr(w, f"add_{kind}")(key, value)

    return write_file(out, metadata, tensors, 1 << 20, force=force, progress=progress, stage="writing the adapter")
