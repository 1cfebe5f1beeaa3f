"""A qwen35 backbone GGUF + a release's head -> a complete Clef GGUF.

For the many who downloaded an early backbone-only conversion (any quantization):
the backbone's tensors are copied byte for byte (never re-quantized), the head, its
config, the prompt template and the decision metadata come from the release. The
two must belong together: shapes, layer types and tokenizer are compared, and a
mismatch is refused with what differs. convert's llama.cpp path ends here too.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import gguf
import numpy as np
from gguf import Keys

from ..errors import ConversionError, ModelFileError
from ..format import contract as C
from ..format.header import GGUFFile, Header
from ..format.hparams import backbone_shape
from ..outputs import refuse_inputs
from .lineage import Kv
from .release import Release, backbone_hparams, open_release, reference_sha256
from .vocab import Vocab, read_vocab
from .writer import (
    GT,
    OutTensor,
    Progress,
    check_output,
    encode,
    header_bytes,
    storage_type,
    write_file,
    write_metadata,
)

# --head-type: "auto" is what llama.cpp's converter writes for the direct types (the head's 2-D weights in
# the file type: f32, f16, bf16, q8_0), and F32 under llama.cpp's quantizations (the head is small next to
# the backbone, and its logits are scaled by up to 100).
HEAD_TYPES = {"auto": None, "f32": GT.F32, "f16": GT.F16, "bf16": GT.BF16, "q8_0": GT.Q8_0}


class MismatchError(ConversionError):
    """The backbone and the release do not belong together."""


def head_qtype(head_type: str, file_qtype: GT | None) -> GT:
    """The type asked for the head's 2-D weights (storage_type keeps biases, norms and token_types F32)."""
    if head_type not in HEAD_TYPES:
        raise ConversionError(f"unknown --head-type {head_type}; choose one of {', '.join(HEAD_TYPES)}")
    wanted = HEAD_TYPES[head_type]
    if wanted is None:  # auto (GT.F32 is 0: test for None, not truth)
        return GT.F32 if file_qtype is None else file_qtype
    return wanted


def head_tensors(release: Release, qtype: GT) -> list[OutTensor]:
    """The head in llama.cpp's Clef layout (contract.head_rules): in_proj split into q, k, v; decision.scales."""
    config = release.head_config
    expected = C.reference_head_shapes(config)
    if set(expected) != set(release.head):
        differ = sorted(set(expected) ^ set(release.head))
        raise ConversionError(
            f"joint_head.safetensors does not match joint_head_config.json: {differ[0]} ({len(differ)} tensors differ)"
        )
    for name, shape in expected.items():
        source = release.head[name]
        if int(np.prod(source.shape)) != int(np.prod(shape)) or (source.shape and source.shape != shape):
            raise ConversionError(
                f"head tensor {name} has shape {list(source.shape)}, joint_head_config.json implies {list(shape)}"
            )
    shapes = C.head_tensor_shapes(config)
    tensors = []
    for rule in C.head_rules(config):
        shape = shapes[rule.gguf]
        wanted = storage_type(rule.gguf, shape, qtype)

        def produce(r=rule, s=shape, q=wanted) -> np.ndarray:
            x = release.head[r.reference].load().reshape(expected[r.reference])
            if r.part is not None:  # whole rows of the packed in_proj
                x = x[r.part * s[0] : (r.part + 1) * s[0]]
            return encode(x.reshape(s), q)

        tensors.append(OutTensor(rule.gguf, shape, wanted, produce))

    def scales() -> np.ndarray:
        values = (float(release.head[n].load().reshape(())) for n in C.SCALE_PARAMETERS)
        return np.array(C.inference_scales(*values), dtype=np.float32)  # float64 math, one rounding, as llama.cpp

    tensors.append(OutTensor(C.SCALES, shapes[C.SCALES], GT.F32, scales))
    return tensors


# --- Reading a backbone GGUF ---------------------------------------------------------------------
def _hparams(h: Header, what: str) -> dict[str, object]:
    """The backbone's hyperparameter values, to compare with the release's and to copy into the Clef file.

    Checked by the one reader (format/hparams.py), which derives the recurrent layers when a file
    only has full_attention_interval, as llama.cpp does.
    """
    shape = backbone_shape(h, what)
    prefix = f"{C.BACKBONE_ARCH}."
    values = {s: h.get(prefix + s) for s in C.BACKBONE_KEY_SUFFIXES}
    values["attention.recurrent_layers"] = list(shape.recurrent)
    values["full_attention_interval"] = shape.recurrent.index(False) + 1
    missing = [s for s, v in values.items() if v is None]
    if missing:
        raise ModelFileError(f"the backbone lacks {prefix}{missing[0]} ({len(missing)} keys missing)")
    return values


def _vocab(h: Header, normalizer: str) -> Vocab:
    try:
        return Vocab(
            tokens=list(h.get(Keys.Tokenizer.LIST)),
            token_types=list(h.get(Keys.Tokenizer.TOKEN_TYPE)),
            merges=list(h.get(Keys.Tokenizer.MERGES)),
            eos_id=int(h.get(Keys.Tokenizer.EOS_ID)),
            pad_id=h.get(Keys.Tokenizer.PAD_ID),
            normalizer=normalizer,
        )
    except TypeError as e:
        raise ModelFileError("the backbone has no complete BPE tokenizer (tokens, token types, merges, eos)") from e


