"""The lineage keys a conversion writes (format/lineage.py): the release's weights digest, whether it is merged, and
its vision tower's fingerprint.

A release folder's digest is its tensors' (model*.safetensors and joint_head.safetensors: every value a fine-tune may
change). A merged fine-tune is either a folder `clef-finetune merge` wrote (it leaves CLEF_FINETUNE.json there) or
a checkpoint merged while converting (`convert CHECKPOINT --base RELEASE`), whose digest combines its base's with
its update's (the LoRA pairs, their scales and the head), and which records its base's digest too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..format import lineage as L
from .lora import MergedTensor
from .mmproj import tower_fingerprint
from .release import Release, StoredTensor

FINETUNE_MARKER = "CLEF_FINETUNE.json"  # what clef-finetune's merge writes beside the merged release
HEAD_NAMES = "joint_head/"  # the head's tensors in the digest: its names apart from the backbone's

Kv = dict[str, tuple[str, object]]  # key -> (gguf-py value type, value): what a writer adds


def _stored(release: Release) -> list[tuple[str, StoredTensor]]:
    return [*release.backbone.items(), *((HEAD_NAMES + n, t) for n, t in release.head.items())]


def release_digest(release: Release) -> str:
    """weights_digest of a release folder's tensors (a merged checkpoint's: merged_digest)."""
    tensors = _stored(release)
    if any(isinstance(t, MergedTensor) for _, t in tensors):
        raise AssertionError("a merged checkpoint's digest is source_keys(checkpoint, base)'s")
    return L.weights_digest((n, t.shape, t.load_span) for n, t in tensors)


def _update_digest(tuned: Release) -> str:
    """The digest of what a checkpoint changes: each pair's lora_A, lora_B and scale, and its head."""
    parts: list[tuple[str, tuple[int, ...], L.SpanReader]] = []
    for name, t in tuned.backbone.items():
        if isinstance(t, MergedTensor):
            parts += [(f"{name}.lora_A", t.a.shape, t.a.load_span), (f"{name}.lora_B", t.b.shape, t.b.load_span)]
            parts.append((f"{name}.scale", (1,), lambda start, count, s=t.scale: np.array([s], np.float32)))
    parts += [(HEAD_NAMES + n, t.shape, t.load_span) for n, t in tuned.head.items()]
    return L.weights_digest(parts)


def is_merged_folder(root: Path) -> bool:
    return (root / FINETUNE_MARKER).is_file()


def _vision_keys(release: Release) -> Kv:
    """The fingerprint of the vision tower convert writes of `release` (none without one): what the pairing of an
    mmproj with the model file compares the mmproj's own tensors with (check/pair.py)."""
    fingerprint = tower_fingerprint(release)
    return {} if fingerprint is None else {L.KEY_SOURCE_VISION: ("string", fingerprint)}


def source_keys(release: Release, base: Release | None = None) -> Kv:
    """The lineage keys of a model file converted from `release`, or from a checkpoint merged into `base`
    (`release` then being lora.open_checkpoint's)."""
    if base is None:
        kv: Kv = {L.KEY_SOURCE_DIGEST: ("string", release_digest(release))}
        kv |= {L.KEY_SOURCE_MERGED: ("bool", True)} if is_merged_folder(release.root) else {}
        return kv | _vision_keys(release)
    base_digest = release_digest(base)
    return {
        L.KEY_SOURCE_DIGEST: ("string", L.merged_digest(base_digest, _update_digest(release))),
        L.KEY_SOURCE_MERGED: ("bool", True),
        L.KEY_SOURCE_BASE_DIGEST: ("string", base_digest),
    } | _vision_keys(release)
