"""Load defaults, in a module of their own so that the CLI can show them without importing llama.cpp.

Clef's context is 65,536 tokens. Prompts are prefilled in ubatches of DEFAULT_UBATCH tokens, llama.cpp
carrying the KV and recurrent state over, so device memory is the KV cache of the context plus one
ubatch's compute buffer, whatever the prompt: with these two, Clef-flash Q4_K_M with every layer
offloaded fits an 8 GiB card (measured by tools/plan_reference.py; README, "Memory on an 8 GB card").
"""

DEFAULT_MAX_PROMPT_TOKENS = 65536
DEFAULT_UBATCH = 1024
# Prompts prefilled together (llama.cpp sequences) when requests arrive at once: llama-server's -np 4. Each
# has a recurrent state of its own in the context (Clef-flash: 50 MiB).
DEFAULT_PARALLEL = 4
MAX_PARALLEL = 64  # (llama.cpp's LLAMA_MAX_SEQ is 256)
# Host memory for the state cache (runtime/state_cache.py): two 8k-token states of Clef-flash.
DEFAULT_STATE_CACHE = 1 << 30


def default_ubatch(max_prompt_tokens: int) -> int:
    """The ubatch when none is given: DEFAULT_UBATCH, or the whole prompt when the limit is smaller."""
    return min(DEFAULT_UBATCH, max_prompt_tokens)
