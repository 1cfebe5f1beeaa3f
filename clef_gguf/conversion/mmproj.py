"""A Clef release's vision tower -> llama.cpp's mmproj GGUF (format/vision.py).

What llama.cpp's converter writes with `--mmproj` for a Clef release (`ClefVisionModel`, a
Qwen3-VL projector), key for key and tensor for tensor: the hyperparameters from config.json's
vision_config, the image processor's mean and std from preprocessor_config.json, the weights of
model.visual.* with the patch embedding's Conv3d split into one Conv2d per frame. Beyond the
converter, the image processor's pixel limits (vision.CLEF_KEYS): the runtime needs them, and
llama.cpp's own defaults for Qwen-VL differ from the release's.

Planned from the safetensors headers alone, like the model file, then streamed tensor by tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import Keys

from ..errors import ConversionError, NonFiniteWeightsError, ReleaseError
from ..format import vision as V
from .release import Release, StoredTensor
from .writer import GT, OutTensor, Progress, encode, write_gguf

# --mmproj-type: the types llama.cpp's converter writes (`--outtype` with `--mmproj`). "auto" is the
# model's type when it is one of these, else F16: llama.cpp's quantizer does not quantize mmproj files,
# and F16 is what llama.cpp's own conversions ship (mmproj-*-F16.gguf).
MMPROJ_TYPES: dict[str, tuple[GT, gguf.LlamaFileType]] = {
    "f32": (GT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (GT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (GT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (GT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
DEFAULT_MMPROJ_TYPE = "f16"
# Qwen2VLImageProcessor's defaults, which the reference's processor uses when the release sets none.
PROCESSOR_DEFAULTS = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_PIXELS = (1 << 31) - 1  # clip.cpp reads the limits as int32
# The tower's activation in llama.cpp: clip.use_gelu, ggml_gelu, the tanh approximation.
GELU = "gelu_pytorch_tanh"


def mmproj_type(requested: str, file_type: str) -> str:
    """The mmproj type for --mmproj-type `requested` ("auto" or one of MMPROJ_TYPES) and the model's --type."""
    if requested == "auto":
        return file_type if file_type in MMPROJ_TYPES else DEFAULT_MMPROJ_TYPE
    if requested not in MMPROJ_TYPES:
        raise ConversionError(f"unknown --mmproj-type {requested}; choose auto or one of {', '.join(MMPROJ_TYPES)}")
    return requested


