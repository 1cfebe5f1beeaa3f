// Reading the head from a Clef GGUF with gguf.h: its tensors (llama.cpp's names, looked up
// through the table Python hands over) go into one backend buffer in their stored types; the
// output-embedding table stays in the file (only the rows a decision needs are read, see
// read_lexicon_rows).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include "ggml-alloc.h"
#include "gguf.h"
#include "head.h"

namespace clef {
namespace {

void read_at(int fd, void * dst, size_t size, uint64_t offset) {
    auto * out = static_cast<uint8_t *>(dst);
    while (size > 0) {
        ssize_t n = pread(fd, out, size, (off_t) offset);
        if (n <= 0) {
            throw Error(std::string("cannot read the model file: ") + (n < 0 ? std::strerror(errno) : "unexpected end of file"));
        }
        out += n;
        size -= (size_t) n;
        offset += (uint64_t) n;
    }
}

// The head's tensors by reference name, checked against the shapes the graph assumes.
class TensorTable {
  public:
    TensorTable(ggml_context * meta, ggml_context * ctx, const Format & format) : meta_(meta), ctx_(ctx), format_(format) {}

    // The GGUF name of a reference module, and of one of its tensors ("weight", "bias").
    const std::string & module(const std::string & reference) const {
        auto it = format_.names.find(reference);
        if (it == format_.names.end()) throw Error("the format table has no head module " + reference);
        return it->second;
    }
    std::string gguf_name(const std::string & reference, const char * suffix) const { return module(reference) + "." + suffix; }

    // f32_only: biases and norms, which llama.cpp's converter and quantizer keep in F32.
    ggml_tensor * get(const std::string & module, const char * suffix, int64_t ne0, int64_t ne1 = 1, bool f32_only = false) {
        std::string full = gguf_name(module, suffix);
        ggml_tensor * source = ggml_get_tensor(meta_, full.c_str());
        if (source == nullptr) {
            throw Error("the head tensor " + full + " is missing");
        }
        if (source->ne[0] != ne0 || source->ne[1] != ne1 || source->ne[2] != 1 || source->ne[3] != 1) {
            throw Error("the head tensor " + full + " has shape [" + std::to_string(source->ne[0]) + ", " +
                        std::to_string(source->ne[1]) + "], the head config implies [" + std::to_string(ne0) + ", " +
                        std::to_string(ne1) + "] (ggml order)");
        }
        if (f32_only && source->type != GGML_TYPE_F32) {
            throw Error("the head tensor " + full + " is " + ggml_type_name(source->type) + ", expected F32");
        }
        if (!f32_only && format_.weight_types.count(source->type) == 0) {
            throw Error("the head tensor " + full + " is " + ggml_type_name(source->type) + ", which the head does not run");
        }
        ggml_tensor * t = ggml_dup_tensor(ctx_, source);
        ggml_set_name(t, full.c_str());
        sources_[t] = source;
        return t;
    }

    Norm norm(const std::string & module, int64_t width) {
        return {get(module, "weight", width, 1, true), get(module, "bias", width, 1, true)};
    }

    Linear linear(const std::string & module, int64_t in, int64_t out, bool bias = true) {
        return {get(module, "weight", in, out), bias ? get(module, "bias", out, 1, true) : nullptr};
    }

    Attention attention(const std::string & module, int64_t width) {
        return {linear(module + ".q", width, width), linear(module + ".k", width, width), linear(module + ".v", width, width),
                linear(module + ".out", width, width)};
    }

    // An attention over the memory also gets its key weight transposed per head (see Attention::key_t).
    Attention memory_attention(const std::string & module, int64_t width, int64_t heads) {
        Attention a = attention(module, width);
        a.key_t = ggml_new_tensor_3d(ctx_, GGML_TYPE_F32, width / heads, width, heads);
        ggml_set_name(a.key_t, (gguf_name(module + ".k", "key_t")).c_str());
        derived_[a.key_t] = sources_.at(a.k.weight);
        return a;
    }

    const std::map<ggml_tensor *, ggml_tensor *> & sources() const { return sources_; }
    const std::map<ggml_tensor *, ggml_tensor *> & derived() const { return derived_; }

