"""The GGUF contract of a Clef mmproj: the release's vision tower in llama.cpp's own format, as one table.

llama.cpp keeps a vision tower out of the model file, in an "mmproj" GGUF of architecture
`clip` that its multimodal library (libmtmd, tools/mtmd/clip.cpp) loads beside the text
model. For a Clef release (a Qwen3.5 backbone) llama.cpp's converter writes it with
`convert_hf_to_gguf.py --mmproj` as `ClefVisionModel`, a Qwen3-VL projector
(`conversion/clef.py:148-150`, `conversion/qwen3vl.py:18-146`, `conversion/base.py:2580-2756`):
projector type `qwen3vl_merger`. Convert writes what this module describes, tensor for tensor
and key for key what that converter writes; check/mmproj.py checks it as the vendored
clip.cpp of llama-cpp-python 0.3.36 reads it (`clip.cpp:1251-1700, 2270-2500`, and the
qwen3vl graph, `models/qwen3vl.cpp`). Tensor order is not part of the format.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import numpy as np

ARCH = "clip"
FILE_KIND = "mmproj"  # general.type, as llama.cpp's converter writes for every mmproj
PROJECTOR = "qwen3vl_merger"  # clip-impl.h PROJECTOR_TYPE_QWEN3VL

# --- Keys (clip-impl.h:30-66; the general.* ones are gguf.Keys.General's) ----------------
KEY_HAS_VISION = "clip.has_vision_encoder"
KEY_HAS_AUDIO = "clip.has_audio_encoder"
KEY_PROJECTOR = "clip.projector_type"
KEY_VISION_PROJECTOR = "clip.vision.projector_type"  # files with vision and audio: clip.cpp reads this one then
KEY_USE_GELU = "clip.use_gelu"
KEY_USE_SILU = "clip.use_silu"
KEY_PROJECTION_DIM = "clip.vision.projection_dim"
KEY_IMAGE_SIZE = "clip.vision.image_size"
KEY_PATCH_SIZE = "clip.vision.patch_size"
KEY_EMBEDDING_LENGTH = "clip.vision.embedding_length"
KEY_FEED_FORWARD_LENGTH = "clip.vision.feed_forward_length"
KEY_BLOCK_COUNT = "clip.vision.block_count"
KEY_HEAD_COUNT = "clip.vision.attention.head_count"
KEY_LAYER_NORM_EPS = "clip.vision.attention.layer_norm_epsilon"
KEY_IMAGE_MEAN = "clip.vision.image_mean"
KEY_IMAGE_STD = "clip.vision.image_std"
KEY_SPATIAL_MERGE_SIZE = "clip.vision.spatial_merge_size"
KEY_DEEPSTACK_LAYERS = "clip.vision.is_deepstack_layers"
# The image processor's pixel limits, under llama.cpp's own key names (clip-impl.h:53-54). llama.cpp's
# converter does not write them for Qwen3-VL projectors, and clip.cpp's qwen3vl loader does not read
# them (it sets 8 to 4096 image tokens unless mtmd_context_params asks otherwise, clip.cpp:1668-1686);
# clef-gguf writes them from the release's preprocessor_config.json so that the runtime can ask mtmd
# for the release's limits (image_min_tokens / image_max_tokens) instead of llama.cpp's defaults.
KEY_IMAGE_MIN_PIXELS = "clip.vision.image_min_pixels"
KEY_IMAGE_MAX_PIXELS = "clip.vision.image_max_pixels"
CLEF_KEYS = (KEY_IMAGE_MIN_PIXELS, KEY_IMAGE_MAX_PIXELS)  # the keys beyond llama.cpp's converter's

# libmtmd brackets each image's embeddings with the first two tokens of the text model (mtmd.cpp, qwen3vl:
# img_beg, img_end), as the reference's processor writes <|vision_start|><|image_pad|>...<|vision_end|>, one
# <|image_pad|> per image token (whose embedding the tower's replaces).
# What clip.cpp gives a Qwen-VL tower whose file has no pixel limits (llama.cpp's converter writes none):
# 8 to 4096 image tokens an image (clip.cpp's qwen3vl loader), unless mtmd is told otherwise.
CLIP_DEFAULT_IMAGE_TOKENS = (8, 4096)
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD)

# --- The release side ---------------------------------------------------------------------
HF_VISION_PREFIX = "model.visual."
PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"  # newer transformers save the image processor there, under image_processor
CHANNELS = 3  # RGB: the patch embedding's input channels
TEMPORAL_PATCH_SIZE = 2  # an image is its frame twice; llama.cpp splits the Conv3d into two Conv2d (one per frame)
# llama.cpp's qwen3vl graph merges 2 x 2 patches into one token whatever the key says (models/qwen3vl.cpp:22-31, :182).
MERGE_SIZE = 2
DEFAULT_POSITIONS = 2304  # Qwen3VLVisionConfig.num_position_embeddings, the converter's default


class VisionTransform(str, Enum):
    """What convert does to an HF tensor of the tower before writing it."""

    NONE = "none"
    FRAME_0 = "frame_0"  # patch_embed.proj.weight (out, in, t, h, w): the kernel of frame t = 0, (out, in, h, w)
    FRAME_1 = "frame_1"  # ... and of frame t = 1 (llama.cpp's `v.patch_embd.weight.1`)


@dataclass(frozen=True)
class VisionRule:
    hf: str  # name under model.visual.; {bid} is the block index
    gguf: str  # llama.cpp's name; {bid} the same index
    transform: VisionTransform = VisionTransform.NONE


PATCH_EMBD = "v.patch_embd.weight"
PATCH_EMBD_1 = "v.patch_embd.weight.1"
PATCH_BIAS = "v.patch_embd.bias"
POSITION_EMBD = "v.position_embd.weight"
MERGER_OUT_BIAS = "mm.2.bias"  # its length is the width of the image embeddings (clip.cpp clip_n_mmproj_embd)

# In the converter's file order: blocks, merger, patch embedding, positions (the HF names sorted).
BLOCK_RULES = (
    VisionRule("blocks.{bid}.attn.proj.bias", "v.blk.{bid}.attn_out.bias"),
    VisionRule("blocks.{bid}.attn.proj.weight", "v.blk.{bid}.attn_out.weight"),
    VisionRule("blocks.{bid}.attn.qkv.bias", "v.blk.{bid}.attn_qkv.bias"),
    VisionRule("blocks.{bid}.attn.qkv.weight", "v.blk.{bid}.attn_qkv.weight"),
    VisionRule("blocks.{bid}.mlp.linear_fc1.bias", "v.blk.{bid}.ffn_up.bias"),
    VisionRule("blocks.{bid}.mlp.linear_fc1.weight", "v.blk.{bid}.ffn_up.weight"),
    VisionRule("blocks.{bid}.mlp.linear_fc2.bias", "v.blk.{bid}.ffn_down.bias"),
    VisionRule("blocks.{bid}.mlp.linear_fc2.weight", "v.blk.{bid}.ffn_down.weight"),
    VisionRule("blocks.{bid}.norm1.bias", "v.blk.{bid}.ln1.bias"),
    VisionRule("blocks.{bid}.norm1.weight", "v.blk.{bid}.ln1.weight"),
    VisionRule("blocks.{bid}.norm2.bias", "v.blk.{bid}.ln2.bias"),
    VisionRule("blocks.{bid}.norm2.weight", "v.blk.{bid}.ln2.weight"),
)
FINAL_RULES = (
    VisionRule("merger.linear_fc1.bias", "mm.0.bias"),
    VisionRule("merger.linear_fc1.weight", "mm.0.weight"),
    VisionRule("merger.linear_fc2.bias", MERGER_OUT_BIAS),
    VisionRule("merger.linear_fc2.weight", "mm.2.weight"),
    VisionRule("merger.norm.bias", "v.post_ln.bias"),
    VisionRule("merger.norm.weight", "v.post_ln.weight"),
    VisionRule("patch_embed.proj.bias", PATCH_BIAS),
    VisionRule("patch_embed.proj.weight", PATCH_EMBD, VisionTransform.FRAME_0),
    VisionRule("patch_embed.proj.weight", PATCH_EMBD_1, VisionTransform.FRAME_1),
    VisionRule("pos_embed.weight", POSITION_EMBD),
)
# Qwen3-VL's deepstack mergers widen the image embeddings to n_embd x (1 + their count) (clip.cpp
# clip_n_mmproj_embd), which a qwen35 backbone cannot take; Qwen3.5's tower has none.
DEEPSTACK_PREFIX = "deepstack_merger_list."


def vision_rules(n_layer: int) -> list[VisionRule]:
    """Every tensor of the tower, blocks expanded, in file order."""
    rules = [VisionRule(r.hf.format(bid=i), r.gguf.format(bid=i), r.transform) for i in range(n_layer) for r in BLOCK_RULES]
    return rules + list(FINAL_RULES)


# --- Types (conversion/base.py:1081-1160, MmprojModel.tensor_force_quant :2753-2756) ------------------
# F32 whatever the file type: 1-D tensors, the position embeddings (MODEL_TENSOR.V_ENC_EMBD_POS), and any
# name not ending in ".weight". The patch embeddings are F16 in an F16 file and F32 otherwise.
F32_ONLY = (POSITION_EMBD,)
PATCH_EMBEDDINGS = (PATCH_EMBD, PATCH_EMBD_1)


@dataclass(frozen=True)
class VisionShape:
    """The hyperparameters that determine the tower's tensors."""

    n_embd: int  # clip.vision.embedding_length
    n_ff: int
    n_layer: int
    n_head: int
    patch_size: int
    n_positions: int  # learned position embeddings: a square grid, interpolated to the image's
    out_width: int  # the image embeddings' width: the backbone's hidden size

    @property
    def merged_width(self) -> int:
        """The merger's input: the features of 2 x 2 neighbouring patches side by side."""
        return self.n_embd * MERGE_SIZE * MERGE_SIZE

    @property
    def image_size(self) -> int:
        """clip.vision.image_size as the converter derives it: the position grid's side in pixels."""
        return int(self.n_positions**0.5 * self.patch_size)


