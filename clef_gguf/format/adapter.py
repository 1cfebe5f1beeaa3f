"""The Clef adapter file: a fine-tune's LoRA in llama.cpp's adapter layout, its head, and its base's identity.

llama.cpp's adapter loader (b11434 src/llama-adapter.cpp:205-221, 274-297) wants `general.type = adapter`,
`adapter.type = lora`, one `adapter.lora.alpha` and tensors `<model tensor>.lora_a` / `.lora_b` only; the scale of
a pair is alpha / rank, rank being lora_b's ne[0] (src/llama-adapter.h:53-57). A Clef adapter adds the fine-tune's
decision metadata, the head tensors that differ from its base's (Clef names, as in a model file), and the keys below.
docs/finetune.md ("Adapter files") is the specification; contract.py holds the model file's names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
from gguf import Keys

from ..errors import IncompleteModelError
from . import contract as C
from .header import GGUFFile

GENERAL_TYPE = "adapter"  # general.type
ADAPTER_TYPE = "lora"  # adapter.type
KEY_GENERAL_TYPE = Keys.General.TYPE
KEY_ADAPTER_TYPE = Keys.Adapter.TYPE
KEY_ALPHA = Keys.Adapter.LORA_ALPHA  # f32: adapter_config.json's lora_alpha
LORA_A, LORA_B = ".lora_a", ".lora_b"  # numpy (r, in) and (out, r): PEFT's lora_A and lora_B

KEY_PREFIX = f"{C.ARCH}.adapter."
KEY_BASE_FINGERPRINT = f"{KEY_PREFIX}base.fingerprint"  # string: model_fingerprint of the base it was trained over
KEY_BASE_NAME = f"{KEY_PREFIX}base.name"  # string, informational
KEY_RANK = f"{KEY_PREFIX}rank"  # uint32: the largest rank of its pairs, informational
# The head's shape, as keys: the file holds only the head tensors that differ from the base's, so the tensors
# whose rows give the widths in a model file (contract.HEAD_WIDTH_TENSORS) may be absent.
KEY_EMBEDDING_LENGTH = f"{KEY_PREFIX}embedding_length"  # uint32: the backbone's hidden size, the head's input
KEY_HEAD_WIDTH = f"{KEY_PREFIX}head.width"  # uint32
KEY_HEAD_FEEDFORWARD = f"{KEY_PREFIX}head.feedforward_length"  # uint32
# The keys llama-server's variant keeps (--llama-server): llama.cpp's own and these.
SERVER_KEY_PREFIXES = ("general.", "adapter.", KEY_PREFIX)

# The layout transforms a LoRA pair can follow: W' = P W Q, so B' = P B (rows) and A' = A Q (columns).
ROW_TRANSFORMS = frozenset({C.Transform.NONE, C.Transform.QKV_ROWS, C.Transform.V_ROWS, C.Transform.V_HEAD_ROWS})
COLUMN_TRANSFORMS = frozenset({C.Transform.V_COLUMNS})
NORM_SUFFIX = "_norm.weight"


def is_adapter_header(general_type: object) -> bool:
    return general_type == GENERAL_TYPE


def lora_target(name: str) -> tuple[str, str] | None:
    """(model tensor, ".lora_a" or ".lora_b") of a LoRA tensor name, else None."""
    for suffix in (LORA_A, LORA_B):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], suffix
    return None


def adaptable(shape: C.BackboneShape) -> dict[str, C.BackboneTensor]:
    """The backbone tensors a LoRA may adapt, by GGUF name: the layers' matrices whose every product in Clef's graph
    goes through build_lora_mm (src/models/clef.cpp), in a layout a row or column permutation of the HF one."""
    return {
        t.gguf: t
        for t in C.backbone_tensors(shape)
        if t.gguf.startswith("blk.") and len(t.shape) == 2 and t.transform in ROW_TRANSFORMS | COLUMN_TRANSFORMS
    }


def is_fingerprint_tensor(name: str) -> bool:
    return name.endswith(NORM_SUFFIX) and not C.is_head_tensor(name)


def norms_fingerprint(norms: Iterable[tuple[str, tuple[int, ...], np.ndarray]]) -> str:
    """sha256 (hex) over (name, numpy shape, float32 values) of the backbone's norms, in sorted name order."""
    h = hashlib.sha256()
    for name, shape, values in sorted(norms, key=lambda n: n[0]):
        h.update(f"{name} {'x'.join(map(str, shape))}\n".encode())
        h.update(np.ascontiguousarray(values, dtype="<f4").tobytes())
    return h.hexdigest()


def model_fingerprint(f: GGUFFile) -> str:
    """The identity of a Clef model file's backbone an adapter is trained over: its norms, F32 in every file type
    (contract.F32_ONLY_SUFFIXES) and untouched by a LoRA, so one value for every quantization of one release."""
    norms = []
    for name, t in f.header.tensors.items():
        if not is_fingerprint_tensor(name):
            continue
        if t.type != C.GT.F32:
            raise IncompleteModelError(f"{f.path}: {name} is {t.type.name}; a model file stores its norms as F32")
        norms.append((name, t.shape, f.tensor_bytes(name).view("<f4")))
    return norms_fingerprint(norms)
