"""The GGUF contract of a Clef file: keys, tensor names and shapes.

Convert writes what this module describes, validate checks it and the runtime reads
it. A Clef GGUF is a llama.cpp `qwen35` backbone (llama.cpp's tensor names and
layouts, hyperparameters under `clef.*` with the suffixes `qwen35.*` would use) plus
the joint schema head (`head.` + the reference state_dict name) and the prompt
template of Cloudflare's `joint_schema_model.py`.

Data layout rule: the backbone comes first in the data section, contiguous from
offset 0, in this order: the layers (blk.*), output_norm, token_embd, output; then
the head. The runtime relies on it to lay synthesized `qwen35` headers over the
file's data (runtime/qwen35_view.py): one for the whole backbone, and one that ends
with the first rows of token_embd and leaves output out, so that llama.cpp's LM head
(logits nobody reads: n_vocab floats per token) costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

ARCH = "clef"
BACKBONE_ARCH = "qwen35"
DECISION_TYPE = "joint_schema"
# sha256 of Cloudflare's joint_schema_model.py whose prompt template and head this
# contract implements (the copy clef-finetune==0.1.0 vendors).
REFERENCE_SHA256 = "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3"

KEY_DECISION_TYPE = "clef.decision.type"
KEY_BACKBONE_ARCH = "clef.backbone.architecture"
KEY_VISION = "clef.vision"
KEY_REFERENCE_SHA256 = "clef.reference.sha256"
KEY_NORMALIZER = "clef.tokenizer.normalizer"
VISION_NOT_CONVERTED = "not converted: this file answers text-only requests"

# Backbone hyperparameters: stored as `clef.<suffix>`, read by llama.cpp as `qwen35.<suffix>`.
BACKBONE_KEY_SUFFIXES = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.recurrent_layers",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.dimension_sections",
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
    "full_attention_interval",
)

# JointSchemaHead constructor arguments, stored as `clef.head.<name>` (uint32).
HEAD_CONFIG_FIELDS = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")
HEAD_PREFIX = "head."


def backbone_key(suffix: str) -> str:
    return f"{ARCH}.{suffix}"


def head_key(name: str) -> str:
    return f"{ARCH}.head.{name}"


def prompt_key(name: str) -> str:
    return f"{ARCH}.prompt.{name}"


# --- The prompt template -------------------------------------------------------------
# Pieces of encode_record() in the reference, tokenized one by one exactly as there.
# `{...}` placeholders are filled with str.format; values are never re-parsed.
SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. Each answer "
    "must be exactly one of that field's allowed options."
)
PROMPT_TEMPLATE: dict[str, str] = {
    "prefix": "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nSTATE:\n",
    "system": SYSTEM_PROMPT,
    "schema_header": "\n\nSCHEMA FIELDS:\n",
    "field_header": "\nFIELD {index}\nID: {id}\nTYPE: {type}\nINSTRUCTION: ",
    "options_header": "\nALLOWED OPTIONS:\n",
    "option_header": "OPTION {index}: ",
    "option_end": "\n",
    "field_end": "END FIELD\n",
    "suffix": "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:",
    "noul_true": "The proposition is true or the answer is yes.",
    "noul_false": "The proposition is false or the answer is no.",
}
# Special tokens the template relies on; validate checks the vocabulary has them.
TEMPLATE_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")


# --- Backbone tensors ------------------------------------------------------------------
class Transform(str, Enum):
    """What convert does to an HF tensor before writing it (see convert.py)."""

    NONE = "none"
    NORM_PLUS_ONE = "norm_plus_one"  # Qwen3.5 RMSNorm scales by (1 + w); llama.cpp by w
    NEG_EXP = "neg_exp"  # A_log -> A = -exp(A_log), reordered like V heads
    V_HEADS_1D = "v_heads_1d"  # dt_bias: one value per V head, reordered
    QKV_ROWS = "qkv_rows"  # in_proj_qkv: reorder the V rows only
    V_ROWS = "v_rows"  # in_proj_z: rows grouped by V head
    V_HEAD_ROWS = "v_head_rows"  # in_proj_a / in_proj_b: one row per V head
    V_COLUMNS = "v_columns"  # out_proj: columns grouped by V head
    CONV1D = "conv1d"  # (channels, 1, kernel) -> (channels, kernel), V channels reordered


@dataclass(frozen=True)
class TensorRule:
    hf: str  # HF name; {bid} is the layer index
    gguf: str  # llama.cpp qwen35 name
    transform: Transform = Transform.NONE


HF_TEXT_PREFIX = "model.language_model."
# In file order, after the layers (see the layout rule above).
FINAL_RULES = (
    TensorRule("model.language_model.norm.weight", "output_norm.weight", Transform.NORM_PLUS_ONE),
    TensorRule("model.language_model.embed_tokens.weight", "token_embd.weight"),
    TensorRule("lm_head.weight", "output.weight"),
)
COMMON_LAYER_RULES = (
    TensorRule("input_layernorm.weight", "attn_norm.weight", Transform.NORM_PLUS_ONE),
    TensorRule("post_attention_layernorm.weight", "post_attention_norm.weight", Transform.NORM_PLUS_ONE),
    TensorRule("mlp.gate_proj.weight", "ffn_gate.weight"),
    TensorRule("mlp.up_proj.weight", "ffn_up.weight"),
    TensorRule("mlp.down_proj.weight", "ffn_down.weight"),
)
FULL_ATTENTION_RULES = (
    TensorRule("self_attn.q_proj.weight", "attn_q.weight"),
    TensorRule("self_attn.k_proj.weight", "attn_k.weight"),
    TensorRule("self_attn.v_proj.weight", "attn_v.weight"),
    TensorRule("self_attn.o_proj.weight", "attn_output.weight"),
    TensorRule("self_attn.q_norm.weight", "attn_q_norm.weight", Transform.NORM_PLUS_ONE),
    TensorRule("self_attn.k_norm.weight", "attn_k_norm.weight", Transform.NORM_PLUS_ONE),
)
LINEAR_ATTENTION_RULES = (
    TensorRule("linear_attn.in_proj_qkv.weight", "attn_qkv.weight", Transform.QKV_ROWS),
    TensorRule("linear_attn.in_proj_z.weight", "attn_gate.weight", Transform.V_ROWS),
    TensorRule("linear_attn.in_proj_a.weight", "ssm_alpha.weight", Transform.V_HEAD_ROWS),
    TensorRule("linear_attn.in_proj_b.weight", "ssm_beta.weight", Transform.V_HEAD_ROWS),
    TensorRule("linear_attn.conv1d.weight", "ssm_conv1d.weight", Transform.CONV1D),
    TensorRule("linear_attn.dt_bias", "ssm_dt.bias", Transform.V_HEADS_1D),
    TensorRule("linear_attn.A_log", "ssm_a", Transform.NEG_EXP),
    TensorRule("linear_attn.norm.weight", "ssm_norm.weight"),
    TensorRule("linear_attn.out_proj.weight", "ssm_out.weight", Transform.V_COLUMNS),
)
# llama.cpp keeps these in F32 whatever the file type (its converter does the same).
F32_ONLY_SUFFIXES = ("_norm.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")


@dataclass(frozen=True)
class BackboneShape:
    """The hyperparameters that determine the backbone's tensors."""

    n_vocab: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    recurrent: tuple[bool, ...]  # per layer: linear attention (True) or full attention
    conv_kernel: int
    k_heads: int  # linear attention key heads (ssm.group_count)
    v_heads: int  # linear attention value heads (ssm.time_step_rank)
    linear_head_dim: int  # key and value head dim of linear attention (ssm.state_size)
    tied: bool  # no output.weight: llama.cpp reuses token_embd


