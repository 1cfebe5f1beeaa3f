"""The GGUF contract of a Clef file: llama.cpp's own Clef format, as one table.

Convert and graft write what this module describes, validate checks it, and the
runtime and the native head (through the names Python hands it) read it; docs/format.md
is its specification, with file:line references into llama.cpp's source. A Clef GGUF is
a llama.cpp `qwen35` backbone (llama.cpp's tensor names and layouts, hyperparameters
under `clef.*` with the suffixes `qwen35.*` would use) plus the joint schema head
(`dec.blk.N.*`, `decision.*`, `token_types.weight`) and the `systemone` prompt template
of Cloudflare's `joint_schema_model.py` (format/template.py). Tensor order is not part of the format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from gguf import GGMLQuantizationType as GT
from gguf import Keys

ARCH = "clef"
BACKBONE_ARCH = "qwen35"
DECISION_TYPE = "clef"  # llama.cpp's DecisionType.CLEF: its server's joint decision path
# sha256 of Cloudflare's joint_schema_model.py whose prompt template and head this
# contract implements (the copy clef-finetune==0.1.0 vendors).
REFERENCE_SHA256 = "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3"

KEY_DECISION_TYPE = "clef.decision.type"
KEY_REFERENCE_SHA256 = "clef.reference.sha256"
KEY_NORMALIZER = "clef.tokenizer.normalizer"
KEY_TOKENIZER_PREFIX = "tokenizer.ggml."  # of gguf.Keys.Tokenizer.MODEL, .LIST, ...: gguf-py has no constant for it
# The prompt: a named chat template (format/template.py holds the one convert writes, and renders a file's).
TEMPLATE_NAME = "systemone"
KEY_TEMPLATE = Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=TEMPLATE_NAME)
KEY_TEMPLATE_NAMES = Keys.Tokenizer.CHAT_TEMPLATES
KEY_TEMPERATURE_PREFIX = f"{ARCH}.decision.temperature."  # + <name>: a softmax temperature (format/temperatures.py)

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
    hf: str  # HF name (a layer's below model.language_model.layers.{bid}.)
    gguf: str  # llama.cpp qwen35 name (a layer's below blk.{bid}.)
    shape: tuple[str, ...]  # numpy (row-major) order, in the widths of BackboneShape.dims
    transform: Transform = Transform.NONE


HF_TEXT_PREFIX = "model.language_model."
OUTPUT = "output.weight"  # absent from a tied file: llama.cpp reuses token_embd
# The tensors after the layers, in file order.
FINAL_RULES = (
    TensorRule("model.language_model.norm.weight", "output_norm.weight", ("n_embd",), Transform.NORM_PLUS_ONE),
    TensorRule("model.language_model.embed_tokens.weight", "token_embd.weight", ("n_vocab", "n_embd")),
    TensorRule("lm_head.weight", OUTPUT, ("n_vocab", "n_embd")),
)
COMMON_LAYER_RULES = (
    TensorRule("input_layernorm.weight", "attn_norm.weight", ("n_embd",), Transform.NORM_PLUS_ONE),
    TensorRule("post_attention_layernorm.weight", "post_attention_norm.weight", ("n_embd",), Transform.NORM_PLUS_ONE),
    TensorRule("mlp.gate_proj.weight", "ffn_gate.weight", ("n_ff", "n_embd")),
    TensorRule("mlp.up_proj.weight", "ffn_up.weight", ("n_ff", "n_embd")),
    TensorRule("mlp.down_proj.weight", "ffn_down.weight", ("n_embd", "n_ff")),
)
FULL_ATTENTION_RULES = (
    TensorRule("self_attn.q_proj.weight", "attn_q.weight", ("q_gate_dim", "n_embd")),
    TensorRule("self_attn.k_proj.weight", "attn_k.weight", ("kv_dim", "n_embd")),
    TensorRule("self_attn.v_proj.weight", "attn_v.weight", ("kv_dim", "n_embd")),
    TensorRule("self_attn.o_proj.weight", "attn_output.weight", ("n_embd", "q_dim")),
    TensorRule("self_attn.q_norm.weight", "attn_q_norm.weight", ("head_dim",), Transform.NORM_PLUS_ONE),
    TensorRule("self_attn.k_norm.weight", "attn_k_norm.weight", ("head_dim",), Transform.NORM_PLUS_ONE),
)
LINEAR_ATTENTION_RULES = (
    TensorRule("linear_attn.in_proj_qkv.weight", "attn_qkv.weight", ("conv_dim", "n_embd"), Transform.QKV_ROWS),
    TensorRule("linear_attn.in_proj_z.weight", "attn_gate.weight", ("value_dim", "n_embd"), Transform.V_ROWS),
    TensorRule("linear_attn.in_proj_a.weight", "ssm_alpha.weight", ("v_heads", "n_embd"), Transform.V_HEAD_ROWS),
    TensorRule("linear_attn.in_proj_b.weight", "ssm_beta.weight", ("v_heads", "n_embd"), Transform.V_HEAD_ROWS),
    TensorRule("linear_attn.conv1d.weight", "ssm_conv1d.weight", ("conv_dim", "conv_kernel"), Transform.CONV1D),
    TensorRule("linear_attn.dt_bias", "ssm_dt.bias", ("v_heads",), Transform.V_HEADS_1D),
    TensorRule("linear_attn.A_log", "ssm_a", ("v_heads",), Transform.NEG_EXP),
    TensorRule("linear_attn.norm.weight", "ssm_norm.weight", ("linear_head_dim",)),
    TensorRule("linear_attn.out_proj.weight", "ssm_out.weight", ("n_embd", "value_dim"), Transform.V_COLUMNS),
)
# llama.cpp keeps these in F32 whatever the file type (its converter does the same).
F32_ONLY_SUFFIXES = ("_norm.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")

# The types a weight matrix may have: what llama.cpp's CPU backend runs as weights. The native head,
# a ggml graph too, is handed this very table (llama/native_head.py), so it runs what validate accepts.
WEIGHT_TYPES = frozenset(
    {GT.F32, GT.F16, GT.BF16, GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0, GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K}
    | {GT.IQ2_XXS, GT.IQ2_XS, GT.IQ2_S, GT.IQ3_XXS, GT.IQ3_S, GT.IQ1_S, GT.IQ1_M, GT.IQ4_NL, GT.IQ4_XS}
    | {GT.TQ1_0, GT.TQ2_0, GT.MXFP4}
)


def needs_f32(name: str, n_dims: int) -> bool:
    """Vectors (biases, norms: ggml_add and ggml_mul operands, which ggml runs in F32 only) and what llama.cpp keeps in F32."""
    return n_dims == 1 or name.endswith((".bias", "norm.weight", *F32_ONLY_SUFFIXES))


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

    def dims(self) -> dict[str, int]:
        """The widths the tensor rules' shapes name: the shape's own, and those made of them."""
        q_dim, value_dim = self.n_head * self.head_dim, self.v_heads * self.linear_head_dim
        own = ("n_vocab", "n_embd", "n_ff", "head_dim", "v_heads", "conv_kernel", "linear_head_dim")
        return {name: getattr(self, name) for name in own} | {
            "q_dim": q_dim,
            "q_gate_dim": 2 * q_dim,  # attn_q holds the queries and their output gate
            "kv_dim": self.n_head_kv * self.head_dim,
            "conv_dim": 2 * self.k_heads * self.linear_head_dim + value_dim,  # linear attention's q, k and v channels
            "value_dim": value_dim,
        }


@dataclass(frozen=True)
class BackboneTensor:
    """One backbone tensor of a given shape: its names, its numpy (row-major) shape, what convert does to it."""

    hf: str
    gguf: str
    shape: tuple[int, ...]
    transform: Transform


def backbone_tensors(s: BackboneShape) -> list[BackboneTensor]:
    """Every tensor llama.cpp's qwen35 loader asks for, in file order: the rules, layers expanded."""
    dims = s.dims()

    def expand(rule: TensorRule, hf_prefix: str = "", gguf_prefix: str = "") -> BackboneTensor:
        shape = tuple(dims[d] for d in rule.shape)
        return BackboneTensor(hf_prefix + rule.hf, gguf_prefix + rule.gguf, shape, rule.transform)

    tensors = [
        expand(rule, f"{HF_TEXT_PREFIX}layers.{bid}.", f"blk.{bid}.")
        for bid, recurrent in enumerate(s.recurrent)
        for rule in COMMON_LAYER_RULES + (LINEAR_ATTENTION_RULES if recurrent else FULL_ATTENTION_RULES)
    ]
    return tensors + [expand(rule) for rule in FINAL_RULES if not (s.tied and rule.gguf == OUTPUT)]


