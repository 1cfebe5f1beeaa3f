"""Tiny random Clef releases in the exact Hugging Face layout of the real ones.

A Clef release folder holds a ``Qwen3_5ForConditionalGeneration`` checkpoint
(``config.json`` + ``model*.safetensors``, vision tower included), the joint
schema head (``joint_head.safetensors`` + ``joint_head_config.json``), the
tokenizer files and Cloudflare's ``joint_schema_model.py``. ``build_release``
writes such a folder with random weights (weights.py) and a small trained byte-level
BPE tokenizer shaped like Qwen's (tokenizer.py), so that converter and runtime tests
can compare llama.cpp against Cloudflare's reference (reference.py) without
downloading anything.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from .reference import load_reference, reference_path
from .tokenizer import build_tokenizer
from .weights import randomize_backbone, randomize_head

PARTIAL_ROTARY_FACTOR = 0.25
ROPE_THETA = 10_000.0  # transformers' default for Qwen3_5TextConfig

# The vision tower and its image processor (preprocessor_config.json).
VISUAL_PREFIX = "model.visual."
VISION_PATCH_SIZE = 16
VISION_MERGE_SIZE = 2  # 2 x 2 patches -> one image token
VISION_TEMPORAL_PATCH_SIZE = 2  # an image is its frame twice
VISION_MIN_TOKENS = 16
VISION_MAX_TOKENS = 256
VISION_IMAGE_MEAN = (0.48, 0.46, 0.41)
VISION_IMAGE_STD = (0.27, 0.26, 0.28)


@dataclass(frozen=True)
class ReleaseSpec:
    """Shape of a random release; defaults are the tiny CPU fixture."""

    layers: int = 4  # backbone layers
    full_attention_interval: int = 4  # layer i is full attention iff (i + 1) % N == 0
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4  # full-attention query heads
    kv_heads: int = 2
    head_dim: int = 32
    linear_key_heads: int = 2  # differs from the V heads so ggml's V-head reordering is exercised
    linear_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    head_width: int = 32  # JointSchemaHead width
    routing_layers: int = 1
    head_layers: int = 1
    head_heads: int = 2
    head_feedforward: int = 64
    tied: bool = False  # tie_word_embeddings: no lm_head.weight in the safetensors then
    dtype: str = "float32"  # "float32" or "bfloat16", for backbone and head tensors
    vocab_padding: int = 37  # model vocab = tokenizer size + this, like Qwen's padded embeddings
    seed: int = 0
    max_shard_bytes: int | None = None  # shard model*.safetensors (with an index) when set
    vision: bool = True  # a vision tower (model.visual.*) and preprocessor_config.json, as the real releases
    vision_layers: int = 2


TINY = ReleaseSpec()
# The benchmarks' fixture (tools/bench/, most through fixture_files.benchmark_files): hidden 256, 8 layers, a head
# 128 wide (6 + 3 layers); rows of 256, so that the K-quants apply.
BENCHMARK = ReleaseSpec(
    seed=4,
    hidden=256,
    intermediate=512,
    layers=8,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    head_width=128,
    routing_layers=6,
    head_layers=3,
)
# The Ray benchmarks' larger model (tools/bench/bench_ray.py, bench_ray_dataset.py): hidden 256, 8 layers, a small head.
LARGER = ReleaseSpec(seed=5, hidden=256, intermediate=512, layers=8, head_width=64)
# The released Clef-flash layout (32 layers, every 4th full attention, a
# 6 + 3 layer head: 160 head tensors) at the tiny fixture's widths, small enough for CPU tests.
CLEF_FLASH_LAYOUT = ReleaseSpec(layers=32, intermediate=96, routing_layers=6, head_layers=3)


def build_release(out_dir: Path, spec: ReleaseSpec = TINY) -> Path:
    """Write a random Clef release for ``spec`` into ``out_dir`` and return it."""
    if spec.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {spec.dtype}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reference = load_reference()
    tokenizer = build_tokenizer()
    _save_backbone(out_dir, spec, tokenizer)
    _save_head(out_dir, spec, reference)
    tokenizer.save_pretrained(out_dir)
    if spec.vision:
        (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    shutil.copyfile(reference_path(), out_dir / "joint_schema_model.py")
    return out_dir


# --- image processor ---------------------------------------------------------


def clef_and_backbone(out_dir: Path, spec: ReleaseSpec, file_type: str) -> tuple[Path, Path, Path]:
    """A release of `spec` in `out_dir`, converted (clef.gguf), and its backbone alone as a plain qwen35 GGUF
    (backbone-qwen35.gguf): the release and the pair a benchmark runs clef-gguf and bare llama.cpp on."""
    from ..conversion.convert import convert
    from ..format.header import GGUFFile
    from ..llama.qwen35_view import write_backbone_gguf

    release = build_release(Path(out_dir) / "release", spec)
    clef = convert(release, Path(out_dir) / "clef.gguf", file_type)
    plain = Path(out_dir) / "backbone-qwen35.gguf"
    f = GGUFFile.open(clef)
    try:
        write_backbone_gguf(f, plain)
    finally:
        f.close()
    return release, clef, plain


def preprocessor_config() -> dict[str, object]:
    """preprocessor_config.json in the real Qwen3.5 release's layout (Qwen2VLImageProcessor's fields).

    The pixel limits are the fixture's own, not Qwen3.5's (65,536 to 16,777,216 pixels, i.e. 64 to
    16,384 image tokens): small enough for CPU tests, and unlike mtmd's Qwen-VL defaults (8 to 4096
    tokens), so that whatever ignores the release's limits gives other token counts. The mean and std
    are not Qwen's 0.5 either: a converter that wrote its defaults would be caught.
    """
    pixels_per_token = (VISION_PATCH_SIZE * VISION_MERGE_SIZE) ** 2
    return {
        "size": {"shortest_edge": VISION_MIN_TOKENS * pixels_per_token, "longest_edge": VISION_MAX_TOKENS * pixels_per_token},
        "patch_size": VISION_PATCH_SIZE,
        "temporal_patch_size": VISION_TEMPORAL_PATCH_SIZE,
        "merge_size": VISION_MERGE_SIZE,
        "image_mean": list(VISION_IMAGE_MEAN),
        "image_std": list(VISION_IMAGE_STD),
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,  # PIL bicubic, as Qwen's
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }


# --- backbone --------------------------------------------------------------


def mrope_section(head_dim: int) -> list[int]:
    """Split the rotary pairs into three near-equal parts, larger parts first (32 -> [11, 11, 10]).

    The sections must cover every pair: llama.cpp's interleaved M-RoPE gives
    uncovered pairs position 0 while transformers does not.
    """
    pairs = int(head_dim * PARTIAL_ROTARY_FACTOR) // 2
    base, extra = divmod(pairs, 3)
    return [base + (1 if index < extra else 0) for index in range(3)]


def layer_types(spec: ReleaseSpec) -> list[str]:
    return [
        "full_attention" if (index + 1) % spec.full_attention_interval == 0 else "linear_attention"
        for index in range(spec.layers)
    ]


def release_config(spec: ReleaseSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen3_5Config:
    ids = tokenizer.convert_tokens_to_ids
    text_config = {
        "vocab_size": len(tokenizer) + spec.vocab_padding,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "layer_types": layer_types(spec),
        "full_attention_interval": spec.full_attention_interval,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "linear_num_key_heads": spec.linear_key_heads,
        "linear_num_value_heads": spec.linear_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32_768,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
            "mrope_interleaved": True,
            "mrope_section": mrope_section(spec.head_dim),
        },
        # Clef releases carry no multi-token-prediction layers; say so explicitly
        # because llama.cpp's converter otherwise expects them.
        "mtp_num_hidden_layers": 0,
        "tie_word_embeddings": spec.tied,
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    # A minimal vision tower, in the real release's layout (Qwen3.5's: no deepstack layers).
    vision_config = {
        "depth": spec.vision_layers,
        "hidden_size": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": spec.hidden,
        "patch_size": VISION_PATCH_SIZE,
        "spatial_merge_size": VISION_MERGE_SIZE,
        "temporal_patch_size": VISION_TEMPORAL_PATCH_SIZE,
        "num_position_embeddings": 64,  # an 8 x 8 grid of learned positions, interpolated to the image's
    }
    return Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=spec.tied,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def _save_backbone(out_dir: Path, spec: ReleaseSpec, tokenizer: PreTrainedTokenizerFast) -> None:
    torch.manual_seed(spec.seed)  # transformers' own init; overwritten below, but keep it reproducible
    model = Qwen3_5ForConditionalGeneration(release_config(spec, tokenizer)).eval()
    randomize_backbone(model, spec.seed)
    model = model.to(getattr(torch, spec.dtype))
    shard = spec.max_shard_bytes if spec.max_shard_bytes is not None else "50GB"
    if spec.vision:
        model.save_pretrained(out_dir, max_shard_size=shard)
        return
    # A release without a vision tower: no model.visual.* weights and no vision_config.
    text_only = {name: t for name, t in model.state_dict().items() if not name.startswith(VISUAL_PREFIX)}
    model.save_pretrained(out_dir, max_shard_size=shard, state_dict=text_only)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    del config["vision_config"]
    config_path.write_text(json.dumps(config, indent=2) + "\n")


# --- head ------------------------------------------------------------------


def head_config(spec: ReleaseSpec) -> dict[str, int]:
    """joint_head_config.json: exactly JointSchemaHead's constructor arguments."""
    return {
        "hidden_size": spec.hidden,
        "width": spec.head_width,
        "routing_layers": spec.routing_layers,
        "layers": spec.head_layers,
        "heads": spec.head_heads,
        "feedforward": spec.head_feedforward,
    }


