"""The joint schema head in numpy (float32), read top to bottom like the reference.

The TEST REFERENCE of the native head (native/head_graph.cpp, llama/native_head.py),
which is what decide() runs: this module is kept because it reads like Cloudflare's
JointSchemaHead line by line, and tests/test_native_head.py holds the ggml graph to it.

Inputs: the backbone's final hidden states of one prompt, the prompt's spans, and
the output-embedding rows of each option's tokens (the lexical prior). Output: one
logit per option, per question.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import gguf
import numpy as np

from clef_gguf.format import contract as C
from clef_gguf.format.contract import QUESTION_TYPES, HeadConfig
from clef_gguf.format.header import GGUFFile
from clef_gguf.runtime.prompt import EncodedPrompt

LN_EPS = 1e-5  # torch LayerNorm default, also inside TransformerDecoderLayer
Weights = Mapping[str, np.ndarray]


def erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf."""
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-a * a)
    return (s * y).astype(x.dtype, copy=False)


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + erf(x / np.float32(math.sqrt(2.0))))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class JointSchemaHead:
    def __init__(self, config: HeadConfig, weights: Weights) -> None:
        self.config = config
        self.w = weights

    # --- building blocks (torch.nn semantics) ---
    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def layer_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + LN_EPS) * self.w[f"{name}.weight"] + self.w[f"{name}.bias"]

    def attention(self, queries: np.ndarray, memory: np.ndarray, name: str) -> np.ndarray:
        """nn.MultiheadAttention(queries, memory, memory), no mask."""
        w, heads = self.config.width, self.config.heads
        wq, wk, wv = np.split(self.w[f"{name}.in_proj_weight"], 3)
        bq, bk, bv = np.split(self.w[f"{name}.in_proj_bias"], 3)
        d = w // heads
        q = (queries @ wq.T + bq).reshape(-1, heads, d).transpose(1, 0, 2)
        k = (memory @ wk.T + bk).reshape(-1, heads, d).transpose(1, 0, 2)
        v = (memory @ wv.T + bv).reshape(-1, heads, d).transpose(1, 0, 2)
        scores = softmax(q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(d)))
        out = (scores @ v).transpose(1, 0, 2).reshape(-1, w)
        return self.linear(out, f"{name}.out_proj")

    def evidence_layer(self, queries: np.ndarray, memory: np.ndarray, i: int) -> np.ndarray:
        p = f"evidence_layers.{i}"
        normalized_memory = self.layer_norm(memory, f"{p}.memory_norm")
        queries = queries + self.attention(self.layer_norm(queries, f"{p}.query_norm"), normalized_memory, f"{p}.attention")
        hidden = gelu(self.linear(self.layer_norm(queries, f"{p}.feedforward_norm"), f"{p}.feedforward.0"))
        return queries + self.linear(hidden, f"{p}.feedforward.3")

    def decoder_layer(self, x: np.ndarray, memory: np.ndarray, i: int) -> np.ndarray:
        """nn.TransformerDecoderLayer(norm_first=True, activation="gelu"), no masks."""
        p = f"layers.{i}"
        h = self.layer_norm(x, f"{p}.norm1")
        x = x + self.attention(h, h, f"{p}.self_attn")
        x = x + self.attention(self.layer_norm(x, f"{p}.norm2"), memory, f"{p}.multihead_attn")
        hidden = gelu(self.linear(self.layer_norm(x, f"{p}.norm3"), f"{p}.linear1"))
        return x + self.linear(hidden, f"{p}.linear2")

    # --- the head ---
    def __call__(self, hidden: np.ndarray, prompt: EncodedPrompt, lexical: list[np.ndarray]) -> list[np.ndarray]:
        """hidden: (tokens, hidden_size); lexical[i]: (options, hidden_size) mean output-embedding rows."""
        hs = self.layer_norm(hidden.astype(np.float32, copy=False), "hidden_norm")
        memory = self.linear(hs, "memory_projection")
        global_vector = hs[-1]

        def mean(span: tuple[int, int]) -> np.ndarray:
            return hs[span[0] : span[1]].mean(axis=0)

        questions = prompt.questions
        question_vectors = np.stack([mean(q.span) for q in questions])
        type_ids = [QUESTION_TYPES[q.question.type] for q in questions]
        queries = []
        for i, q in enumerate(questions):
            contexts = np.stack([mean(s) for s in q.option_spans])
            queries.append(
                self.linear(contexts, "option_context_projection")
                + self.linear(lexical[i], "option_lexical_projection")
                + self.linear(question_vectors[i], "option_question_projection")
            )
        routed = np.concatenate(queries)
        for i in range(self.config.routing_layers):
            routed = self.evidence_layer(routed, memory, i)
        split_at = np.cumsum([len(q.option_spans) for q in questions])[:-1]
        options_per_question = np.split(routed, split_at)

        base_fields = self.linear(question_vectors, "question_projection")
        summaries = []
        for field, options in zip(base_fields, options_per_question, strict=True):
            weights = softmax(options @ field / np.float32(math.sqrt(options.shape[-1])), axis=0)
            summaries.append((weights[:, None] * options).sum(axis=0))
        fields = (
            base_fields
            + self.layer_norm(np.stack(summaries), "option_summary_norm")
            + self.linear(global_vector, "global_projection")
            + self.w["type_embedding.weight"][type_ids]
        )
        for i in range(self.config.layers):
            fields = self.decoder_layer(fields, memory, i)
        fields = self.layer_norm(fields, "field_norm")

        prior_scale, joint_scale, gate = (float(v) for v in self.w["scales"])  # decision.scales: inference values
        logits = []
        for i, (field, routed_options) in enumerate(zip(fields, options_per_question, strict=True)):
            anchor = l2_normalize(question_vectors[i] + global_vector)
            prior = prior_scale * (l2_normalize(lexical[i]) @ anchor)
            options = self.layer_norm(routed_options, "option_norm")
            repeated = np.broadcast_to(field, options.shape)
            cosine = (options @ field) / np.maximum(np.linalg.norm(options, axis=-1) * np.linalg.norm(field), 1e-8)
            features = np.concatenate([repeated, options, repeated * options, np.abs(repeated - options)], axis=-1)
            residual = self.linear(gelu(self.linear(features, "residual_scorer.0")), "residual_scorer.3")[:, 0]
            logits.append(prior + gate * (joint_scale * cosine + residual))
        return logits