def backbone_tensor_shapes(s: BackboneShape) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp's qwen35 loader asks for, in file order, in numpy (row-major) shape order."""
    return {t.gguf: t.shape for t in backbone_tensors(s)}


# --- The decision head, in llama.cpp's Clef layout (docs/format.md) --------------------
KEY_ROUTING_BLOCKS = "clef.decision.routing_block_count"
KEY_JOINT_BLOCKS = "clef.decision.block_count"
KEY_HEAD_COUNT = "clef.decision.head_count"
KEY_HEAD_NORM_EPS = "clef.attention.layer_norm_epsilon"
# Question types, as rows of the head's type embedding (decision.type_embd) and libclef_head's type ids.
QUESTION_TYPES = {"noul": 0, "choice": 1, "score": 2}
HEAD_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, the head's LayerNorms
SCALES = "decision.scales"  # [prior, joint, gate]: the values the reference uses at inference
SCALE_PARAMETERS = ("prior_logit_scale", "joint_logit_scale", "residual_gate")
ATTENTION_PARTS = ("q", "k", "v")  # nn.MultiheadAttention's packed in_proj rows, in this order

# Reference module (joint_head.safetensors, `{i}` a block index) -> llama.cpp module (`{bid}`
# the dec.blk index: routing blocks first, then the joint layers). A norm or linear module
# holds `.weight` and `.bias`; an attention module becomes `<name>_q/_k/_v/_o`.
HEAD_GLOBALS = {
    "hidden_norm": "decision.hidden_norm",
    "memory_projection": "decision.proj_memory",
    "question_projection": "decision.proj_question",
    "option_question_projection": "decision.proj_option_question",
    "global_projection": "decision.proj_global",
    "option_context_projection": "decision.proj_option_context",
    "option_lexical_projection": "decision.proj_option_lexical",
    "type_embedding": "token_types",
    "option_summary_norm": "decision.option_summary_norm",
    "field_norm": "decision.field_norm",
    "option_norm": "decision.option_norm",
    "residual_scorer.0": "decision.scorer",
    "residual_scorer.3": "decision.scorer_out",
}
ROUTING_BLOCK = {
    "evidence_layers.{i}.query_norm": "dec.blk.{bid}.cross_attn_norm",
    "evidence_layers.{i}.memory_norm": "dec.blk.{bid}.cross_attn_norm_kv",
    "evidence_layers.{i}.attention": "dec.blk.{bid}.cross_attn",
    "evidence_layers.{i}.feedforward_norm": "dec.blk.{bid}.ffn_norm",
    "evidence_layers.{i}.feedforward.0": "dec.blk.{bid}.ffn_up",
    "evidence_layers.{i}.feedforward.3": "dec.blk.{bid}.ffn_down",
}
JOINT_BLOCK = {
    "layers.{i}.norm1": "dec.blk.{bid}.attn_norm",
    "layers.{i}.self_attn": "dec.blk.{bid}.attn",
    "layers.{i}.norm2": "dec.blk.{bid}.cross_attn_norm",
    "layers.{i}.multihead_attn": "dec.blk.{bid}.cross_attn",
    "layers.{i}.norm3": "dec.blk.{bid}.ffn_norm",
    "layers.{i}.linear1": "dec.blk.{bid}.ffn_up",
    "layers.{i}.linear2": "dec.blk.{bid}.ffn_down",
}
_ATTENTION_MODULES = ("attention", "self_attn", "multihead_attn")
# The tensors whose rows are the head's widths, as llama.cpp's Clef loader reads them (HeadConfig field -> tensor).
HEAD_WIDTH_TENSORS = {
    "width": f"{HEAD_GLOBALS['memory_projection']}.weight",
    "feedforward": f"{ROUTING_BLOCK['evidence_layers.{i}.feedforward.0'].format(bid=0)}.weight",  # a joint block's alike
}


