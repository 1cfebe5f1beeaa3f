"""Everything that touches libllama, ggml or libclef_head through ctypes."""
