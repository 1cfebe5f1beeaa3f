// The C API of ggml's CPU "extra" buffer types (AMX, CPU_REPACK, ...), for the one
// place in clef-gguf that decides where llama.cpp may put CPU weights
// (clef_gguf/llama/cpu_buffers.py). llama-cpp-python binds none of this.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CLEF_CPU_API CLEF_EXPORT

// The names of the CPU device's extra buffer types, in llama.cpp's order of preference,
// separated by commas ("AMX,CPU_REPACK"); empty when there are none. Returns the length
// the full list needs (as snprintf does).
CLEF_CPU_API int clef_cpu_extra_buft_names(char * out, size_t size);

// The extra buffer type of that name, or null: a pointer for llama.cpp's tensor buffer
// type overrides (llama_model_tensor_buft_override.buft).
CLEF_CPU_API void * clef_cpu_extra_buft(const char * name);

// Whether the CPU device runs GGML_OP_MUL_MAT with a 2-D weight of this ggml type and
// shape (ne0 = row width, ne1 = rows) stored in `buft`: the very question llama.cpp asks
// (weight_buft_supported) before it places a weight in an extra buffer type.
CLEF_CPU_API bool clef_cpu_buft_supports_weight(void * buft, int type, int64_t ne0, int64_t ne1);

#ifdef __cplusplus
}
#endif
