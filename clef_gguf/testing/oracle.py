"""Cloudflare's reference implementation as the test oracle.

Loads a Clef release folder the way the reference does (transformers backbone,
reference ``JointSchemaHead``, ``ClefModel``) but in float32 on CPU, and without
``AutoProcessor``: a Qwen3.5 processor needs torchvision, and text-only requests
only ever touch ``processor.tokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast, Qwen3_5ForConditionalGeneration

from .release_builder import load_reference

# Large enough that the reference never truncates the state.
MAX_LENGTH = 1_000_000

Span = tuple[int, int]


class Oracle:
    """The reference Clef model of one release folder, float32 on CPU."""

    def __init__(self, release_dir: Path) -> None:
        release_dir = Path(release_dir)
        self.reference = load_reference()
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(release_dir)
        # The reference reads only .tokenizer from its processor for text requests.
        self.processor = SimpleNamespace(tokenizer=self.tokenizer)
        backbone = Qwen3_5ForConditionalGeneration.from_pretrained(release_dir, dtype=torch.float32)
        backbone.config.use_cache = False
        config = json.loads((release_dir / "joint_head_config.json").read_text())
        head = self.reference.JointSchemaHead(**config)
        state = load_file(release_dir / "joint_head.safetensors")
        head.load_state_dict(state, strict=True)
        head = head.to(dtype=torch.float32)
        self.model = self.reference.ClefModel(backbone, head).eval()

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """The reference ``systemone`` response body."""
        return self.reference.systemone(self.model, self.processor, request, max_length=MAX_LENGTH)

    @torch.inference_mode()
    def probabilities(self, request: dict[str, Any]) -> dict[str, dict[str, float]]:
        """Unrounded option probabilities: question id -> {option id: p}.

        The same path as ``systemone`` (encode, collate, forward, softmax) minus
        its rounding, so tests can compare with tolerances of their own.
        """
        encoded = self._encode(request)
        batch = self.reference.collate_records([encoded], self.tokenizer.pad_token_id, torch.device("cpu"))
        logits = self.model(batch)[0]
        return {
            question.question_id: dict(zip(question.option_ids, values.float().softmax(-1).tolist(), strict=True))
            for question, values in zip(encoded.questions, logits, strict=True)
        }

    def input_ids(self, request: dict[str, Any]) -> list[int]:
        """The token ids the reference feeds the backbone."""
        return list(self._encode(request).input_ids)

    def spans(self, request: dict[str, Any]) -> list[tuple[Span, tuple[Span, ...]]]:
        """Per question, in request order: (question span, option spans)."""
        return [(question.question_span, question.option_spans) for question in self._encode(request).questions]

    def _encode(self, request: dict[str, Any]) -> Any:
        return self.reference.encode_record(self.tokenizer, request, max_length=MAX_LENGTH)
