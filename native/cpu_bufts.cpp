// ggml's CPU extra buffer types, asked through the backend registry: the same objects
// llama.cpp's loader gets from "ggml_backend_dev_get_extra_bufts".
#include "cpu_bufts.h"

#include <cstdio>
#include <string>

#include "ggml-backend.h"
#include "ggml.h"

namespace {

ggml_backend_buffer_type_t * extra_bufts(ggml_backend_dev_t * cpu_out) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu_out) *cpu_out = cpu;
    if (cpu == nullptr) return nullptr;
    auto get = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    return get ? get(cpu) : nullptr;
}

}  // namespace

int clef_cpu_extra_buft_names(char * out, size_t size) {
    std::string names;
    for (ggml_backend_buffer_type_t * b = extra_bufts(nullptr); b && *b; ++b) {
        if (!names.empty()) names += ',';
        names += ggml_backend_buft_name(*b);
    }
    return std::snprintf(out, size, "%s", names.c_str());
}

void * clef_cpu_extra_buft(const char * name) {
    for (ggml_backend_buffer_type_t * b = extra_bufts(nullptr); b && *b; ++b) {
        if (std::string(ggml_backend_buft_name(*b)) == name) return *b;
    }
    return nullptr;
}

bool clef_cpu_buft_supports_weight(void * buft, int type, int64_t ne0, int64_t ne1) {
    ggml_backend_dev_t cpu = nullptr;
    extra_bufts(&cpu);
    if (cpu == nullptr || buft == nullptr || type < 0 || type >= GGML_TYPE_COUNT || ne0 <= 0 || ne1 <= 0) return false;
    if (ne0 % ggml_blck_size((ggml_type) type) != 0) return false;
    // As llama.cpp's weight_buft_supported: a metadata-only context, the op with a batch of
    // 512 f32 rows, the weight in a zero-size buffer of the type, then the device's answer.
    ggml_init_params params = {3 * ggml_tensor_overhead(), nullptr, true};
    ggml_context * ctx = ggml_init(params);
    if (ctx == nullptr) return false;
    ggml_tensor * w = ggml_new_tensor_2d(ctx, (ggml_type) type, ne0, ne1);
    ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ne0, 512);
    ggml_tensor * op = ggml_mul_mat(ctx, w, b);
    w->buffer = ggml_backend_buft_alloc_buffer((ggml_backend_buffer_type_t) buft, 0);
    bool supported = w->buffer != nullptr && ggml_backend_dev_supports_op(cpu, op);
    if (w->buffer) ggml_backend_buffer_free(w->buffer);
    ggml_free(ctx);
    return supported;
}
