"""Adapter files in seconds, for tests of serving and planning them: a PEFT checkpoint with random LoRA pairs and a
moved head (testing/finetune.peft_checkpoint) over a fixture release, converted to a Clef adapter file. The tests of
the adapters' answers themselves, on fine-tunes made by clef-finetune's `train`, are tests/test_adapters.py."""

from __future__ import annotations

from pathlib import Path

from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.testing import finetune

LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj|gate_proj|up_proj"
    r"|down_proj)",
}


def peft_adapter(release: Path, root: Path, name: str, seed: int = 0, file_type: str = "f32") -> Path:
    """NAME.adapter.gguf in `root`: a fine-tune over `release` whose answers differ from the release's."""
    checkpoint = finetune.peft_checkpoint(release, root / name, LORA, {"prior_logit_scale": 0.5 + seed}, seed=seed)
    return convert_adapter(checkpoint, release, root / f"{name}.adapter.gguf", file_type)