def layer_rules(recurrent: bool) -> tuple[TensorRule, ...]:
    return COMMON_LAYER_RULES + (LINEAR_ATTENTION_RULES if recurrent else FULL_ATTENTION_RULES)


def backbone_tensor_shapes(s: BackboneShape) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp's qwen35 loader asks for, in file order, in numpy (row-major) shape order."""
    key_dim = s.k_heads * s.linear_head_dim
    value_dim = s.v_heads * s.linear_head_dim
    conv_dim = 2 * key_dim + value_dim
    q_dim = s.n_head * s.head_dim
    kv_dim = s.n_head_kv * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for bid, recurrent in enumerate(s.recurrent):
        layer = {
            "attn_norm.weight": (s.n_embd,),
            "post_attention_norm.weight": (s.n_embd,),
            "ffn_gate.weight": (s.n_ff, s.n_embd),
            "ffn_up.weight": (s.n_ff, s.n_embd),
            "ffn_down.weight": (s.n_embd, s.n_ff),
        }
        if recurrent:
            layer |= {
                "attn_qkv.weight": (conv_dim, s.n_embd),
                "attn_gate.weight": (value_dim, s.n_embd),
                "ssm_alpha.weight": (s.v_heads, s.n_embd),
                "ssm_beta.weight": (s.v_heads, s.n_embd),
                "ssm_conv1d.weight": (conv_dim, s.conv_kernel),
                "ssm_dt.bias": (s.v_heads,),
                "ssm_a": (s.v_heads,),
                "ssm_norm.weight": (s.linear_head_dim,),
                "ssm_out.weight": (s.n_embd, value_dim),
            }
        else:
            layer |= {
                "attn_q.weight": (2 * q_dim, s.n_embd),  # queries and their output gate
                "attn_k.weight": (kv_dim, s.n_embd),
                "attn_v.weight": (kv_dim, s.n_embd),
                "attn_output.weight": (s.n_embd, q_dim),
                "attn_q_norm.weight": (s.head_dim,),
                "attn_k_norm.weight": (s.head_dim,),
            }
        shapes |= {f"blk.{bid}.{name}": shape for name, shape in layer.items()}
    shapes["output_norm.weight"] = (s.n_embd,)
    shapes["token_embd.weight"] = (s.n_vocab, s.n_embd)
    if not s.tied:
        shapes["output.weight"] = (s.n_vocab, s.n_embd)
    return shapes


