"""A clef-finetune checkpoint merged into its base release as the conversion streams it.

clef-finetune's `train` writes `checkpoint-N/`: a PEFT LoRA adapter in `adapter/` (`adapter_config.json`,
`adapter_model.safetensors`) and the trained head, `joint_head.safetensors`. Its `merge` loads the whole backbone
in torch to fold the adapter in. Here each adapted weight is a MergedTensor: W + scale * (B @ A) in float32,
computed when the writer asks for that tensor, so that peak memory stays near one tensor. The rules are PEFT's
LoRA merge (peft/tuners/lora/layer.py, Linear.get_delta_weight and update_layer):

- scale = alpha / r, or alpha / sqrt(r) with use_rslora;
- r and alpha per module from rank_pattern and alpha_pattern, matched as PEFT's get_pattern_key matches them
  (the first pattern P with re.match(rf"(.*\\.)?({P})$", module));
- fan_in_fan_out transposes B @ A only for Conv1D layers: PEFT sets it to False for torch.nn.Linear, and every
  weight a Qwen3.5 release holds is an nn.Linear's (out, in), so it changes nothing here, as in PEFT.

Anything else that changes the merged weights (DoRA, LoRA biases, modules_to_save, trainable tokens, ...) is
refused with what to do instead, never dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ReleaseError
from ..format import contract as C
from .release import HEAD_CONFIG, HEAD_WEIGHTS, Release, StoredTensor, open_release, read_safetensors_index

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAIN_CONFIG = "train_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix before the base model's own module names
# adapter_config.json settings whose non-default value changes the merged weights in ways W + s B A does not cover.
UNMERGEABLE: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA rescales each merged column by a learned magnitude"),
    "bias": ("none", "LoRA biases change the layers' biases"),
    "lora_bias": (False, "lora_B biases change the layers' biases"),
    "modules_to_save": (None, "modules_to_save replaces whole modules"),
    "trainable_token_indices": (None, "trainable tokens replace embedding rows"),
    "target_parameters": (None, "LoRA on bare parameters"),
    "layer_replication": (None, "layer replication changes the layer count"),
    "use_qalora": (False, "QALoRA merges into a quantized base"),
}


def is_checkpoint(path: Path) -> bool:
    """A clef-finetune checkpoint folder: it holds the adapter/ that train writes (a release never does)."""
    return (path / ADAPTER_DIR).is_dir()


def trained_from(checkpoint: Path) -> str | None:
    """The base release the checkpoint was trained from, as its train_config.json names it."""
    try:
        return json.loads((checkpoint / TRAIN_CONFIG).read_text())["model"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def needs_base(checkpoint: Path) -> ReleaseError:
    hint = trained_from(checkpoint)
    named = f" (its train_config.json names {hint}: --base {hint})" if hint else ""
    return ReleaseError(
        f"{checkpoint.name} is a clef-finetune checkpoint (a LoRA adapter and a head), not a release: "
        f"give the release it was trained from with --base{named}"
    )


@dataclass(frozen=True)
class MergedTensor:
    """A base weight with its LoRA update folded in, read when asked for (the StoredTensor interface)."""

    base: StoredTensor
    a: StoredTensor  # lora_A: (r, in)
    b: StoredTensor  # lora_B: (out, r)
    scale: float

    @property
    def path(self) -> Path:
        return self.base.path

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    def load(self) -> np.ndarray:
        # PEFT's order: delta = (B @ A) * scaling, in float32, then added to the weight.
        delta = (self.b.load() @ self.a.load()) * np.float32(self.scale)
        return self.base.load() + delta


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _targeted(target_modules: Any, module: str) -> bool:
    """Whether PEFT's target_modules names the module (check_target_module_exists: a str is a full-match regex)."""
    if target_modules == "all-linear":
        return True
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    targets = list(target_modules or [])
    return module in targets or any(module.endswith(f".{t}") for t in targets)


def _adapter_config(adapter: Path) -> dict[str, Any]:
    path = adapter / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReleaseError(
            f"{adapter.parent.name}: {ADAPTER_DIR}/{ADAPTER_CONFIG} is missing: not a clef-finetune checkpoint"
        ) from None
    except (OSError, ValueError) as e:
        raise ReleaseError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise ReleaseError(f"{path}: a {found} adapter; only LoRA adapters can be merged")
    for key, (default, why) in UNMERGEABLE.items():
        value = config.get(key, default)
        if value not in (default, None, [], {}, False, "none"):
            raise ReleaseError(
                f"{path}: {key} = {json.dumps(value)} cannot be merged here ({why}); "
                "merge it with `clef-finetune merge`, then convert the folder it writes"
            )
    return config