@dataclass(frozen=True)
class ImageProcessor:
    """The release's image processor: normalization and the pixel range images are resized into."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class VisionTower:
    """A release's vision tower, planned: shapes, keys' values and where each tensor comes from."""

    shape: V.VisionShape
    processor: ImageProcessor
    layer_norm_eps: float
    tensors: dict[str, StoredTensor]  # model.visual.* of the release

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in V.vision_tensor_shapes(self.shape).values())


def no_tower_reason(release: Release) -> str | None:
    """Why a release has no vision tower to convert (None when it has one)."""
    has_weights = any(n.startswith(V.HF_VISION_PREFIX) for n in release.backbone)
    if release.vision_config is None and not has_weights:
        return f"{release.name} has no vision tower (config.json has no vision_config, the weights no {V.HF_VISION_PREFIX}*)"
    if not has_weights:
        return (
            f"{release.name} has no vision tower weights (config.json has a vision_config, the weights no {V.HF_VISION_PREFIX}*)"
        )
    return None


def _int(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        shown = "missing" if key not in config else f"{value!r}"
        raise ReleaseError(f"{where}: {key} is {shown}; a vision tower needs a positive integer")
    return value


def _triple(config: dict[str, Any], key: str) -> tuple[float, float, float]:
    value = config.get(key)
    ok = isinstance(value, list) and len(value) == 3
    ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not ok:
        raise ReleaseError(f"{V.PREPROCESSOR_CONFIG}: {key} must be 3 numbers (one per RGB channel), not {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


def _pixel_limits(p: dict[str, Any]) -> tuple[int, int]:
    """As Qwen2VLImageProcessor reads them: min_pixels / max_pixels when set, else size.shortest_edge / longest_edge."""
    size = p.get("size") if isinstance(p.get("size"), dict) else {}
    limits = []
    for legacy, key, default in (
        ("min_pixels", "shortest_edge", DEFAULT_MIN_PIXELS),
        ("max_pixels", "longest_edge", DEFAULT_MAX_PIXELS),
    ):
        value = p[legacy] if p.get(legacy) is not None else size.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_PIXELS:
            raise ReleaseError(f"{V.PREPROCESSOR_CONFIG}: {legacy} / size.{key} is {value!r}, not a pixel count")
        limits.append(value)
    if limits[0] > limits[1]:
        raise ReleaseError(f"{V.PREPROCESSOR_CONFIG}: the smallest image ({limits[0]} pixels) exceeds the largest ({limits[1]})")
    return limits[0], limits[1]


def image_processor(release: Release, vision_config: dict[str, Any]) -> ImageProcessor:
    """The image processor's settings from preprocessor_config.json, checked against the tower it feeds."""
    p = release.preprocessor_config
    if p is None:
        raise ReleaseError(
            f"{release.name}: {V.PREPROCESSOR_CONFIG} is missing: the image processor's mean, std and pixel limits "
            "come from it (convert with --no-mmproj to leave the vision tower out)"
        )
    # The processor cuts the patches the tower embeds: any disagreement gives the tower other inputs.
    tower = {
        "patch_size": vision_config["patch_size"],
        "merge_size": vision_config.get("spatial_merge_size", V.MERGE_SIZE),
        "temporal_patch_size": vision_config.get("temporal_patch_size", V.TEMPORAL_PATCH_SIZE),
    }
    for key, theirs in tower.items():
        ours = p.get(key, PROCESSOR_DEFAULTS[key])
        if ours != theirs:
            origin = "" if key in p else " (transformers' default: the file sets none)"
            raise ReleaseError(
                f"{V.PREPROCESSOR_CONFIG}: {key} is {ours!r}{origin}, the vision tower's (config.json vision_config) {theirs!r}"
            )
    std = _triple(p, "image_std")
    if min(std) <= 0:
        raise ReleaseError(f"{V.PREPROCESSOR_CONFIG}: image_std {list(std)} must be positive (pixels are divided by it)")
    low, high = _pixel_limits(p)
    return ImageProcessor(mean=_triple(p, "image_mean"), std=std, min_pixels=low, max_pixels=high)