def _compare(backbone: dict[str, object], release: dict[str, object]) -> None:
    for suffix, theirs in release.items():
        ours = backbone[suffix]
        if suffix == "context_length":
            continue  # a conversion may cap it; it does not change the weights
        same = (
            math.isclose(float(ours), float(theirs), rel_tol=1e-4)
            if isinstance(theirs, float)
            else list(np.ravel(ours)) == list(np.ravel(theirs))
        )
        if not same:
            raise MismatchError(
                f"the backbone and the release do not belong together: {suffix} is {ours} in the backbone, "
                f"{theirs} in the release"
            )


def _compare_vocab(backbone: Vocab, release: Vocab) -> None:
    if len(backbone.tokens) != len(release.tokens):
        raise MismatchError(
            f"vocabulary sizes differ: {len(backbone.tokens)} in the backbone, {len(release.tokens)} in the release"
        )
    for i, (a, b) in enumerate(zip(backbone.tokens, release.tokens, strict=True)):
        if a != b and release.token_types[i] != gguf.TokenType.UNUSED:
            raise MismatchError(f"tokenizers differ: token {i} is {a!r} in the backbone, {b!r} in the release")
    if backbone.merges != release.merges:
        raise MismatchError("tokenizers differ: the BPE merges are not the same")


def _backbone_tensors(f: GGUFFile, shape: C.BackboneShape) -> list[OutTensor]:
    expected = C.backbone_tensor_shapes(shape)
    tensors = f.header.tensors
    extra = [n for n in tensors if n not in expected]
    if extra:
        raise MismatchError(f"the backbone has tensor {extra[0]}, which a Qwen3.5 backbone of this release does not have")
    out = []
    for name, want in expected.items():
        t = tensors.get(name)
        if t is None:
            raise MismatchError(f"the backbone lacks tensor {name} ({len(expected)} expected, {len(tensors)} present)")
        if t.shape != want:
            raise MismatchError(f"tensor {name} has shape {list(t.shape)} in the backbone; the release implies {list(want)}")
        out.append(OutTensor(name, t.shape, t.type, lambda n=name: f.tensor_bytes(n)))
    return out


def release_files(release: Release) -> list[Path]:
    """Every file of the release folder (a Hub snapshot's are links into the cache: samefile follows them)."""
    try:
        return [p for p in release.root.iterdir() if p.is_file()]
    except OSError:
        return []


def assemble(
    backbone_path: Path,
    release: Release,
    out: Path,
    *,
    head_type: str = "auto",
    force: bool = False,
    progress: Progress | None = None,
    lineage: Kv | None = None,
) -> Path:
    """Write the Clef file: the backbone's tensors as they are, then the release's head (F32 unless head_type);
    `lineage` the keys of the release the backbone was converted from (convert's), none for another's (graft's)."""
    f = GGUFFile.open(backbone_path)
    try:
        arch = f.header.get(Keys.General.ARCHITECTURE)
        if arch != C.BACKBONE_ARCH:
            raise MismatchError(f"{backbone_path.name} is not a qwen35 backbone ({Keys.General.ARCHITECTURE} is {arch!r})")
        hparams = _hparams(f.header, backbone_path.name)
        tied = C.OUTPUT not in f.header.tensors
        if tied != release.tied:
            raise MismatchError(f"the backbone {'ties' if tied else 'unties'} its output embedding, the release does not")
        shape = dataclasses.replace(release.backbone_shape(), tied=tied)
        _compare(hparams, backbone_hparams(release))
        release_vocab = read_vocab(
            release.tokenizer, release.tokenizer_config, shape.n_vocab, release.text_config.get("eos_token_id")
        )
        vocab = _vocab(f.header, release_vocab.normalizer)
        _compare_vocab(vocab, release_vocab)
        if release.head_config.hidden_size != shape.n_embd:
            raise MismatchError(f"the head reads hidden size {release.head_config.hidden_size}, the backbone has {shape.n_embd}")
        tensors = _backbone_tensors(f, shape) + head_tensors(release, head_qtype(head_type, None))
        file_type = int(f.header.get(Keys.General.FILE_TYPE, 0))
        write_clef(out, release, hparams, vocab, file_type, tensors, force=force, progress=progress, lineage=lineage)
    finally:
        f.close()
    return out


def write_clef(
    out: Path,
    release: Release,
    hparams: dict[str, object],
    vocab: Vocab,
    file_type: int,
    tensors: list[OutTensor],
    *,
    force: bool,
    progress: Progress | None,
    stage: str = "writing",
    lineage: Kv | None = None,
) -> Path:
    """Write a Clef file: its metadata (the release's head config and reference sha256 among them, and the lineage
    keys of conversion/lineage.source_keys), then `tensors`."""
    refuse_inputs(out, release_files(release))
    sha256 = reference_sha256(release)

    def metadata(w: gguf.GGUFWriter) -> None:
        write_metadata(
            w,
            name=release.name,
            hparams=hparams,
            vocab=vocab,
            file_type=file_type,
            head=release.head_config,
            reference_sha256=sha256,
            lineage=lineage,
        )

    return write_file(out, metadata, tensors, header_bytes(vocab, tensors), force=force, progress=progress, stage=stage)


def graft(
    backbone: str | Path,
    source: str | Path,
    out: str | Path,
    *,
    head_type: str = "auto",
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """A backbone-only qwen35 GGUF (any quantization) + a release (folder or Hub repo id) -> a Clef GGUF."""
    out, backbone = Path(out), Path(backbone)
    head_qtype(head_type, None)  # an unknown --head-type fails before anything is read
    check_output(out, force)  # before the release is downloaded
    refuse_inputs(out, [backbone])
    release = open_release(source, weights=False)
    return assemble(
        backbone,
        release,
        out,
        head_type=head_type,
        force=force,
        progress=progress,
    )