def _lora_pairs(adapter: Path) -> dict[str, dict[str, StoredTensor]]:
    """{module name in the base model: {"A": lora_A, "B": lora_B}} from the adapter's weights."""
    path = adapter / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ReleaseError(
            f"{adapter.parent.name}: {ADAPTER_DIR}/{ADAPTER_WEIGHTS} is missing (a .bin adapter: save it as safetensors)"
        )
    pairs: dict[str, dict[str, StoredTensor]] = {}
    for key, tensor in read_safetensors_index(path).items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match is None:
            raise ReleaseError(f"{path.name}: tensor {key} is not a LoRA A or B weight; only plain LoRA can be merged")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    incomplete = [m for m, ab in pairs.items() if len(ab) != 2]
    if incomplete:
        raise ReleaseError(f"{path.name}: {incomplete[0]} has lora_A or lora_B but not both")
    if not pairs:
        raise ReleaseError(f"{path.name} holds no LoRA weights")
    return pairs


def merged_backbone(release: Release, adapter: Path) -> dict[str, MergedTensor]:
    """The release's adapted weights as MergedTensors, each checked against the adapter's config and shapes."""
    config = _adapter_config(adapter)
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    merged = {}
    for module, ab in sorted(_lora_pairs(adapter).items()):
        weight = release.backbone.get(f"{module}.weight")
        if weight is None:
            raise ReleaseError(
                f"the adapter adapts {module}, which the base release {release.name} does not have: "
                "is --base the release this checkpoint was trained from?"
            )
        if not _targeted(config.get("target_modules"), module):
            raise ReleaseError(f"the adapter holds weights for {module}, which its target_modules does not name")
        a, b = ab["A"], ab["B"]
        r = int(_pattern_value(rank_pattern, module, r_default))
        if len(a.shape) != 2 or len(b.shape) != 2 or len(weight.shape) != 2 or (b.shape[0], a.shape[1]) != weight.shape:
            raise ReleaseError(
                f"the adapter does not fit the base release {release.name}: {module} is {list(weight.shape)} there, "
                f"lora_B x lora_A is {list(b.shape)} x {list(a.shape)}: is --base the release it was trained from?"
            )
        if a.shape[0] != r or b.shape[1] != r:
            raise ReleaseError(f"{module}: adapter_config.json gives rank {r}, its LoRA weights have rank {a.shape[0]}")
        alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
        scale = alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r
        merged[f"{module}.weight"] = MergedTensor(weight, a, b, scale)
    return merged


def open_checkpoint(checkpoint: str | Path, base: str | Path) -> Release:
    """The base release with the checkpoint's LoRA merged into its backbone and the checkpoint's head in place of its own."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir() or not is_checkpoint(checkpoint):
        raise ReleaseError(f"{checkpoint}: not a clef-finetune checkpoint (expected {ADAPTER_DIR}/ and {HEAD_WEIGHTS})")
    head_path = checkpoint / HEAD_WEIGHTS
    if not head_path.is_file():
        raise ReleaseError(f"{checkpoint.name}: {HEAD_WEIGHTS} is missing: a clef-finetune checkpoint carries its trained head")
    release = open_release(base)
    backbone = {**release.backbone, **merged_backbone(release, checkpoint / ADAPTER_DIR)}
    head = read_safetensors_index(head_path)
    expected = C.reference_head_shapes(release.head_config)
    for name in sorted(set(expected) | set(head)):
        if name not in head or name not in expected or int(np.prod(head[name].shape)) != int(np.prod(expected[name])):
            raise ReleaseError(
                f"the checkpoint's head does not fit the base release {release.name}: tensor {name} is "
                f"{list(head[name].shape) if name in head else 'missing'} in the checkpoint, "
                f"{list(expected[name]) if name in expected else 'absent'} in the base's {HEAD_CONFIG}"
            )
    return dataclasses.replace(release, backbone=backbone, head=head)


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's files, which an output must not overwrite."""
    return [p for p in checkpoint.rglob("*") if p.is_file()]