def build_head(spec: ReleaseSpec, reference: ModuleType) -> torch.nn.Module:
    config = head_config(spec)
    torch.manual_seed(spec.seed)
    head = reference.JointSchemaHead(**config).eval()
    randomize_head(head, spec.seed)
    return head


def _save_head(out_dir: Path, spec: ReleaseSpec, reference: ModuleType) -> None:
    head = build_head(spec, reference)
    dtype = getattr(torch, spec.dtype)
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in head.state_dict().items()}
    save_file(tensors, str(out_dir / "joint_head.safetensors"))
    (out_dir / "joint_head_config.json").write_text(json.dumps(head_config(spec), indent=2) + "\n")


# The fixtures the tests share: untied float32 and tied bfloat16 (sharded), as the parity criteria ask, and k256.
RELEASES: dict[str, ReleaseSpec] = {
    "untied_f32": ReleaseSpec(seed=0),
    "tied_bf16": ReleaseSpec(seed=1, tied=True, dtype="bfloat16", max_shard_bytes=200_000),
    # Rows that are multiples of 256, so that llama.cpp's K-quants apply (not their fallbacks).
    "k256": ReleaseSpec(
        seed=2, hidden=256, intermediate=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, head_width=64
    ),
    # untied_f32's shapes, other weights: another release whose files (its vision tower's too) are as wide as
    # untied_f32's, which only their lineage tells apart.
    "other_f32": ReleaseSpec(seed=7),
}


def main(argv: list[str] | None = None) -> None:
    """``python -m clef_gguf.testing.release_builder OUT_DIR TYPE...``: BENCHMARK and its GGUF files (fixture_files)."""
    import argparse

    from clef_gguf.conversion.convert import convert

    from .fixture_files import benchmark_path

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("types", nargs="+")
    args = parser.parse_args(argv)
    release = build_release(args.out_dir / "release", BENCHMARK)
    for file_type in args.types:
        convert(release, benchmark_path(args.out_dir, file_type), file_type)


if __name__ == "__main__":
    main()
