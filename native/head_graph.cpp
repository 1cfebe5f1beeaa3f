// The joint schema head as one ggml graph, op for op as tests/numpy_head.py (the
// numpy reference) and Cloudflare's JointSchemaHead compute it.
//
// Layout: a numpy (rows, cols) matrix is a ggml tensor [cols, rows]: hidden states
// are [hidden_size, n_tokens], options [width, n_options], and so on.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "head.h"

namespace clef {
namespace {

constexpr float L2_EPS = 1e-12f;      // torch functional.normalize default
constexpr float COSINE_EPS = 1e-8f;   // torch cosine_similarity default
// Span means multiply gathered rows by an averaging matrix of tokens x spans. Split
// into chunks of consecutive spans so that no matrix exceeds this many entries:
// memory stays linear in the prompt whatever the number of options.
constexpr int64_t MEAN_CHUNK_ENTRIES = 1 << 22;
// The memory is padded with zeros to a multiple of this many tokens, the padding masked out of every
// softmax over it: the products over the tokens then take ggml's tiled sgemm on the CPU (llamafile's
// tinyBLAS wants the inner dimension a multiple of 16, the rows a multiple of 4) instead of one dot
// product a cell (docs/benchmarks.md, "Measurements behind the code").
constexpr int64_t MEMORY_PAD = 16;

int64_t padded_tokens(int64_t n_tokens) { return (n_tokens + MEMORY_PAD - 1) / MEMORY_PAD * MEMORY_PAD; }

// Consecutive spans [first, last) whose averaging matrix (tokens x spans) fits MEAN_CHUNK_ENTRIES.
std::vector<std::pair<size_t, size_t>> mean_chunks(const std::vector<int32_t> & lengths) {
    std::vector<std::pair<size_t, size_t>> chunks;
    for (size_t first = 0; first < lengths.size();) {
        size_t last = first;
        int64_t tokens = 0;
        while (last < lengths.size() && (last == first || (tokens + lengths[last]) * (int64_t) (last - first + 1) <= MEAN_CHUNK_ENTRIES)) {
            tokens += lengths[last++];
        }
        chunks.emplace_back(first, last);
        first = last;
    }
    return chunks;
}

// dst = a made contiguous, for an F32 view `a` whose rows are strided (a transpose, or a permutation that
// moves dim 0), which ggml's CPU copy (ggml_cont) does with one memcpy call per element. The rows of dst
// are split among the threads and written BLOCK at a time, so that each cache line read serves several.
void copy_strided(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void *) {
    constexpr int64_t BLOCK = 16;
    const int64_t cols = a->ne[0], rows = ggml_nrows(a), per_thread = (rows + nth - 1) / nth;
    const int64_t first = ith * per_thread, last = std::min(rows, first + per_thread);
    float * out = (float *) dst->data;  // contiguous: row r at r * cols
    const char * starts[BLOCK];
    for (int64_t r0 = first; r0 < last; r0 += BLOCK) {
        const int64_t n = std::min(last - r0, BLOCK);
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = r0 + i, i1 = r % a->ne[1], i2 = r / a->ne[1] % a->ne[2], i3 = r / (a->ne[1] * a->ne[2]);
            starts[i] = (const char *) a->data + i1 * a->nb[1] + i2 * a->nb[2] + i3 * a->nb[3];
        }
        for (int64_t c = 0; c < cols; c++) {
            for (int64_t i = 0; i < n; i++) out[(r0 + i) * cols + c] = *(const float *) (starts[i] + c * a->nb[0]);
        }
    }
}

struct Memory {
    ggml_tensor * x;     // [w, n]: n the padded length
    ggml_tensor * xt;    // [n, w]
    ggml_tensor * mask;  // [n, 1, 1]: 0, and -inf on the padding; null without padding
};

class Builder {
  public:
    Builder(ggml_context * ctx, const Model & model, Graph & graph)
        : ctx_(ctx), c_(model.config), g_(graph), on_cpu_(model.on_cpu), split_products_(model.split_products) {}

