"""The fixtures' tokenizer: a small byte-level BPE trained here, shaped like Qwen3.5's (its split, its added tokens)."""

from __future__ import annotations

import functools

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .reference import load_reference

# Qwen3.5's pre-tokenizer split; llama.cpp's `qwen35` pre-tokenizer implements
# exactly this (its `qwen2` one lacks the \p{M} parts).
QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen's special added tokens, in Qwen's id order.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added but not special in Qwen3: they are ordinary text to the chat template.
PLAIN_ADDED_TOKENS = ("<think>", "</think>")
BPE_VOCAB_SIZE = 800  # byte alphabet (256) + ~540 merges


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A Qwen-shaped byte-level BPE tokenizer (fresh object on every call)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=262_144,
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def _trained_tokenizer_json() -> str:
    # Training takes ~0.1 s but every build needs the same result: cache the JSON.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens(list(PLAIN_ADDED_TOKENS))
    return tokenizer.to_str()


def _corpus() -> list[str]:
    """Built-in training text: the Clef prompt template, JSON, English, digits, unicode."""
    system = load_reference().SYSTEM_PROMPT
    template = [
        f"system\n{system}\nuser\nSTATE:\n",
        "\n\nSCHEMA FIELDS:\n",
        "\nFIELD 1\nID: is_spam\nTYPE: noul\nINSTRUCTION: Is this message spam?",
        "\nFIELD 2\nID: category\nTYPE: choice\nINSTRUCTION: Which category fits best?",
        "\nFIELD 3\nID: severity\nTYPE: score\nINSTRUCTION: How severe is the issue?",
        "\nALLOWED OPTIONS:\nOPTION 1: ",
        '{"description":"The proposition is true or the answer is yes.","option_id":"true"}\n',
        '{"description":"The proposition is false or the answer is no.","option_id":"false"}\n',
        '{"description":"A billing question","option_id":"billing"}\nOPTION 2: ',
        "END FIELD\n",
        "\nassistant\n\n\nJOINT SCHEMA DECISIONS:",
    ]
    json_text = [
        '{"user":{"name":"Ada","age":36,"tags":["admin","beta"]},"active":true,"score":0.75}',
        '{"order_id":10482,"items":[{"sku":"A-17","qty":2},{"sku":"B-3","qty":1}],"note":null}',
        '[1,2,3,{"nested":{"deep":[true,false,null]}},"end"]',
    ]
    english = [
        "The quick brown fox jumps over the lazy dog while the customer waits for support.",
        "Please review the following conversation and decide whether the request is urgent.",
        "Our refund policy allows returns within thirty days of purchase with a receipt.",
        "The server returned an error after the deployment, so the team rolled it back.",
        "She said it's fine, they're sure we'll win, and I'd rather you'd not ask again.",
    ]
    digits = [" ".join(str(n) for n in range(0, 200, 7)), "3.14159 2.71828 1e-6 -42 1,000,000 2026-11-29"]
    unicode_text = [
        "Café crème, naïve résumé, état des lieux, Straße, façade, Ångström, año.",
        "是否需要人工审核？这是一个测试句子。日本語のテキストも少し。한국어 문장입니다.",
        "Emoji: 🙂 🚀 👍🏽 ❤️ 🇫🇷 ✅ — and symbols: € £ ¥ © ™ ≤ ≥ ∞.",
        "Ελληνικά κείμενα και русский текст для проверки юникода.",
    ]
    # Repetition weights the template text, as in real Clef prompts.
    return template * 4 + json_text * 2 + english * 2 + digits + unicode_text * 2
