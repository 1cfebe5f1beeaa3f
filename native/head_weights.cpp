// Reading the head from a Clef GGUF, as the manifest Python hands over says (each role's type, shape and
// offset in the file): its tensors go into one backend buffer in their stored types; the output-embedding
// table stays in the file (only the rows a decision needs are read, see read_lexicon_rows).
#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include "file_io.h"
#include "ggml-alloc.h"
#include "head.h"

namespace clef {
namespace {

// The head's tensors by role, as the manifest describes them: each becomes a tensor of the row's type and
// shape; the rows were checked against the file by Python (clef_gguf/llama/native_head.py).
class TensorTable {
  public:
    TensorTable(ggml_context * ctx, const Manifest & manifest) : ctx_(ctx), manifest_(manifest) {}

    const ManifestRow & row(const std::string & role) const {
        auto it = manifest_.find(role);
        if (it == manifest_.end()) throw Error("the head manifest has no " + role);
        return it->second;
    }

    ggml_tensor * get(const std::string & role) {
        const ManifestRow & r = row(role);
        ggml_tensor * t = ggml_new_tensor_2d(ctx_, r.type, r.ne0, r.ne1);
        ggml_set_name(t, role.c_str());
        sources_[t] = r;
        return t;
    }

    Norm norm(const std::string & module) { return {get(module + ".weight"), get(module + ".bias")}; }

    // The projections into the head's width have no bias: the manifest lists none.
    Linear linear(const std::string & module) {
        return {get(module + ".weight"), manifest_.count(module + ".bias") ? get(module + ".bias") : nullptr};
    }

    Attention attention(const std::string & module) {
        return {linear(module + ".q"), linear(module + ".k"), linear(module + ".v"), linear(module + ".out")};
    }

    // An attention over the memory also gets its key weight transposed per head (see Attention::key_t).
    Attention memory_attention(const std::string & module, int64_t heads) {
        Attention a = attention(module);
        const int64_t width = a.k.weight->ne[0];
        a.key_t = ggml_new_tensor_3d(ctx_, GGML_TYPE_F32, width / heads, width, heads);
        ggml_set_name(a.key_t, (module + ".key_t").c_str());
        derived_[a.key_t] = sources_.at(a.k.weight);
        return a;
    }

    const std::map<ggml_tensor *, ManifestRow> & sources() const { return sources_; }
    const std::map<ggml_tensor *, ManifestRow> & derived() const { return derived_; }