def vision_tensor_shapes(s: VisionShape) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp's qwen3vl graph uses, in file order, in numpy (row-major) shape order."""
    shapes: dict[str, tuple[int, ...]] = {}
    for bid in range(s.n_layer):
        block = {
            "attn_out.bias": (s.n_embd,),
            "attn_out.weight": (s.n_embd, s.n_embd),
            "attn_qkv.bias": (3 * s.n_embd,),
            "attn_qkv.weight": (3 * s.n_embd, s.n_embd),
            "ffn_up.bias": (s.n_ff,),
            "ffn_up.weight": (s.n_ff, s.n_embd),
            "ffn_down.bias": (s.n_embd,),
            "ffn_down.weight": (s.n_embd, s.n_ff),
            "ln1.bias": (s.n_embd,),
            "ln1.weight": (s.n_embd,),
            "ln2.bias": (s.n_embd,),
            "ln2.weight": (s.n_embd,),
        }
        shapes |= {f"v.blk.{bid}.{name}": shape for name, shape in block.items()}
    shapes |= {
        "mm.0.bias": (s.merged_width,),
        "mm.0.weight": (s.merged_width, s.merged_width),
        MERGER_OUT_BIAS: (s.out_width,),
        "mm.2.weight": (s.out_width, s.merged_width),
        "v.post_ln.bias": (s.n_embd,),
        "v.post_ln.weight": (s.n_embd,),
        PATCH_BIAS: (s.n_embd,),
        PATCH_EMBD: (s.n_embd, CHANNELS, s.patch_size, s.patch_size),
        PATCH_EMBD_1: (s.n_embd, CHANNELS, s.patch_size, s.patch_size),
        POSITION_EMBD: (s.n_positions, s.n_embd),
    }
    return shapes


