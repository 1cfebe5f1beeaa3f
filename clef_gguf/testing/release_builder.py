"""Tiny random Clef releases in the exact Hugging Face layout of the real ones.

A Clef release folder holds a ``Qwen3_5ForConditionalGeneration`` checkpoint
(``config.json`` + ``model*.safetensors``, vision tower included), the joint
schema head (``joint_head.safetensors`` + ``joint_head_config.json``), the
tokenizer files and Cloudflare's ``joint_schema_model.py``. ``build_release``
writes such a folder with random weights and a small trained byte-level BPE
tokenizer shaped like Qwen's, so that converter and runtime tests can compare
llama.cpp against Cloudflare's reference without downloading anything.

Random weights are drawn by this module, not left to transformers' init: its
init puts norms at exactly 0/1 and gates at fixed values, which would let a
converter that forgets a norm offset or permutes V heads pass unnoticed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3_5Config, Qwen3_5ForConditionalGeneration

REFERENCE_SHA256 = "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3"
REFERENCE_MODULE = "clef_reference_joint_schema_model"

# Qwen3.5's pre-tokenizer split; llama.cpp's `qwen35` pre-tokenizer implements
# exactly this (its `qwen2` one lacks the \p{M} parts).
QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen's special added tokens, in Qwen's id order.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added but not special in Qwen3: they are ordinary text to the chat template.
PLAIN_ADDED_TOKENS = ("<think>", "</think>")
BPE_VOCAB_SIZE = 800  # byte alphabet (256) + ~540 merges
PARTIAL_ROTARY_FACTOR = 0.25
ROPE_THETA = 10_000.0  # transformers' default for Qwen3_5TextConfig
# Head scalars, tuned on random heads over the request suite: the median question
# answers a top probability ~1.5-2.7x uniform, almost none is saturated (an option
# below 0.01 would hide logit errors), and the lexical prior and the joint path
# (routing, decoder layers, residual scorer) move the logits about equally, so a
# converter error in either path shows.
PRIOR_LOGIT_SCALE = math.log(10.0)
JOINT_LOGIT_SCALE = math.log(20.0)
RESIDUAL_GATE = 1.0  # sigmoid(1) ~ 0.73

# Projections that write into the residual stream, and how much smaller they are drawn.
RESIDUAL_WRITERS = ("o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight")
RESIDUAL_WRITE_SCALE = 0.2

# The vision tower and its image processor (preprocessor_config.json).
VISUAL_PREFIX = "model.visual."
VISION_PATCH_SIZE = 16
VISION_MERGE_SIZE = 2  # 2 x 2 patches -> one image token
VISION_TEMPORAL_PATCH_SIZE = 2  # an image is its frame twice
VISION_MIN_TOKENS = 16
VISION_MAX_TOKENS = 256
VISION_IMAGE_MEAN = (0.48, 0.46, 0.41)
VISION_IMAGE_STD = (0.27, 0.26, 0.28)

# Draws the random value of one named parameter of a given shape.
_ValueFn = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]


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
# The benchmarks' fixture (tools/bench_*.py; issue 12's): hidden 256, 8 layers, a head 128 wide (6 + 3 layers);
# rows of 256, so that the K-quants apply.
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
# The released Clef-flash layout (32 layers, every 4th full attention, a
# 6 + 3 layer head: 160 head tensors) at widths small enough for CPU tests.
CLEF_FLASH_LAYOUT = ReleaseSpec(
    layers=32,
    full_attention_interval=4,
    hidden=64,
    intermediate=96,
    heads=4,
    kv_heads=2,
    head_dim=32,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    head_width=32,
    routing_layers=6,
    head_layers=3,
    head_heads=2,
    head_feedforward=64,
)


def reference_path() -> Path:
    """Path of Cloudflare's joint_schema_model.py as shipped in clef-finetune."""
    spec = importlib.util.find_spec("clef_finetune")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("clef-finetune is not installed: pip install --no-deps clef-finetune==0.1.0")
    return Path(next(iter(spec.submodule_search_locations))) / "_vendor" / "joint_schema_model.py"


