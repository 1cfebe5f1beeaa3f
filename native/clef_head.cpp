// The C API: a loaded head on its backend, and one decision at a time through the
// ggml backend scheduler (which also falls back to the CPU for any op the device lacks).
#include "clef_head.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "head.h"

struct clef_head {
    clef::Model model;
    ggml_backend_t device = nullptr;  // the GPU, or null when the head runs on the CPU
    ggml_backend_t cpu = nullptr;
    ggml_backend_sched_t sched = nullptr;
    std::string device_name;
};

namespace {

constexpr size_t SCHED_GRAPH_SIZE = 1 << 16;  // upper bound of a decision's nodes (see graph_size)

void report(char * err, size_t err_size, const char * message) {
    if (err != nullptr && err_size > 0) std::snprintf(err, err_size, "%s", message);
}

// The first GPU ggml's registry knows (the one llama.cpp offloads to first), if asked for.
ggml_backend_dev_t gpu_device() {
    for (auto type : {GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU}) {
        if (ggml_backend_dev_t dev = ggml_backend_dev_by_type(type)) return dev;
    }
    return nullptr;
}

void set_threads(ggml_backend_t cpu, int n_threads) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(cpu));
    auto set = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (set != nullptr && n_threads > 0) set(cpu, n_threads);
}

// "role<TAB>type<TAB>ne0<TAB>ne1<TAB>offset[<TAB>file]" lines (clef_gguf/llama/native_head.py manifest_text); file is
// the index of the path the row's bytes are in (0 when absent).
clef::Manifest parse_manifest(const char * text) {
    clef::Manifest manifest;
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
        std::istringstream fields(line);
        std::string role;
        int type = 0;
        clef::ManifestRow row{};
        if (!std::getline(fields, role, '\t') || !(fields >> type >> row.ne0 >> row.ne1 >> row.offset)) {
            throw clef::Error("a head manifest line is not role, type, ne0, ne1, offset: " + line);
        }
        if (!(fields >> row.file)) row.file = 0;
        row.type = (ggml_type) type;
        manifest[role] = row;
    }
    return manifest;
}

// Whether `device` rounds an F32 product's inputs to F16: one 64 x 64 product of numbers 1 + k 2^-14 (not
// F16-exact: F16 has 10 bits after the point) against its sum in double. F32 inputs leave ~1e-7 of relative
// error, F16 tiles ~1e-4; the head's logits, scaled by up to 100, need the former.
bool rounds_products(ggml_backend_t device) {
    constexpr int N = 64;
    ggml_init_params params = {ggml_tensor_overhead() * 4 + ggml_graph_overhead(), nullptr, true};
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, N, N);
    ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, N, N);
    ggml_tensor * c = ggml_mul_mat(ctx, a, b);
    ggml_mul_mat_set_prec(c, GGML_PREC_F32);
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, c);
    ggml_backend_buffer_t buffer = ggml_backend_alloc_ctx_tensors(ctx, device);
    if (buffer == nullptr) {
        ggml_free(ctx);
        throw clef::Error("cannot allocate a 48 KiB probe on " + std::string(ggml_backend_name(device)));
    }
    std::vector<float> va(N * N), vb(N * N), vc(N * N);
    for (int i = 0; i < N * N; i++) {
        va[i] = 1.0f + (float) (i % 7 + 1) / 16384.0f;
        vb[i] = 1.0f + (float) (i % 5 + 1) / 16384.0f;
    }
    ggml_backend_tensor_set(a, va.data(), 0, ggml_nbytes(a));
    ggml_backend_tensor_set(b, vb.data(), 0, ggml_nbytes(b));
    const bool computed = ggml_backend_graph_compute(device, graph) == GGML_STATUS_SUCCESS;
    if (computed) ggml_backend_tensor_get(c, vc.data(), 0, ggml_nbytes(c));
    ggml_backend_buffer_free(buffer);
    ggml_free(ctx);
    if (!computed) throw clef::Error("a probe product failed on " + std::string(ggml_backend_name(device)));
    double worst = 0.0;
    for (int j = 0; j < N; j++) {      // c[j][i] = sum_k a[i][k] b[j][k]
        for (int i = 0; i < N; i++) {
            double exact = 0.0;
            for (int k = 0; k < N; k++) exact += (double) va[i * N + k] * vb[j * N + k];
            worst = std::max(worst, std::abs(vc[j * N + i] - exact) / exact);
        }
    }
    return worst > 1e-5;
}