def is_square(n: int) -> bool:
    return n > 0 and math.isqrt(n) ** 2 == n


def pixels_per_token(patch_size: int) -> int:
    """Pixels of one image token: a merged 2 x 2 group of patches."""
    return (patch_size * MERGE_SIZE) ** 2


def default_mmproj_name(model_file_name: str) -> str:
    """llama.cpp's converter names a model `NAME.gguf` and its vision tower `mmproj-NAME.gguf` (base.py:2692-2694)."""
    stem = model_file_name[: -len(".gguf")] if model_file_name.endswith(".gguf") else model_file_name
    return f"mmproj-{stem}.gguf"


# --- The tower's fingerprint: which release's tower a file holds ---------------------------------------------------
# The tensors every converter stores as F32 whatever the mmproj's type (the rules above): the 1-D ones (biases,
# LayerNorms) and the position embeddings. Their values are the release's, in f32, f16, bf16 and q8_0 mmproj files
# alike, llama.cpp's converter's too; another release's tower (another training, another seed) has other values.
FINGERPRINT_DOMAIN = b"clef-gguf vision tower fingerprint 1\n"


def is_fingerprint_tensor(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name in F32_ONLY


def tower_fingerprint(tensors: Iterable[tuple[str, tuple[int, ...], np.ndarray]]) -> str:
    """sha256 (hex) over (llama.cpp's name, numpy shape, float32 values) of the fingerprint tensors, in name order."""
    h = hashlib.sha256(FINGERPRINT_DOMAIN)
    for name, shape, values in sorted(tensors, key=lambda t: t[0]):
        if is_fingerprint_tensor(name, shape):
            h.update(f"{name} {'x'.join(map(str, shape))}\n".encode())
            h.update(np.ascontiguousarray(values, dtype="<f4").tobytes())
    return h.hexdigest()