def load_reference() -> ModuleType:
    """Import the reference by file path, so clef_finetune/__init__ (and its deps) never runs."""
    if REFERENCE_MODULE in sys.modules:
        return sys.modules[REFERENCE_MODULE]
    path = reference_path()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != REFERENCE_SHA256:
        raise RuntimeError(f"{path} has sha256 {digest}, expected {REFERENCE_SHA256}: not the reference")
    module_spec = importlib.util.spec_from_file_location(REFERENCE_MODULE, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    # dataclasses resolve annotations through sys.modules, so register before executing.
    sys.modules[REFERENCE_MODULE] = module
    module_spec.loader.exec_module(module)
    return module


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


# --- tokenizer -------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A Qwen-shaped byte-level BPE tokenizer (fresh object on every call)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=262_144,
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def _trained_tokenizer_json() -> str:
    # Training takes ~0.1 s but every build needs the same result: cache the JSON.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens(list(PLAIN_ADDED_TOKENS))
    return tokenizer.to_str()


def _corpus() -> list[str]:
    """Built-in training text: the Clef prompt template, JSON, English, digits, unicode."""
    system = load_reference().SYSTEM_PROMPT
    template = [
        f"system\n{system}\nuser\nSTATE:\n",
        "\n\nSCHEMA FIELDS:\n",
        "\nFIELD 1\nID: is_spam\nTYPE: noul\nINSTRUCTION: Is this message spam?",
        "\nFIELD 2\nID: category\nTYPE: choice\nINSTRUCTION: Which category fits best?",
        "\nFIELD 3\nID: severity\nTYPE: score\nINSTRUCTION: How severe is the issue?",
        "\nALLOWED OPTIONS:\nOPTION 1: ",
        '{"description":"The proposition is true or the answer is yes.","option_id":"true"}\n',
        '{"description":"The proposition is false or the answer is no.","option_id":"false"}\n',
        '{"description":"A billing question","option_id":"billing"}\nOPTION 2: ',
        "END FIELD\n",
        "\nassistant\n\n\nJOINT SCHEMA DECISIONS:",
    ]
    json_text = [
        '{"user":{"name":"Ada","age":36,"tags":["admin","beta"]},"active":true,"score":0.75}',
        '{"order_id":10482,"items":[{"sku":"A-17","qty":2},{"sku":"B-3","qty":1}],"note":null}',
        '[1,2,3,{"nested":{"deep":[true,false,null]}},"end"]',
    ]
    english = [
        "The quick brown fox jumps over the lazy dog while the customer waits for support.",
        "Please review the following conversation and decide whether the request is urgent.",
        "Our refund policy allows returns within thirty days of purchase with a receipt.",
        "The server returned an error after the deployment, so the team rolled it back.",
        "She said it's fine, they're sure we'll win, and I'd rather you'd not ask again.",
    ]
    digits = [" ".join(str(n) for n in range(0, 200, 7)), "3.14159 2.71828 1e-6 -42 1,000,000 2026-11-29"]
    unicode_text = [
        "Café crème, naïve résumé, état des lieux, Straße, façade, Ångström, año.",
        "是否需要人工审核？这是一个测试句子。日本語のテキストも少し。한국어 문장입니다.",
        "Emoji: 🙂 🚀 👍🏽 ❤️ 🇫🇷 ✅ — and symbols: € £ ¥ © ™ ≤ ≥ ∞.",
        "Ελληνικά κείμενα και русский текст для проверки юникода.",
    ]
    # Repetition weights the template text, as in real Clef prompts.
    return template * 4 + json_text * 2 + english * 2 + digits + unicode_text * 2


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
    generator = torch.Generator().manual_seed(spec.seed)
    _randomize(model, generator, _backbone_value)
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


def _randomize(
    module: torch.nn.Module,
    generator: torch.Generator,
    value: _ValueFn,
) -> None:
    # Sorted names make the draw order independent of module registration order;
    # copy_ in place keeps tied parameters tied.
    with torch.no_grad():
        for name, parameter in sorted(module.named_parameters()):
            parameter.copy_(value(name, tuple(parameter.shape), generator))


def _normal(shape: tuple[int, ...], generator: torch.Generator, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * std + mean


def _uniform(shape: tuple[int, ...], generator: torch.Generator, low: float, high: float) -> torch.Tensor:
    return torch.rand(shape, generator=generator) * (high - low) + low


def _fan_in_normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    # Variance-preserving scale: every layer moves the residual stream visibly
    # without blowing it up.
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return _normal(shape, generator, std=1.0 / math.sqrt(fan_in))


def _backbone_value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        # Decay rates exp(A_log) spread over [0.05, 4]: distinct per V head, so a
        # wrong V-head order changes the output; some heads keep long memory.
        return _uniform(shape, generator, 0.05, 4.0).log()
    if name.endswith("dt_bias"):
        return _normal(shape, generator)
    if name.endswith("conv1d.weight"):
        # Asymmetric taps: a time-reversed or transposed kernel gives other outputs.
        return _normal(shape, generator, std=0.5)
    if name.endswith("linear_attn.norm.weight") or (".visual." in name and "norm" in name and name.endswith("weight")):
        # Gated RMSNorm and vision LayerNorms multiply by the weight itself.
        return _normal(shape, generator, std=0.3, mean=1.0)
    if "norm" in name and name.endswith("weight"):
        # Qwen3.5 RMSNorms multiply by (1 + weight): a converter that forgets the
        # +1 would scale by ~0.3 instead of ~1.
        return _normal(shape, generator, std=0.3)
    if name.endswith("bias"):
        return _normal(shape, generator, std=0.05)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return _normal(shape, generator)
    if name.endswith(RESIDUAL_WRITERS):
        # Trained models add small updates to a dominant residual stream; a fixture whose
        # layers rewrite it amplifies rounding (q8_0) far beyond what real Clef files see.
        return _fan_in_normal(shape, generator) * RESIDUAL_WRITE_SCALE
    return _fan_in_normal(shape, generator)


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
    # A different stream than the backbone's, so head and backbone draws never coincide.
    generator = torch.Generator().manual_seed(spec.seed + 1_000_003)
    _randomize(head, generator, _head_value)
    with torch.no_grad():
        head.prior_logit_scale.fill_(PRIOR_LOGIT_SCALE)
        head.joint_logit_scale.fill_(JOINT_LOGIT_SCALE)
        head.residual_gate.fill_(RESIDUAL_GATE)
    return head


def _head_value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if not shape:  # the three scalars, set explicitly afterwards
        return torch.zeros(())
    if "norm" in name and name.endswith("weight"):
        return _normal(shape, generator, std=0.2, mean=1.0)  # nn.LayerNorm: weight itself
    if name.endswith("bias"):
        return _normal(shape, generator, std=0.1)
    if name.startswith("type_embedding"):
        return _normal(shape, generator)
    return _fan_in_normal(shape, generator)


def _save_head(out_dir: Path, spec: ReleaseSpec, reference: ModuleType) -> None:
    head = build_head(spec, reference)
    dtype = getattr(torch, spec.dtype)
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in head.state_dict().items()}
    save_file(tensors, str(out_dir / "joint_head.safetensors"))
    (out_dir / "joint_head_config.json").write_text(json.dumps(head_config(spec), indent=2) + "\n")


# Two fixtures, as the parity criteria ask: untied float32, and tied bfloat16 (sharded).
RELEASES: dict[str, ReleaseSpec] = {
    "untied_f32": ReleaseSpec(seed=0),
    "tied_bf16": ReleaseSpec(seed=1, tied=True, dtype="bfloat16", max_shard_bytes=200_000),
    # Rows that are multiples of 256, so that llama.cpp's K-quants apply (not their fallbacks).
    "k256": ReleaseSpec(
        seed=2, hidden=256, intermediate=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, head_width=64
    ),
}