# --- Reading the reference's inputs from a Clef GGUF (dequantized to float32) -------------------------
def _dequantize(f: GGUFFile, name: str) -> np.ndarray:
    t = f.header.tensors[name]
    return gguf.quants.dequantize(f.tensor_bytes(name), t.type).reshape(t.shape).astype(np.float32)  # a copy


def reference_head(f: GGUFFile, config: HeadConfig) -> JointSchemaHead:
    """The head's weights under their reference names, the packed in_proj put back together from q, k, v."""
    shapes = C.reference_head_shapes(config)
    parts: dict[str, list[np.ndarray]] = {}
    for rule in C.head_rules(config):
        parts.setdefault(rule.reference, []).append(_dequantize(f, rule.gguf))  # q, k, v come in that order
    weights = {n: np.concatenate(p).reshape(shapes[n]) for n, p in parts.items()}
    weights["scales"] = _dequantize(f, C.SCALES)
    return JointSchemaHead(config, weights)


def lexical_rows(f: GGUFFile, prompt: EncodedPrompt) -> list[np.ndarray]:
    """Mean output-embedding row of each option's tokens (the head's lexical prior)."""
    name = "output.weight" if "output.weight" in f.header.tensors else "token_embd.weight"
    t = f.header.tensors[name]
    rows = f.tensor_bytes(name).reshape(t.shape[0], -1)
    ids = np.unique([prompt.tokens[i] for q in prompt.questions for s, e in q.option_spans for i in range(s, e)])
    table = dict(zip(ids.tolist(), gguf.quants.dequantize(rows[ids], t.type).astype(np.float32), strict=True))
    return [
        np.stack([np.mean([table[prompt.tokens[i]] for i in range(s, e)], axis=0) for s, e in q.option_spans])
        for q in prompt.questions
    ]