    // A graph input: its bytes are copied in after the scheduler allocated it.
    ggml_tensor * input(ggml_type type, int64_t ne0, int64_t ne1, std::vector<uint8_t> bytes) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx_, type, ne0, ne1);
        ggml_set_input(t);
        g_.inputs.push_back({t, std::move(bytes)});
        return t;
    }

    template <typename T> ggml_tensor * input(ggml_type type, int64_t ne0, int64_t ne1, const std::vector<T> & values) {
        std::vector<uint8_t> bytes(values.size() * sizeof(T));
        std::memcpy(bytes.data(), values.data(), bytes.size());
        return input(type, ne0, ne1, std::move(bytes));
    }

    ggml_tensor * ids(const std::vector<int32_t> & values) { return input(GGML_TYPE_I32, (int64_t) values.size(), 1, values); }

    ggml_tensor * standardize(ggml_tensor * x) { return ggml_norm(ctx_, x, c_.norm_eps); }  // LayerNorm without its affine

    ggml_tensor * layer_norm(ggml_tensor * x, const Norm & n) { return ggml_add(ctx_, ggml_mul(ctx_, standardize(x), n.weight), n.bias); }

    // Every product accumulates in F32: a device may otherwise sum F16 or quantized weights in F16 (Vulkan
    // does), and the head's logits are scaled by up to 100 (decision.scales), so that F16's rounding shows
    // in the probabilities. The CPU always accumulates in F32.
    ggml_tensor * product(ggml_tensor * a, ggml_tensor * b) {
        ggml_tensor * t = ggml_mul_mat(ctx_, a, b);
        ggml_mul_mat_set_prec(t, GGML_PREC_F32);
        return t;
    }

    // On a device that rounds a product's F32 inputs to F16 (Model::split_products), x = hi + lo with hi
    // F16-exact, and a b = ah bh + al bh + ah bl: the tiles then hold hi exactly, and lo's own rounding costs
    // 2^-11 of lo, about 2^-22 of x; the dropped al bl is as small. Three products instead of one, on the
    // device, where the head is a small part of a decision. On lavapipe the head's logits went from 2.3e-3 off
    // the numpy reference to within its 1e-4 (docs/devices.md).
    // F32 weights and activations only: an F16 or quantized a's product rounds b to F16 or quantizes it on
    // the CPU too (ggml's vec_dot_type): that is the type's own precision, the same on every backend.
    ggml_tensor * mul_mat(ggml_tensor * a, ggml_tensor * b) {
        if (!split_products_ || a->type != GGML_TYPE_F32) return product(a, b);
        auto [ah, al] = split(a);
        auto [bh, bl] = split(b);
        return ggml_add(ctx_, ggml_add(ctx_, product(ah, bh), product(al, bh)), product(ah, bl));
    }

    std::pair<ggml_tensor *, ggml_tensor *> split(ggml_tensor * x) {
        ggml_tensor * hi = ggml_cast(ctx_, ggml_cast(ctx_, x, GGML_TYPE_F16), GGML_TYPE_F32);
        return {hi, ggml_sub(ctx_, ggml_is_contiguous(x) ? x : contiguous(x), hi)};
    }

    ggml_tensor * linear(ggml_tensor * x, const Linear & l) {
        ggml_tensor * y = mul_mat(l.weight, x);
        return l.bias ? ggml_add(ctx_, y, l.bias) : y;
    }

    // A view made contiguous: ggml_cont, but on the CPU copy_strided for F32 views whose rows are strided
    // (ggml_cont copies those element by element: docs/benchmarks.md, "Measurements behind the code").
    ggml_tensor * contiguous(ggml_tensor * view) {
        if (!on_cpu_ || view->type != GGML_TYPE_F32 || view->nb[0] == sizeof(float)) return ggml_cont(ctx_, view);
        return ggml_map_custom1(ctx_, view, copy_strided, GGML_N_TASKS_MAX, nullptr);
    }

    ggml_tensor * transpose(ggml_tensor * x) { return contiguous(ggml_transpose(ctx_, x)); }  // [a, b] -> [b, a]

    ggml_tensor * gelu(ggml_tensor * x) { return ggml_gelu_erf(ctx_, x); }  // nn.GELU(): the exact, erf form


    // [w, L] -> [d, L, H]: one matrix per head.
    ggml_tensor * split_heads(ggml_tensor * x) {
        const int64_t d = c_.width / c_.heads;
        return ggml_cont(ctx_, ggml_permute(ctx_, ggml_reshape_3d(ctx_, x, d, c_.heads, x->ne[1]), 0, 2, 1, 3));
    }

    // [d, L, H] -> [w, L], then out_proj.
    ggml_tensor * merge_heads(ggml_tensor * x, const Attention & a) {
        ggml_tensor * merged = ggml_cont(ctx_, ggml_permute(ctx_, x, 0, 2, 1, 3));  // [d, H, L]
        return linear(ggml_reshape_2d(ctx_, merged, c_.width, x->ne[1]), a.out);
    }

    // Softmax over dim 0 of scores [Lk, ...], the memory's padding masked: one mask row serves every row.
    ggml_tensor * softmax(ggml_tensor * scores, ggml_tensor * mask, float scale) {
        if (mask == nullptr) return ggml_soft_max_ext(ctx_, scores, nullptr, scale, 0.0f);
        ggml_tensor * rows = ggml_reshape_3d(ctx_, scores, scores->ne[0], 1, ggml_nrows(scores));
        return ggml_reshape(ctx_, ggml_soft_max_ext(ctx_, rows, mask, scale, 0.0f), scores);
    }

    // nn.MultiheadAttention(queries, memory, memory) without an attention mask: queries [w, Lq], memory [w, Lk];
    // `mask` hides the memory's padding.
    ggml_tensor * attention(ggml_tensor * queries, ggml_tensor * memory, const Attention & a, ggml_tensor * mask = nullptr) {
        const int64_t d = c_.width / c_.heads, lk = memory->ne[1];
        ggml_tensor * q = split_heads(linear(queries, a.q));  // [d, Lq, H]
        ggml_tensor * k = split_heads(linear(memory, a.k));  // [d, Lk, H]
        ggml_tensor * v = contiguous(ggml_permute(ctx_, ggml_reshape_3d(ctx_, linear(memory, a.v), d, c_.heads, lk), 1, 2, 0, 3));  // [Lk, d, H]
        ggml_tensor * scores = softmax(mul_mat(k, q), mask, 1.0f / std::sqrt((float) d));  // [Lk, Lq, H]
        return merge_heads(mul_mat(v, scores), a);
    }

    // The same attention over the prompt's memory m = gamma * x + beta (x alone when norm is null),
    // with the projections moved to the few queries' side:
    //   scores_h = (W_k,h^T q_h)^T m: the key bias, and beta, add one constant per query, which the softmax ignores;
    //   out_h = W_v,h (m p_h) + b_v,h: the weights p_h sum to 1.
    // The memory is then read by two products of n x w x (Lq * heads), instead of being projected to
    // keys and values (n x w x 2w): worth it while Lq * heads < w + Lq (see folds()).
    ggml_tensor * memory_attention(ggml_tensor * queries, const Memory & m, const Norm * norm, const Attention & a) {
        const int64_t w = c_.width, heads = c_.heads, d = w / heads, lq = queries->ne[1];
        if (!folds(lq)) {
            ggml_tensor * memory = norm ? ggml_add(ctx_, ggml_mul(ctx_, m.x, norm->weight), norm->bias) : m.x;
            return attention(queries, memory, a, m.mask);
        }
        ggml_tensor * folded = mul_mat(a.key_t, split_heads(linear(queries, a.q)));  // [w, Lq, H]
        if (norm) folded = ggml_mul(ctx_, folded, norm->weight);
        ggml_tensor * scores = mul_mat(m.x, ggml_reshape_2d(ctx_, folded, w, lq * heads));  // [n, Lq * H]
        scores = softmax(scores, m.mask, 1.0f / std::sqrt((float) d));
        ggml_tensor * mixed = mul_mat(m.xt, scores);  // [w, Lq * H]: x p
        if (norm) mixed = ggml_add(ctx_, ggml_mul(ctx_, mixed, norm->weight), norm->bias);
        const size_t row = a.v.weight->nb[1];
        ggml_tensor * values = ggml_view_3d(ctx_, a.v.weight, w, d, heads, row, d * row, 0);  // W_v per head
        ggml_tensor * bias = ggml_view_3d(ctx_, a.v.bias, d, 1, heads, d * sizeof(float), d * sizeof(float), 0);
        ggml_tensor * out = ggml_add(ctx_, mul_mat(values, ggml_reshape_3d(ctx_, mixed, w, lq, heads)), bias);  // [d, Lq, H]
        return merge_heads(out, a);
    }

    bool folds(int64_t n_queries) const { return n_queries * c_.heads < c_.width + n_queries; }

    ggml_tensor * evidence_layer(ggml_tensor * queries, const Memory & standardized, const EvidenceLayer & l) {
        ggml_tensor * routed = memory_attention(layer_norm(queries, l.query_norm), standardized, &l.memory_norm, l.attention);
        queries = ggml_add(ctx_, queries, routed);
        ggml_tensor * hidden = gelu(linear(layer_norm(queries, l.feedforward_norm), l.up));
        return ggml_add(ctx_, queries, linear(hidden, l.down));
    }

    ggml_tensor * decoder_layer(ggml_tensor * x, const Memory & memory, const DecoderLayer & l) {
        ggml_tensor * h = layer_norm(x, l.norm1);
        x = ggml_add(ctx_, x, attention(h, h, l.self_attn));
        x = ggml_add(ctx_, x, memory_attention(layer_norm(x, l.norm2), memory, nullptr, l.cross_attn));
        ggml_tensor * hidden = gelu(linear(layer_norm(x, l.norm3), l.up));
        return ggml_add(ctx_, x, linear(hidden, l.down));
    }

    // A memory [w, n], its transpose when an attention over it folds (else unused, and not computed), and
    // the mask of its padding.
    Memory memory(ggml_tensor * x, int64_t n_queries, ggml_tensor * mask) {
        return {x, folds(n_queries) ? transpose(x) : nullptr, mask};
    }

    // Means of consecutive spans of `rows` [dim, sum(lengths)]: [dim, n_spans].
    ggml_tensor * span_means(ggml_tensor * rows, const std::vector<int32_t> & lengths) {
        std::vector<ggml_tensor *> parts;
        int64_t token = 0;
        for (const auto & [first, last] : mean_chunks(lengths)) {
            int64_t tokens = 0;
            for (size_t s = first; s < last; s++) tokens += lengths[s];
            parts.push_back(chunk_means(rows, token, tokens, lengths, first, last));
            token += tokens;
        }
        return concat(parts, 0, parts.size());
    }

    ggml_context * ctx() const { return ctx_; }

  private:
    ggml_tensor * chunk_means(ggml_tensor * rows, int64_t token, int64_t tokens, const std::vector<int32_t> & lengths, size_t first, size_t last) {
        const int64_t n_spans = (int64_t) (last - first);
        std::vector<float> average((size_t) (tokens * n_spans), 0.0f);  // [tokens, n_spans]: 1/len on each span's tokens
        int64_t at = 0;
        for (int64_t s = 0; s < n_spans; s++) {
            const int32_t len = lengths[first + s];
            std::fill_n(average.begin() + s * tokens + at, len, 1.0f / (float) len);
            at += len;
        }
        ggml_tensor * part = ggml_view_2d(ctx_, rows, rows->ne[0], tokens, rows->nb[1], token * rows->nb[1]);
        ggml_tensor * transposed = transpose(part);  // [tokens, dim]
        return mul_mat(transposed, input(GGML_TYPE_F32, tokens, n_spans, average));
    }

    ggml_tensor * concat(const std::vector<ggml_tensor *> & parts, size_t lo, size_t hi) {  // a balanced tree: O(n log n) copies
        if (hi - lo == 1) return parts[lo];
        size_t mid = (lo + hi) / 2;
        return ggml_concat(ctx_, concat(parts, lo, mid), concat(parts, mid, hi), 1);
    }

    ggml_context * ctx_;
    const Config & c_;
    Graph & g_;
    bool on_cpu_;
    bool split_products_;
};

