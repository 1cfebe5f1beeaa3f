// The C API of libclef_head: Clef's joint schema head as a ggml graph, on the device
// the backbone runs on. Python binds it with ctypes (clef_gguf/llama/native_head.py).
//
// Every function that can fail returns 0 on success, or non-zero with a one-line
// message in err (err_size bytes, always NUL-terminated).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CLEF_HEAD_API CLEF_EXPORT

typedef struct clef_head clef_head;

// Read the head's tensors (in their stored types) from the Clef GGUF at `path`, as `manifest` says:
// one "role<TAB>ggml type<TAB>ne0<TAB>ne1<TAB>absolute offset[<TAB>file]" line a tensor, checked against the file
// (`path` may hold several paths, one a line: a row's optional file is the index of the one its bytes are in;
// an adapter's head is read from the adapter file over its base's lexicon)
// by the caller (clef_gguf/llama/native_head.py, from contract.head_manifest). blocks: null, or one entry a path: where
// blocks[i] is not null, file i is those block_sizes[i] bytes of memory, which the caller keeps unchanged until
// clef_head_free (its path line then only names it), and the head reads no file for it. Only the lexicon's file is
// read after clef_head_load returns: the others are closed then (a block other than the lexicon's may be freed). config: hidden_size,
// width, routing_layers, layers, heads, feedforward; norm_eps: the head's LayerNorm epsilon. use_gpu:
// run on the first GPU device ggml knows (CUDA or Vulkan when llama-cpp-python was built with it),
// else on the CPU.
CLEF_HEAD_API int clef_head_load(const char * path, const void * const * blocks, const uint64_t * block_sizes, const char * manifest,
                                 const int64_t * config, float norm_eps, int use_gpu, int n_threads, clef_head ** out, char * err,
                                 size_t err_size);
CLEF_HEAD_API void clef_head_free(clef_head * head);

// The device the head runs on ("CPU", "CUDA0", ...) and the hidden size it expects.
CLEF_HEAD_API const char * clef_head_device(const clef_head * head);
CLEF_HEAD_API int32_t clef_head_hidden_size(const clef_head * head);
// 1 when the head splits its products in F16-exact parts: its device rounds F32 products' inputs to F16
// (a probe at load; CLEF_HEAD_SPLIT_PRODUCTS=0 or 1 overrides it).
CLEF_HEAD_API int clef_head_split_products(const clef_head * head);

// One decision. hidden: n_tokens rows of hidden_size floats (the backbone's final
// hidden states); tokens: the prompt's ids (the lexical prior reads the output
// embedding rows of each option's tokens). Spans are [start, end) token positions:
// question_spans has 2 * n_questions entries, option_spans 2 * sum(option_counts),
// question by question. logits receives one float per option, in the same order.
CLEF_HEAD_API int clef_head_run(clef_head * head, const float * hidden, int32_t n_tokens, const int32_t * tokens,
                                int32_t n_questions, const int32_t * type_ids, const int32_t * question_spans,
                                const int32_t * option_counts, const int32_t * option_spans, float * logits, char * err,
                                size_t err_size);

#ifdef __cplusplus
}
#endif