void init_backends(clef_head & head, const char * path, const void * const * blocks, const uint64_t * block_sizes,
                   const clef::Manifest & manifest, bool use_gpu, int n_threads) {
    head.cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (head.cpu == nullptr) throw clef::Error("ggml has no CPU backend");
    set_threads(head.cpu, n_threads);
    if (ggml_backend_dev_t dev = use_gpu ? gpu_device() : nullptr) {
        head.device = ggml_backend_dev_init(dev, nullptr);
        if (head.device == nullptr) throw clef::Error(std::string("cannot start the ggml device ") + ggml_backend_dev_name(dev));
    }
    ggml_backend_t primary = head.device ? head.device : head.cpu;
    head.device_name = ggml_backend_name(primary);
    ggml_backend_t backends[2] = {primary, head.cpu};
    int n_backends = head.device ? 2 : 1;  // the scheduler wants the CPU last
    head.sched = ggml_backend_sched_new(backends, nullptr, n_backends, SCHED_GRAPH_SIZE, false, false);
    head.model.on_cpu = head.device == nullptr;
    // CLEF_HEAD_SPLIT_PRODUCTS=1 or 0 overrides the probe: the tests run split products on the CPU too.
    const char * split = std::getenv("CLEF_HEAD_SPLIT_PRODUCTS");
    if (split != nullptr && (std::strcmp(split, "0") == 0 || std::strcmp(split, "1") == 0)) {
        head.model.split_products = split[0] == '1';
    } else {
        head.model.split_products = head.device != nullptr && rounds_products(head.device);
    }
    std::vector<std::string> paths;  // `path` holds one path a line: the model's, then an adapter's
    std::istringstream lines(path);
    for (std::string line; std::getline(lines, line);) paths.push_back(line);
    clef::load_model(head.model, paths, blocks, block_sizes, manifest, ggml_backend_get_default_buffer_type(primary));
}

void free_head(clef_head * head) {
    if (head == nullptr) return;
    clef::free_model(head->model);
    if (head->sched) ggml_backend_sched_free(head->sched);
    if (head->device) ggml_backend_free(head->device);
    if (head->cpu) ggml_backend_free(head->cpu);
    delete head;
}

void check_span(int32_t start, int32_t end, int32_t n_tokens, const char * what) {
    if (start < 0 || end <= start || end > n_tokens) {
        throw clef::Error(std::string("bad ") + what + " span [" + std::to_string(start) + ", " + std::to_string(end) + ") in a prompt of " +
                          std::to_string(n_tokens) + " tokens");
    }
}

clef::Decision decision(const clef_head & head, const float * hidden, int32_t n_tokens, const int32_t * tokens, int32_t n_questions,
                        const int32_t * type_ids, const int32_t * question_spans, const int32_t * option_counts,
                        const int32_t * option_spans) {
    if (n_tokens < 1 || n_questions < 1) throw clef::Error("a decision needs at least one token and one question");
    clef::Decision d{hidden, n_tokens, std::vector<int32_t>(tokens, tokens + n_tokens), {}, {}, {}, {}};
    for (int32_t t : d.tokens) {
        if (t < 0 || t >= head.model.lexicon.n_vocab) throw clef::Error("token id " + std::to_string(t) + " is outside the vocabulary");
    }
    int64_t option = 0;
    for (int32_t q = 0; q < n_questions; q++) {
        if (type_ids[q] < 0 || type_ids[q] > 2) throw clef::Error("question type ids are 0 (noul), 1 (choice) or 2 (score)");
        if (option_counts[q] < 1) throw clef::Error("every question needs at least one option");
        d.type_ids.push_back(type_ids[q]);
        for (int32_t i = 0; i < option_counts[q]; i++, option++) {
            check_span(option_spans[2 * option], option_spans[2 * option + 1], n_tokens, "option");
            d.question_of.push_back(q);
            d.span_starts.push_back(option_spans[2 * option]);
            d.span_lengths.push_back(option_spans[2 * option + 1] - option_spans[2 * option]);
        }
    }
    for (int32_t q = 0; q < n_questions; q++) {
        check_span(question_spans[2 * q], question_spans[2 * q + 1], n_tokens, "question");
        d.span_starts.push_back(question_spans[2 * q]);
        d.span_lengths.push_back(question_spans[2 * q + 1] - question_spans[2 * q]);
    }
    return d;
}