// Gather the span tokens: options' spans first, then questions', each span's tokens in order.
std::vector<int32_t> span_tokens(const Decision & d, size_t first, size_t last) {
    std::vector<int32_t> out;
    for (size_t s = first; s < last; s++) {
        for (int32_t t = 0; t < d.span_lengths[s]; t++) out.push_back(d.span_starts[s] + t);
    }
    return out;
}

// The lexical prior's rows: each option token's output-embedding row, in the stored type.
ggml_tensor * lexical_rows(Builder & b, const Model & model, const Decision & d) {
    std::vector<int32_t> positions = span_tokens(d, 0, (size_t) d.n_options());
    std::vector<int32_t> unique;
    for (int32_t p : positions) unique.push_back(d.tokens[p]);
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
    std::vector<int32_t> local;
    for (int32_t p : positions) local.push_back((int32_t) (std::lower_bound(unique.begin(), unique.end(), d.tokens[p]) - unique.begin()));
    ggml_tensor * table = b.input(model.lexicon.type, model.lexicon.n_embd, (int64_t) unique.size(), read_lexicon_rows(model, unique));
    return ggml_get_rows(b.ctx(), table, b.ids(local));  // dequantized to F32 [hidden, option tokens]
}

}  // namespace

size_t graph_size(const Model & model, const Decision & decision) {
    // Layers and the logits take a few hundred nodes, each chunk of span means 8 at most.
    std::vector<int32_t> options(decision.span_lengths.begin(), decision.span_lengths.begin() + decision.n_options());
    size_t chunks = mean_chunks(decision.span_lengths).size() + mean_chunks(options).size();
    // A split product (Model::split_products) takes 11 nodes instead of 1.
    const size_t scale = model.split_products ? 6 : 1;
    return scale * ((size_t) (512 + 128 * (model.config.routing_layers + model.config.layers)) + 8 * chunks);
}