@dataclass(frozen=True)
class HeadConfig:
    """JointSchemaHead's constructor arguments, and its LayerNorms' epsilon (KEY_HEAD_NORM_EPS in a file)."""

    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int
    norm_eps: float = HEAD_NORM_EPS


@dataclass(frozen=True)
class HeadRule:
    """One GGUF head tensor and where it comes from in joint_head.safetensors."""

    gguf: str
    reference: str
    part: int | None = None  # of a packed in_proj: rows [part * W, (part + 1) * W)


def head_modules(c: HeadConfig) -> dict[str, str]:
    """Every head module, reference name -> GGUF name, blocks expanded. Attention modules
    are listed by part (`<ref>.q` -> `<gguf>_q`, ..., `<ref>.out` -> `<gguf>_o`)."""
    modules = dict(HEAD_GLOBALS)
    blocks = [(ROUTING_BLOCK, i, i) for i in range(c.routing_layers)]
    blocks += [(JOINT_BLOCK, i, c.routing_layers + i) for i in range(c.layers)]
    for table, i, bid in blocks:
        for reference, gguf in table.items():
            reference, gguf = reference.format(i=i), gguf.format(bid=bid)
            if reference.rsplit(".", 1)[-1] in _ATTENTION_MODULES:
                modules |= {f"{reference}.{x}": f"{gguf}_{x}" for x in ATTENTION_PARTS}
                modules[f"{reference}.out"] = f"{gguf}_o"
            else:
                modules[reference] = gguf
    return modules