  private:
    ggml_context * meta_;
    ggml_context * ctx_;
    const Format & format_;
    std::map<ggml_tensor *, ggml_tensor *> sources_;  // our tensor -> its metadata in the file
    std::map<ggml_tensor *, ggml_tensor *> derived_;  // key_t -> the key weight it comes from
};

Weights head_weights(TensorTable & t, const Config & c) {
    const int64_t w = c.width, h = c.hidden_size, ff = c.feedforward;
    Weights out{};
    out.hidden_norm = t.norm("hidden_norm", h);
    out.memory = t.linear("memory_projection", h, w, false);
    out.question = t.linear("question_projection", h, w, false);
    out.option_question = t.linear("option_question_projection", h, w, false);
    out.global = t.linear("global_projection", h, w, false);
    out.option_context = t.linear("option_context_projection", h, w, false);
    out.option_lexical = t.linear("option_lexical_projection", h, w, false);
    out.type_embedding = t.get("type_embedding", "weight", w, 3);
    for (int64_t i = 0; i < c.routing_layers; i++) {
        std::string p = "evidence_layers." + std::to_string(i);
        out.evidence.push_back({t.norm(p + ".query_norm", w), t.norm(p + ".memory_norm", w), t.norm(p + ".feedforward_norm", w),
                                t.memory_attention(p + ".attention", w, c.heads), t.linear(p + ".feedforward.0", w, ff),
                                t.linear(p + ".feedforward.3", ff, w)});
    }
    out.option_summary_norm = t.norm("option_summary_norm", w);
    for (int64_t i = 0; i < c.layers; i++) {
        std::string p = "layers." + std::to_string(i);
        out.layers.push_back({t.attention(p + ".self_attn", w), t.memory_attention(p + ".multihead_attn", w, c.heads),
                              t.linear(p + ".linear1", w, ff), t.linear(p + ".linear2", ff, w), t.norm(p + ".norm1", w),
                              t.norm(p + ".norm2", w), t.norm(p + ".norm3", w)});
    }
    out.field_norm = t.norm("field_norm", w);
    out.option_norm = t.norm("option_norm", w);
    out.scorer_up = t.linear("residual_scorer.0", 4 * w, w);
    out.scorer_down = t.linear("residual_scorer.3", w, 1);
    return out;
}

// decision.scales: [prior, joint, gate], F32.
void read_scales(int fd, const gguf_context * gguf, ggml_context * meta, const std::string & name, Weights & w) {
    ggml_tensor * t = ggml_get_tensor(meta, name.c_str());
    if (t == nullptr || t->type != GGML_TYPE_F32 || ggml_nelements(t) != 3) {
        throw Error("the head tensor " + name + " is missing or not 3 F32 values");
    }
    float values[3];
    read_at(fd, values, sizeof values, gguf_get_data_offset(gguf) + gguf_get_tensor_offset(gguf, gguf_find_tensor(gguf, name.c_str())));
    w.prior_scale = values[0];
    w.joint_scale = values[1];
    w.gate = values[2];
}

Lexicon lexicon(const gguf_context * gguf, ggml_context * meta, int64_t hidden_size) {
    const char * name = ggml_get_tensor(meta, "output.weight") ? "output.weight" : "token_embd.weight";
    ggml_tensor * t = ggml_get_tensor(meta, name);
    if (t == nullptr || t->ne[0] != hidden_size) {
        throw Error(std::string("the output embedding ") + name + " is missing or not " + std::to_string(hidden_size) + " wide");
    }
    uint64_t offset = gguf_get_data_offset(gguf) + gguf_get_tensor_offset(gguf, gguf_find_tensor(gguf, name));
    return {t->type, t->ne[0], t->ne[1], ggml_row_size(t->type, t->ne[0]), offset};
}

std::vector<uint8_t> tensor_bytes(int fd, const gguf_context * gguf, const ggml_tensor * source) {
    std::vector<uint8_t> bytes(ggml_nbytes(source));
    read_at(fd, bytes.data(), bytes.size(), gguf_get_data_offset(gguf) + gguf_get_tensor_offset(gguf, gguf_find_tensor(gguf, source->name)));
    return bytes;
}

// key_t[h][c][e] = W_k[h * d + e][c]: the key weight, dequantized and transposed per head, so
// that the graph can fold the key projection into the queries.
std::vector<float> transposed_keys(const std::vector<uint8_t> & key, const ggml_tensor * source, int64_t heads) {
    const int64_t w = source->ne[0], d = w / heads;
    const size_t row_size = ggml_row_size(source->type, w);
    const ggml_type_traits * traits = ggml_get_type_traits(source->type);
    std::vector<float> row(w), out((size_t) (w * w));
    for (int64_t r = 0; r < w; r++) {
        const uint8_t * bytes = key.data() + (size_t) r * row_size;
        if (source->type == GGML_TYPE_F32) {
            std::memcpy(row.data(), bytes, row_size);
        } else if (traits->to_float != nullptr) {
            traits->to_float(bytes, row.data(), w);
        } else {
            throw Error(std::string("cannot read head weights of type ") + ggml_type_name(source->type));
        }
        const int64_t h = r / d, e = r % d;
        for (int64_t c = 0; c < w; c++) out[(size_t) (h * w * d + c * d + e)] = row[c];
    }
    return out;
}

// Copy each head tensor's bytes from the file into the backend buffer, and derive key_t.
void upload(int fd, const gguf_context * gguf, const TensorTable & table, int64_t heads) {
    for (const auto & [tensor, source] : table.sources()) {
        std::vector<uint8_t> bytes = tensor_bytes(fd, gguf, source);
        ggml_backend_tensor_set(tensor, bytes.data(), 0, bytes.size());
    }
    for (const auto & [key_t, source] : table.derived()) {
        std::vector<float> values = transposed_keys(tensor_bytes(fd, gguf, source), source, heads);
        ggml_backend_tensor_set(key_t, values.data(), 0, values.size() * sizeof(float));
    }
}

}  // namespace

void load_model(Model & model, const char * path, const Format & format, ggml_backend_buffer_type_t buft) {
    ggml_context * meta = nullptr;
    gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/&meta};
    gguf_context * gguf = gguf_init_from_file(path, params);
    if (gguf == nullptr) {
        throw Error(std::string("gguf could not read ") + path);
    }
    try {
        const Config & c = model.config;
        if (c.heads <= 0 || c.width % c.heads != 0) {
            throw Error("the head's width is not a multiple of its head count");
        }
        model.fd = open(path, O_RDONLY | O_CLOEXEC);
        if (model.fd < 0) {
            throw Error(std::string("cannot open ") + path + ": " + std::strerror(errno));
        }
        size_t n_tensors = 20 + 19 * c.routing_layers + 27 * c.layers;  // the file's, and one key_t per memory attention
        ggml_init_params init = {ggml_tensor_overhead() * n_tensors, nullptr, /*no_alloc =*/true};
        model.ctx = ggml_init(init);
        TensorTable table(meta, model.ctx, format);
        model.weights = head_weights(table, c);
        read_scales(model.fd, gguf, meta, table.module("scales"), model.weights);
        model.lexicon = lexicon(gguf, meta, c.hidden_size);
        model.buffer = ggml_backend_alloc_ctx_tensors_from_buft(model.ctx, buft);
        if (model.buffer == nullptr) {
            throw Error(std::string("cannot allocate the head's weights on ") + ggml_backend_buft_name(buft));
        }
        // The scheduler runs an op where its weights are: mark the buffer as weights.
        ggml_backend_buffer_set_usage(model.buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        upload(model.fd, gguf, table, c.heads);
    } catch (...) {
        gguf_free(gguf);
        ggml_free(meta);
        free_model(model);
        throw;
    }
    gguf_free(gguf);
    ggml_free(meta);
}

void free_model(Model & model) {
    if (model.buffer) ggml_backend_buffer_free(model.buffer);
    if (model.ctx) ggml_free(model.ctx);
    if (model.fd >= 0) close(model.fd);
    model.buffer = nullptr;
    model.ctx = nullptr;
    model.fd = -1;
}

std::vector<uint8_t> read_lexicon_rows(const Model & model, const std::vector<int32_t> & ids) {
    const Lexicon & lex = model.lexicon;
    std::vector<uint8_t> rows(ids.size() * lex.row_size);
    for (size_t i = 0; i < ids.size(); i++) {
        read_at(model.fd, rows.data() + i * lex.row_size, lex.row_size, lex.offset + (uint64_t) ids[i] * lex.row_size);
    }
    return rows;
}

}  // namespace clef