void run(clef_head & head, const clef::Decision & d, float * logits) {
    size_t nodes = clef::graph_size(head.model, d);
    if (nodes > SCHED_GRAPH_SIZE) throw clef::Error("this request has too many spans for one graph");
    ggml_init_params params = {ggml_tensor_overhead() * nodes * 2 + ggml_graph_overhead_custom(nodes, false), nullptr, true};
    ggml_context * ctx = ggml_init(params);
    try {
        clef::Graph g = clef::build_graph(ctx, head.model, d);
        ggml_backend_sched_reset(head.sched);
        if (!ggml_backend_sched_alloc_graph(head.sched, g.graph)) {
            throw clef::Error("cannot allocate the head's compute buffer on " + head.device_name + " (out of memory?)");
        }
        // The padding is masked, and zeros keep it finite (0 * NaN would not vanish).
        const size_t filled = (size_t) d.n_tokens * g.hidden->nb[1];
        ggml_backend_tensor_set(g.hidden, d.hidden, 0, filled);
        if (filled < ggml_nbytes(g.hidden)) ggml_backend_tensor_memset(g.hidden, 0, filled, ggml_nbytes(g.hidden) - filled);
        for (const clef::Input & input : g.inputs) ggml_backend_tensor_set(input.tensor, input.bytes.data(), 0, input.bytes.size());
        if (ggml_backend_sched_graph_compute(head.sched, g.graph) != GGML_STATUS_SUCCESS) {
            throw clef::Error("the head's graph failed on " + head.device_name);
        }
        ggml_backend_tensor_get(g.logits, logits, 0, ggml_nbytes(g.logits));
    } catch (...) {
        ggml_free(ctx);
        throw;
    }
    ggml_free(ctx);
}

}  // namespace

extern "C" {

int clef_head_load(const char * path, const void * const * blocks, const uint64_t * block_sizes, const char * manifest,
                   const int64_t * config, float norm_eps, int use_gpu, int n_threads, clef_head ** out, char * err, size_t err_size) {
    auto * head = new clef_head();
    try {
        head->model.config = {config[0], config[1], config[2], config[3], config[4], config[5], norm_eps};
        init_backends(*head, path, blocks, block_sizes, parse_manifest(manifest), use_gpu != 0, n_threads);
    } catch (const std::exception & e) {
        free_head(head);
        report(err, err_size, e.what());
        return 1;
    }
    *out = head;
    return 0;
}

void clef_head_free(clef_head * head) { free_head(head); }

const char * clef_head_device(const clef_head * head) { return head->device_name.c_str(); }

int clef_head_split_products(const clef_head * head) { return head->model.split_products ? 1 : 0; }

int32_t clef_head_hidden_size(const clef_head * head) { return (int32_t) head->model.config.hidden_size; }

int clef_head_run(clef_head * head, const float * hidden, int32_t n_tokens, const int32_t * tokens, int32_t n_questions,
                  const int32_t * type_ids, const int32_t * question_spans, const int32_t * option_counts, const int32_t * option_spans,
                  float * logits, char * err, size_t err_size) {
    try {
        clef::Decision d = decision(*head, hidden, n_tokens, tokens, n_questions, type_ids, question_spans, option_counts, option_spans);
        run(*head, d, logits);
    } catch (const std::exception & e) {
        report(err, err_size, e.what());
        return 1;
    }
    return 0;
}

}  // extern "C"