namespace {

// What the head reads off the prompt: the memory, the last token, and span means.
struct PromptViews {
    ggml_tensor * memory;     // [w, n]: n padded to MEMORY_PAD
    ggml_tensor * mask;       // [n, 1, 1]: the padding's, or null
    ggml_tensor * global;     // [h, 1]: the last token
    ggml_tensor * contexts;   // [h, options]: each option's span
    ggml_tensor * questions;  // [h, questions]: each question's instruction span
    ggml_tensor * lexical;    // [h, options]: each option's mean output-embedding row
};

std::vector<float> padding_mask(int64_t n, int64_t padded) {
    std::vector<float> mask((size_t) padded, 0.0f);
    std::fill(mask.begin() + n, mask.end(), -INFINITY);
    return mask;
}

PromptViews read_prompt(Builder & b, ggml_context * ctx, const Model & model, const Decision & d, ggml_tensor * hidden) {
    const Weights & w = model.weights;
    const int64_t n = d.n_tokens, h = model.config.hidden_size, padded = hidden->ne[1];
    ggml_tensor * hs = b.layer_norm(hidden, w.hidden_norm);
    ggml_tensor * spans = b.span_means(ggml_get_rows(ctx, hs, b.ids(span_tokens(d, 0, d.span_lengths.size()))), d.span_lengths);
    std::vector<int32_t> option_lengths(d.span_lengths.begin(), d.span_lengths.begin() + d.n_options());
    return {
        b.linear(hs, w.memory),
        padded > n ? b.input(GGML_TYPE_F32, padded, 1, padding_mask(n, padded)) : nullptr,
        ggml_view_2d(ctx, hs, h, 1, hs->nb[1], (n - 1) * hs->nb[1]),
        ggml_view_2d(ctx, spans, h, d.n_options(), spans->nb[1], 0),
        ggml_view_2d(ctx, spans, h, d.n_questions(), spans->nb[1], d.n_options() * spans->nb[1]),
        b.span_means(lexical_rows(b, model, d), option_lengths),
    };
}

// The options, routed through the evidence layers over the memory: [w, options].
ggml_tensor * route_options(Builder & b, ggml_context * ctx, const Weights & w, const PromptViews & p, ggml_tensor * question_of) {
    ggml_tensor * routed = ggml_add(ctx, b.linear(p.contexts, w.option_context), b.linear(p.lexical, w.option_lexical));
    routed = ggml_add(ctx, routed, ggml_get_rows(ctx, b.linear(p.questions, w.option_question), question_of));
    // Each evidence layer normalizes the memory with its own weights: standardize it once.
    Memory standardized = b.memory(b.standardize(p.memory), routed->ne[1], p.mask);
    for (const EvidenceLayer & layer : w.evidence) routed = b.evidence_layer(routed, standardized, layer);
    return routed;
}

// One field per question, decoded jointly over the memory: [w, questions].
ggml_tensor * decode_fields(Builder & b, ggml_context * ctx, const Model & model, const Decision & d, const PromptViews & p,
                            ggml_tensor * routed) {
    const Weights & w = model.weights;
    const int64_t n_options = d.n_options(), n_questions = d.n_questions();
    // Each question's summary: a softmax over its own options (a mask hides the others).
    ggml_tensor * base = b.linear(p.questions, w.question);
    std::vector<float> mask((size_t) (n_options * n_questions), -INFINITY);  // [options, questions]
    for (int64_t o = 0; o < n_options; o++) mask[(size_t) (d.question_of[o] * n_options + o)] = 0.0f;
    ggml_tensor * scores = b.mul_mat(routed, base);  // [options, questions]
    ggml_tensor * weights = ggml_soft_max_ext(ctx, scores, b.input(GGML_TYPE_F32, n_options, n_questions, mask),
                                              1.0f / std::sqrt((float) model.config.width), 0.0f);
    ggml_tensor * summaries = b.mul_mat(b.transpose(routed), weights);
    ggml_tensor * fields = ggml_add(ctx, base, b.layer_norm(summaries, w.option_summary_norm));
    fields = ggml_add(ctx, fields, b.linear(p.global, w.global));
    fields = ggml_add(ctx, fields, ggml_get_rows(ctx, w.type_embedding, b.ids(d.type_ids)));
    Memory memory = b.memory(p.memory, n_questions, p.mask);
    for (const DecoderLayer & layer : w.layers) fields = b.decoder_layer(fields, memory, layer);
    return b.layer_norm(fields, w.field_norm);
}

// Each option's logit: prior + gate * (joint_scale * cosine + residual): [1, options].
ggml_tensor * option_logits(Builder & b, ggml_context * ctx, const Weights & w, const PromptViews & p, ggml_tensor * routed,
                            ggml_tensor * fields, ggml_tensor * question_of) {
    // The lexical prior: cosine of each option's mean embedding with its question + the last token.
    ggml_tensor * anchors = ggml_get_rows(ctx, ggml_l2_norm(ctx, ggml_add(ctx, p.questions, p.global), L2_EPS), question_of);
    ggml_tensor * prior = ggml_sum_rows(ctx, ggml_mul(ctx, ggml_l2_norm(ctx, p.lexical, L2_EPS), anchors));
    // The joint score: cosine of option and field, plus the residual scorer on their features.
    ggml_tensor * options = b.layer_norm(routed, w.option_norm);
    ggml_tensor * field = ggml_get_rows(ctx, fields, question_of);  // [w, options]
    ggml_tensor * dot = ggml_sum_rows(ctx, ggml_mul(ctx, options, field));
    ggml_tensor * norms = ggml_mul(ctx, ggml_sqrt(ctx, ggml_sum_rows(ctx, ggml_sqr(ctx, options))),
                                   ggml_sqrt(ctx, ggml_sum_rows(ctx, ggml_sqr(ctx, field))));
    ggml_tensor * cosine = ggml_div(ctx, dot, ggml_clamp(ctx, norms, COSINE_EPS, INFINITY));
    ggml_tensor * product = ggml_mul(ctx, field, options), * distance = ggml_abs(ctx, ggml_sub(ctx, field, options));
    ggml_tensor * features = ggml_concat(ctx, ggml_concat(ctx, field, options, 0), ggml_concat(ctx, product, distance, 0), 0);
    ggml_tensor * residual = b.linear(b.gelu(b.linear(features, w.scorer_up)), w.scorer_down);
    ggml_tensor * joint = ggml_add(ctx, ggml_scale(ctx, cosine, w.joint_scale), residual);
    return ggml_add(ctx, ggml_scale(ctx, prior, w.prior_scale), ggml_scale(ctx, joint, w.gate));
}

}  // namespace

Graph build_graph(ggml_context * ctx, const Model & model, const Decision & d) {
    Graph g{};
    g.graph = ggml_new_graph_custom(ctx, graph_size(model, d), false);
    Builder b(ctx, model, g);
    g.hidden = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, model.config.hidden_size, padded_tokens(d.n_tokens));
    ggml_set_input(g.hidden);
    PromptViews prompt = read_prompt(b, ctx, model, d, g.hidden);
    ggml_tensor * question_of = b.ids(d.question_of);
    ggml_tensor * routed = route_options(b, ctx, model.weights, prompt, question_of);
    ggml_tensor * fields = decode_fields(b, ctx, model, d, prompt, routed);
    g.logits = option_logits(b, ctx, model.weights, prompt, routed, fields, question_of);
    ggml_set_output(g.logits);
    ggml_build_forward_expand(g.graph, g.logits);
    return g;
}

}  // namespace clef