def vision_tower(release: Release) -> VisionTower:
    """Plan the release's vision tower; ReleaseError says what keeps it from being Qwen3.5's (no_tower_reason first)."""
    c = release.vision_config
    if c is None:
        raise ReleaseError(f"{release.name}: the weights hold {V.HF_VISION_PREFIX}* tensors but config.json has no vision_config")
    where = "config.json vision_config"
    patch = _int(c, "patch_size", where)
    n_embd, n_head = _int(c, "hidden_size", where), _int(c, "num_heads", where)
    shape = V.VisionShape(
        n_embd=n_embd,
        n_ff=_int(c, "intermediate_size", where),
        n_layer=_int(c, "depth", where),
        n_head=n_head,
        patch_size=patch,
        n_positions=_int(c, "num_position_embeddings", where, V.DEFAULT_POSITIONS),
        out_width=_int(c, "out_hidden_size", where),
    )
    hidden = release.text_config["hidden_size"]
    # Each check is something llama.cpp's converter or its qwen3vl graph cannot represent.
    fixed = {
        "spatial_merge_size": (
            c.get("spatial_merge_size", V.MERGE_SIZE),
            V.MERGE_SIZE,
            "llama.cpp's qwen3vl graph merges 2 x 2 patches",
        ),
        "temporal_patch_size": (
            c.get("temporal_patch_size", V.TEMPORAL_PATCH_SIZE),
            V.TEMPORAL_PATCH_SIZE,
            "llama.cpp splits the patch kernel into 2 frames",
        ),
        "in_channels": (c.get("in_channels", V.CHANNELS), V.CHANNELS, "images are RGB"),
        "hidden_act": (c.get("hidden_act", GELU), GELU, "llama.cpp runs the tower with tanh-approximated GELU"),
        "out_hidden_size": (shape.out_width, hidden, "image embeddings go into the backbone (text_config hidden_size)"),
    }
    for key, (value, want, why) in fixed.items():
        if value != want:
            raise ReleaseError(f"{where}: {key} is {value!r}, not {want!r}: {why}")
    if c.get("deepstack_visual_indexes"):
        raise ReleaseError(
            f"{where}: deepstack_visual_indexes {c['deepstack_visual_indexes']}: a Qwen3-VL tower with deepstack mergers, "
            "whose embeddings are wider than a Qwen3.5 backbone's (Qwen3.5's tower has none)"
        )
    if n_embd % n_head:
        raise ReleaseError(f"{where}: hidden_size {n_embd} is not a multiple of num_heads {n_head}")
    if not V.is_square(shape.n_positions):
        raise ReleaseError(f"{where}: num_position_embeddings {shape.n_positions} is not a square grid")
    if c.get("image_size", shape.image_size) != shape.image_size:
        raise ReleaseError(f"{where}: image_size {c['image_size']} disagrees with the {shape.n_positions} position embeddings")
    tensors = {n: t for n, t in release.backbone.items() if n.startswith(V.HF_VISION_PREFIX)}
    return VisionTower(
        shape=shape,
        processor=image_processor(release, c),
        # The converter writes the text config's RMSNorm epsilon here (conversion/qwen3vl.py:57-59); the
        # tower's LayerNorms use 1e-6 (transformers hardcodes it), which Qwen3.5 releases also set there.
        layer_norm_eps=float(release.text_config.get("rms_norm_eps", 1e-6)),
        tensors=tensors,
    )


def _frame(x: np.ndarray, t: V.VisionTransform) -> np.ndarray:
    return x[:, :, 0 if t is V.VisionTransform.FRAME_0 else 1]


def storage_type(name: str, shape: tuple[int, ...], wanted: GT) -> GT:
    """The type a tower tensor is stored in when `wanted` is asked for (llama.cpp's converter rules, vision.py)."""
    if name in V.PATCH_EMBEDDINGS:
        return GT.F16 if wanted == GT.F16 else GT.F32
    if len(shape) <= 1 or name in V.F32_ONLY or not name.endswith(".weight") or name.endswith("_norm.weight"):
        return GT.F32
    if shape[-1] % gguf.GGML_QUANT_SIZES[wanted][0]:
        return GT.F16  # rows not whole blocks: the converter falls back to F16 (QuantError)
    return wanted


def mmproj_tensors(tower: VisionTower, qtype: GT) -> list[OutTensor]:
    """The tower in llama.cpp's names and layouts (vision.vision_rules), produced on demand."""
    shapes = V.vision_tensor_shapes(tower.shape)
    planned, used = [], set()
    for rule in V.vision_rules(tower.shape.n_layer):
        hf_name = V.HF_VISION_PREFIX + rule.hf
        source = tower.tensors.get(hf_name)
        if source is None:
            raise ReleaseError(f"vision tower tensor {hf_name} is missing")
        shape = shapes[rule.gguf]
        source_shape = shape if rule.transform is V.VisionTransform.NONE else (shape[0], shape[1], 2, *shape[2:])
        if source.shape != source_shape:
            raise ReleaseError(
                f"{hf_name} has shape {list(source.shape)}, config.json's vision_config implies {list(source_shape)}"
            )
        qt = storage_type(rule.gguf, shape, qtype)

        def produce(src: StoredTensor = source, t: V.VisionTransform = rule.transform, q: GT = qt) -> np.ndarray:
            x = src.load()
            return encode(x if t is V.VisionTransform.NONE else _frame(x, t), q)

        planned.append(OutTensor(rule.gguf, shape, qt, produce))
        used.add(hf_name)
    unknown = sorted(set(tower.tensors) - used)
    if unknown:
        why = (
            "a deepstack merger (Qwen3-VL's, not Qwen3.5's)"
            if V.DEEPSTACK_PREFIX in unknown[0]
            else "not part of a Qwen3.5 vision tower"
        )
        raise ReleaseError(f"tensor {unknown[0]} is {why} (and {len(unknown) - 1} more unknown tensors)")
    return planned