  private:
    ggml_context * ctx_;
    const Manifest & manifest_;
    std::map<ggml_tensor *, ManifestRow> sources_;  // our tensor -> where its bytes are
    std::map<ggml_tensor *, ManifestRow> derived_;  // key_t -> the key weight it comes from
};

Weights head_weights(TensorTable & t, const Config & c) {
    Weights out{};
    out.hidden_norm = t.norm("hidden_norm");
    out.memory = t.linear("memory_projection");
    out.question = t.linear("question_projection");
    out.option_question = t.linear("option_question_projection");
    out.global = t.linear("global_projection");
    out.option_context = t.linear("option_context_projection");
    out.option_lexical = t.linear("option_lexical_projection");
    out.type_embedding = t.get("type_embedding.weight");
    for (int64_t i = 0; i < c.routing_layers; i++) {
        std::string p = "evidence_layers." + std::to_string(i);
        out.evidence.push_back({t.norm(p + ".query_norm"), t.norm(p + ".memory_norm"), t.norm(p + ".feedforward_norm"),
                                t.memory_attention(p + ".attention", c.heads), t.linear(p + ".feedforward.0"),
                                t.linear(p + ".feedforward.3")});
    }
    out.option_summary_norm = t.norm("option_summary_norm");
    for (int64_t i = 0; i < c.layers; i++) {
        std::string p = "layers." + std::to_string(i);
        out.layers.push_back({t.attention(p + ".self_attn"), t.memory_attention(p + ".multihead_attn", c.heads),
                              t.linear(p + ".linear1"), t.linear(p + ".linear2"), t.norm(p + ".norm1"), t.norm(p + ".norm2"),
                              t.norm(p + ".norm3")});
    }
    out.field_norm = t.norm("field_norm");
    out.option_norm = t.norm("option_norm");
    out.scorer_up = t.linear("residual_scorer.0");
    out.scorer_down = t.linear("residual_scorer.3");
    return out;
}

// decision.scales: [prior, joint, gate], F32.
void read_scales(const std::vector<Source> & files, const ManifestRow & scales, Weights & w) {
    float values[3];
    read_at(files.at(scales.file), values, sizeof values, scales.offset);
    w.prior_scale = values[0];
    w.joint_scale = values[1];
    w.gate = values[2];
}

std::vector<uint8_t> tensor_bytes(const std::vector<Source> & files, const ManifestRow & row) {
    std::vector<uint8_t> bytes(ggml_row_size(row.type, row.ne0) * (size_t) row.ne1);
    read_at(files.at(row.file), bytes.data(), bytes.size(), row.offset);
    return bytes;
}

// key_t[h][c][e] = W_k[h * d + e][c]: the key weight, dequantized and transposed per head, so
// that the graph can fold the key projection into the queries.
std::vector<float> transposed_keys(const std::vector<uint8_t> & key, const ManifestRow & source, int64_t heads) {
    const int64_t w = source.ne0, d = w / heads;
    const size_t row_size = ggml_row_size(source.type, w);
    const ggml_type_traits * traits = ggml_get_type_traits(source.type);
    std::vector<float> row(w), out((size_t) (w * w));
    for (int64_t r = 0; r < w; r++) {
        const uint8_t * bytes = key.data() + (size_t) r * row_size;
        if (source.type == GGML_TYPE_F32) {
            std::memcpy(row.data(), bytes, row_size);
        } else if (traits->to_float != nullptr) {
            traits->to_float(bytes, row.data(), w);
        } else {
            throw Error(std::string("cannot read head weights of type ") + ggml_type_name(source.type));
        }
        const int64_t h = r / d, e = r % d;
        for (int64_t c = 0; c < w; c++) out[(size_t) (h * w * d + c * d + e)] = row[c];
    }
    return out;
}

// Copy each head tensor's bytes from the file into the backend buffer, and derive key_t.
void upload(const std::vector<Source> & files, const TensorTable & table, int64_t heads) {
    for (const auto & [tensor, source] : table.sources()) {
        std::vector<uint8_t> bytes = tensor_bytes(files, source);
        ggml_backend_tensor_set(tensor, bytes.data(), 0, bytes.size());
    }
    for (const auto & [key_t, source] : table.derived()) {
        std::vector<float> values = transposed_keys(tensor_bytes(files, source), source, heads);
        ggml_backend_tensor_set(key_t, values.data(), 0, values.size() * sizeof(float));
    }
}

}  // namespace

void load_model(Model & model, const std::vector<std::string> & paths, const void * const * blocks, const uint64_t * block_sizes,
                const Manifest & manifest, ggml_backend_buffer_type_t buft) {
    try {
        const Config & c = model.config;
        for (size_t i = 0; i < paths.size(); i++) {
            const void * block = blocks != nullptr ? blocks[i] : nullptr;
            model.files.push_back(block != nullptr ? Source{NO_FILE, static_cast<const uint8_t *>(block), block_sizes[i]}
                                                   : Source{open_file(paths[i])});
        }
        for (const auto & [role, row] : manifest) {
            if (row.file < 0 || (size_t) row.file >= paths.size()) throw Error("the head manifest's " + role + " is in no file given");
        }
        size_t n_tensors = manifest.size() + (size_t) (c.routing_layers + c.layers);  // and one key_t per memory attention
        ggml_init_params init = {ggml_tensor_overhead() * n_tensors, nullptr, /*no_alloc =*/true};
        model.ctx = ggml_init(init);
        TensorTable table(model.ctx, manifest);
        model.weights = head_weights(table, c);
        read_scales(model.files, table.row("scales"), model.weights);
        const ManifestRow & lexicon = table.row("lexicon");
        model.lexicon = {lexicon.type, lexicon.ne0, lexicon.ne1, ggml_row_size(lexicon.type, lexicon.ne0), lexicon.offset, lexicon.file};
        model.buffer = ggml_backend_alloc_ctx_tensors_from_buft(model.ctx, buft);
        if (model.buffer == nullptr) {
            throw Error(std::string("cannot allocate the head's weights on ") + ggml_backend_buft_name(buft));
        }
        // The scheduler runs an op where its weights are: mark the buffer as weights.
        ggml_backend_buffer_set_usage(model.buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        upload(model.files, table, c.heads);
        // Only the lexicon is read after load: every other file is closed (a block is its caller's again).
        for (size_t i = 0; i < model.files.size(); i++) {
            if ((int) i == model.lexicon.file) continue;
            close_file(model.files[i].file);
            model.files[i] = Source{};
        }
    } catch (...) {
        free_model(model);
        throw;
    }
}

void free_model(Model & model) {
    if (model.buffer) ggml_backend_buffer_free(model.buffer);
    if (model.ctx) ggml_free(model.ctx);
    for (const Source & source : model.files) close_file(source.file);
    model.buffer = nullptr;
    model.ctx = nullptr;
    model.files.clear();
}

std::vector<uint8_t> read_lexicon_rows(const Model & model, const std::vector<int32_t> & ids) {
    const Lexicon & lex = model.lexicon;
    std::vector<uint8_t> rows(ids.size() * lex.row_size);
    for (size_t i = 0; i < ids.size(); i++) {
        read_at(model.files.at(lex.file), rows.data() + i * lex.row_size, lex.row_size, lex.offset + (uint64_t) ids[i] * lex.row_size);
    }
    return rows;
}

}  // namespace clef