def head_rules(c: HeadConfig) -> list[HeadRule]:
    """Every GGUF head tensor but decision.scales: 20 + 18 * routing + 26 * layers - 1."""
    reference = reference_head_shapes(c)
    rules = []
    for module, gguf in head_modules(c).items():
        parent, _, part = module.rpartition(".")
        for suffix in ("weight", "bias"):
            if part in ATTENTION_PARTS:
                rule = HeadRule(f"{gguf}.{suffix}", f"{parent}.in_proj_{suffix}", ATTENTION_PARTS.index(part))
            elif part == "out":
                rule = HeadRule(f"{gguf}.{suffix}", f"{parent}.out_proj.{suffix}")
            else:
                rule = HeadRule(f"{gguf}.{suffix}", f"{module}.{suffix}")
            if rule.reference in reference:  # projections and the type embedding have no bias
                rules.append(rule)
    return rules


def reference_head_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """JointSchemaHead's state_dict (joint_head.safetensors) with shapes: 22 + 14*R + 18*L tensors."""
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
    for scalar in SCALE_PARAMETERS:
        shapes[scalar] = ()
    return shapes


def head_tensor_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every GGUF head tensor llama.cpp's Clef loader asks for, in numpy (row-major) shape order."""
    reference = reference_head_shapes(c)
    shapes = {}
    for rule in head_rules(c):
        shape = reference[rule.reference]
        shapes[rule.gguf] = shape if rule.part is None else (shape[0] // 3, *shape[1:])
    shapes[SCALES] = (len(SCALE_PARAMETERS),)
    return shapes


@dataclass(frozen=True)
class ManifestRow:
    """One head tensor as libclef_head binds it: `role`, the reference module and tensor it stands for
    ("layers.0.self_attn.q.weight"), names the field; the C++ declares no name, shape or type of its own."""

    role: str
    gguf: str
    ne: tuple[int, int]  # ggml order, a vector's ne1 1
    f32: bool  # vectors (norms, biases, decision.scales) are F32; matrices any of WEIGHT_TYPES


def head_manifest(c: HeadConfig) -> list[ManifestRow]:
    """Every tensor libclef_head reads, from head_modules and head_tensor_shapes: the head's one table."""
    shapes = head_tensor_shapes(c)

    def row(role: str, name: str) -> ManifestRow:
        shape = shapes[name]
        return ManifestRow(role, name, (shape[-1], shape[0] if len(shape) == 2 else 1), len(shape) == 1)

    modules = head_modules(c).items()
    rows = [row(f"{m}.{x}", f"{g}.{x}") for m, g in modules for x in ("weight", "bias") if f"{g}.{x}" in shapes]
    return [*rows, row("scales", SCALES)]


def head_tensor_count(routing_layers: int, layers: int) -> int:
    return 20 + 18 * routing_layers + 26 * layers


def reference_tensor_count(routing_layers: int, layers: int) -> int:
    """Tensors of joint_head.safetensors."""
    return 22 + 14 * routing_layers + 18 * layers


def inference_scales(prior_logit_scale: float, joint_logit_scale: float, residual_gate: float) -> tuple[float, float, float]:
    """decision.scales from the three learned scalars: exp clamped at 100, and the sigmoid gate (in float64)."""
    cap = math.log(100.0)
    gate = 1.0 / (1.0 + math.exp(-residual_gate))
    return math.exp(min(prior_logit_scale, cap)), math.exp(min(joint_logit_scale, cap)), gate


TOKEN_TYPES = "token_types.weight"  # the head's question-type embedding (llama.cpp keeps it F32)


def is_head_tensor(name: str) -> bool:
    return name.startswith(("dec.", "decision.")) or name == TOKEN_TYPES