def tower_fingerprint(release: Release) -> str | None:
    """vision.tower_fingerprint of the mmproj convert writes of `release`, of any type (its fingerprint tensors are F32
    in every one); None for a release whose tower it cannot write (the model file then records none)."""
    if no_tower_reason(release) is not None:
        return None
    try:
        tensors = mmproj_tensors(vision_tower(release), GT.F32)
        return V.tower_fingerprint((t.name, t.shape, t.data()) for t in tensors if V.is_fingerprint_tensor(t.name, t.shape))
    except (ReleaseError, NonFiniteWeightsError):  # (the mmproj's conversion says why, when it is asked for)
        return None


def write_mmproj_metadata(w: gguf.GGUFWriter, *, name: str, tower: VisionTower, file_type: int) -> None:
    """The converter's keys, in its order (base.py:2698-2719, qwen3vl.py:43-62), then clef-gguf's pixel limits."""
    s, p = tower.shape, tower.processor
    w.add_string(Keys.General.TYPE, V.FILE_KIND)
    w.add_string(Keys.General.NAME, name)
    w.add_string(Keys.General.SIZE_LABEL, gguf.size_label(tower.n_params, tower.n_params, 0, 0))
    w.add_uint32(Keys.General.FILE_TYPE, file_type)
    w.add_bool(V.KEY_HAS_VISION, True)
    w.add_uint32(V.KEY_PROJECTION_DIM, s.out_width)
    w.add_uint32(V.KEY_IMAGE_SIZE, s.image_size)
    w.add_uint32(V.KEY_PATCH_SIZE, s.patch_size)
    w.add_uint32(V.KEY_EMBEDDING_LENGTH, s.n_embd)
    w.add_uint32(V.KEY_FEED_FORWARD_LENGTH, s.n_ff)
    w.add_uint32(V.KEY_BLOCK_COUNT, s.n_layer)
    w.add_uint32(V.KEY_HEAD_COUNT, s.n_head)
    w.add_array(V.KEY_IMAGE_MEAN, list(p.mean))
    w.add_array(V.KEY_IMAGE_STD, list(p.std))
    w.add_string(V.KEY_PROJECTOR, V.PROJECTOR)
    w.add_bool(V.KEY_USE_GELU, True)
    w.add_uint32(V.KEY_SPATIAL_MERGE_SIZE, V.MERGE_SIZE)
    w.add_float32(V.KEY_LAYER_NORM_EPS, tower.layer_norm_eps)
    w.add_array(V.KEY_DEEPSTACK_LAYERS, [False] * s.n_layer)
    w.add_uint32(Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION)
    w.add_uint32(V.KEY_IMAGE_MIN_PIXELS, p.min_pixels)
    w.add_uint32(V.KEY_IMAGE_MAX_PIXELS, p.max_pixels)


@dataclass(frozen=True)
class MmprojPlan:
    """An mmproj ready to be written: its keys' source and its tensors."""

    tower: VisionTower
    file_type: int
    tensors: list[OutTensor]

    def write(self, path: Path, name: str, progress: Progress | None = None) -> None:
        def metadata(w: gguf.GGUFWriter) -> None:
            write_mmproj_metadata(w, name=name, tower=self.tower, file_type=self.file_type)

        write_gguf(path, V.ARCH, metadata, self.tensors, progress, "vision tower (mmproj)")


def plan_mmproj(release: Release, type_name: str) -> MmprojPlan:
    """Plan the mmproj of `release` in `type_name` (one of MMPROJ_TYPES), from the headers alone."""
    qtype, ftype = MMPROJ_TYPES[type_name]
    tower = vision_tower(release)
    return MmprojPlan(tower, int(ftype), mmproj_tensors(tower, qtype))
