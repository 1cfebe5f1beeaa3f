"""Cloudflare's reference implementation as the test oracle.

Loads a Clef release folder the way the reference does (transformers backbone,
reference ``JointSchemaHead``, ``ClefModel``) but in float32 on CPU, and without
``AutoProcessor``: for Qwen3.5 it builds a video processor, which needs torchvision,
and no torchvision loads with the CPU torch here. The release's processor class,
``Qwen3VLProcessor``, is built instead over the PIL image processor
(``Qwen2VLImageProcessorPil``, pillow only) from ``preprocessor_config.json``, its
video part left out: images are processed exactly as by the release's processor
(requests here carry PIL images in ``images``, as the reference takes them).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .reference import load_reference

# Large enough that the reference never truncates the state.
MAX_LENGTH = 1_000_000

Span = tuple[int, int]


class _ImageProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without its video processor (transformers refuses None for it, though images never use it)."""

    def check_argument_for_proper_class(self, attribute_name: str, arg: Any) -> Any:
        if attribute_name == "video_processor" and arg is None:
            return None
        return super().check_argument_for_proper_class(attribute_name, arg)


def release_processor(release_dir: Path, tokenizer: PreTrainedTokenizerFast) -> Any:
    """The release's processor for images, or a stand-in with only the tokenizer when it has no vision tower."""
    config_path = release_dir / "preprocessor_config.json"
    if not config_path.exists():
        return SimpleNamespace(tokenizer=tokenizer)
    config = json.loads(config_path.read_text())
    settings = {k: v for k, v in config.items() if k not in ("processor_class", "image_processor_type")}
    return _ImageProcessor(image_processor=Qwen2VLImageProcessorPil(**settings), tokenizer=tokenizer)


class Oracle:
    """The reference Clef model of one release folder, float32 on CPU."""

    def __init__(self, release_dir: Path) -> None:
        release_dir = Path(release_dir)
        self.reference = load_reference()
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(release_dir)
        self.processor = release_processor(release_dir, self.tokenizer)
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
        return self.reference.encode_record(self.tokenizer, request, max_length=MAX_LENGTH, processor=self.processor)
