// Internal types of libclef_head: the head's weights, the loaded head, one decision's inputs.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "file_io.h"
#include "ggml-backend.h"
#include "ggml.h"

namespace clef {

// A message for the caller (bad file, bad request): reported through err, never aborts.
struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// JointSchemaHead's constructor arguments, and its LayerNorms' epsilon: from the file, through Python's
// reading of it (clef_gguf/llama/native_head.py: the widths come from tensor shapes, the counts from keys).
struct Config {
    int64_t hidden_size, width, routing_layers, layers, heads, feedforward;
    float norm_eps;
};

struct Norm {  // torch.nn.LayerNorm
    ggml_tensor *weight, *bias;
};
struct Linear {  // torch.nn.Linear; bias may be null
    ggml_tensor *weight, *bias;
};
struct Attention {  // torch.nn.MultiheadAttention, its packed in_proj stored as q, k and v (llama.cpp's layout)
    Linear q, k, v, out;
    // Attentions over the prompt's memory only: the key weight, transposed per head
    // ([head_dim, width, heads], F32), derived at load for the folded form (head_graph.cpp).
    ggml_tensor * key_t = nullptr;
};
struct EvidenceLayer {
    Norm query_norm, memory_norm, feedforward_norm;
    Attention attention;
    Linear up, down;
};
struct DecoderLayer {  // torch.nn.TransformerDecoderLayer(norm_first=True, activation="gelu")
    Attention self_attn, cross_attn;
    Linear up, down;
    Norm norm1, norm2, norm3;
};

struct Weights {
    Norm hidden_norm, option_summary_norm, field_norm, option_norm;
    Linear memory, question, option_question, global, option_context, option_lexical;
    ggml_tensor * type_embedding;
    std::vector<EvidenceLayer> evidence;
    std::vector<DecoderLayer> layers;
    Linear scorer_up, scorer_down;
    // decision.scales, read once: the values the reference uses at inference (exp(min(s, log 100)), sigmoid(gate)).
    float prior_scale, joint_scale, gate;
};

// Where the output-embedding table (output.weight, or token_embd.weight when tied)
// lies in the file: the lexical prior reads the rows it needs, in the stored type.
struct Lexicon {
    ggml_type type;
    int64_t n_embd, n_vocab;
    size_t row_size;
    uint64_t offset;  // absolute, in the file
    int file = 0;     // which of the files (Model::files)
};

struct Model {
    Config config;
    Weights weights;
    Lexicon lexicon;
    // The files the manifest's rows lie in: the model's own, then (an adapter's head) the adapter file whose
    // tensors replace some of the model's.
    std::vector<Source> files;
    ggml_context * ctx = nullptr;  // tensor metadata of the weights
    ggml_backend_buffer_t buffer = nullptr;
    bool on_cpu = true;  // the head's graph runs on the CPU backend (no GPU)
    // The device rounds an F32 product's inputs to F16 (Vulkan's matrix tiles do wherever the device has F16,
    // whatever the precision asked for): every product is then split in F16-exact parts (head_graph.cpp).
    bool split_products = false;
};

// One tensor libclef_head reads, by role: the reference module and tensor it stands for
// ("layers.0.self_attn.q.weight"), plus "scales" and "lexicon" (the output-embedding table). Python
// builds the manifest from the format's table (clef_gguf/format/contract.py head_manifest) and checks
// it against the file: names, shapes and types are its business, not this library's.
struct ManifestRow {
    ggml_type type;
    int64_t ne0, ne1;
    uint64_t offset;  // absolute, in the file
    int file = 0;     // which of the paths clef_head_load was given
};
using Manifest = std::map<std::string, ManifestRow>;

// Load the head's tensors into a buffer of `buft`; throws Error.
// paths[i], or blocks[i] where it is not null (blocks: null, or one entry a path): the files the manifest's rows lie in.
void load_model(Model & model, const std::vector<std::string> & paths, const void * const * blocks, const uint64_t * block_sizes,
                const Manifest & manifest, ggml_backend_buffer_type_t buft);
void free_model(Model & model);
std::vector<uint8_t> read_lexicon_rows(const Model & model, const std::vector<int32_t> & ids);

// One decision, validated: spans lie in [0, n_tokens) and are not empty.
struct Decision {
    const float * hidden;
    int64_t n_tokens;
    std::vector<int32_t> tokens;
    std::vector<int32_t> type_ids;       // per question
    std::vector<int32_t> question_of;    // per option: its question
    std::vector<int32_t> span_starts;    // options first, then questions
    std::vector<int32_t> span_lengths;
    int64_t n_questions() const { return (int64_t) type_ids.size(); }
    int64_t n_options() const { return (int64_t) question_of.size(); }
};

// A graph's inputs: created while building, filled once the scheduler allocated them.
struct Input {
    ggml_tensor * tensor;
    std::vector<uint8_t> bytes;
};

struct Graph {
    ggml_cgraph * graph;
    ggml_tensor * logits;      // [n_options]
    ggml_tensor * hidden;      // [hidden_size, n_tokens padded (head_graph.cpp's MEMORY_PAD)]: Decision::hidden, then zeros
    std::vector<Input> inputs; // everything else
};

// Build the head's graph for one decision in `ctx` (no_alloc).
Graph build_graph(ggml_context * ctx, const Model & model, const Decision & decision);
// Nodes a decision's graph may need (for ggml_new_graph_custom and the context size).
size_t graph_size(const Model & model, const Decision & decision);

}  // namespace clef