# --- Head tensors -------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int


def head_tensor_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """JointSchemaHead's state_dict (reference names) with shapes: 22 + 14*R + 18*L tensors.

    Scalars are stored with shape (1,) in GGUF; their reference shape is ().
    """
    w, h, ff = c.width, c.hidden_size, c.feedforward
    norm = {"weight": (w,), "bias": (w,)}
    attention = {"in_proj_weight": (3 * w, w), "in_proj_bias": (3 * w,), "out_proj.weight": (w, w), "out_proj.bias": (w,)}

    def group(prefix: str, entries: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.{name}": shape for name, shape in entries.items()}

    shapes = group("hidden_norm", {"weight": (h,), "bias": (h,)})
    for projection in ("memory", "question", "option_question", "global", "option_context", "option_lexical"):
        shapes[f"{projection}_projection.weight"] = (w, h)
    shapes["type_embedding.weight"] = (3, w)
    for i in range(c.routing_layers):
        p = f"evidence_layers.{i}"
        shapes |= group(f"{p}.query_norm", norm) | group(f"{p}.memory_norm", norm)
        shapes |= group(f"{p}.attention", attention) | group(f"{p}.feedforward_norm", norm)
        shapes |= {f"{p}.feedforward.0.weight": (ff, w), f"{p}.feedforward.0.bias": (ff,)}
        shapes |= {f"{p}.feedforward.3.weight": (w, ff), f"{p}.feedforward.3.bias": (w,)}
    shapes |= group("option_summary_norm", norm)
    for i in range(c.layers):
        p = f"layers.{i}"
        shapes |= group(f"{p}.self_attn", attention) | group(f"{p}.multihead_attn", attention)
        shapes |= {f"{p}.linear1.weight": (ff, w), f"{p}.linear1.bias": (ff,)}
        shapes |= {f"{p}.linear2.weight": (w, ff), f"{p}.linear2.bias": (w,)}
        for n in ("norm1", "norm2", "norm3"):
            shapes |= group(f"{p}.{n}", norm)
    shapes |= group("field_norm", norm) | group("option_norm", norm)
    shapes |= {"residual_scorer.0.weight": (w, 4 * w), "residual_scorer.0.bias": (w,)}
    shapes |= {"residual_scorer.3.weight": (1, w), "residual_scorer.3.bias": (1,)}
    for scalar in ("prior_logit_scale", "joint_logit_scale", "residual_gate"):
        shapes[scalar] = (1,)
    return shapes


def head_tensor_count(routing_layers: int, layers: int) -> int:
    return 22 + 14 * routing_layers + 18 * layers
