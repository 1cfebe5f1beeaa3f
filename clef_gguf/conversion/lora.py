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
from .release import HEAD_CONFIG, HEAD_WEIGHTS, Release, StoredTensor, json_excerpt, open_release, read_safetensors_index

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAIN_CONFIG = "train_config.json"
FLOAT32_MAX = float(np.finfo(np.float32).max)
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
    """A clef-finetune checkpoint folder: it holds the adapter/ that train writes (a release never does); an
    adapter/ that is a broken link or a loop counts, so that open_checkpoint says what is wrong with it."""
    return (path / ADAPTER_DIR).is_dir() or (path / ADAPTER_DIR).is_symlink()


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


def _is_rank(value: Any) -> bool:
    return type(value) is int and value > 0


def _is_alpha(value: Any) -> bool:
    # PEFT multiplies float32 weights by it: beyond float32's range it is Inf there, and every merged value NaN or Inf.
    return type(value) in (int, float) and math.isfinite(value) and 0 < value <= FLOAT32_MAX


# adapter_config.json's keys that set the merge: what each must be (PEFT's LoraConfig types).
_SETTINGS = {
    "r": (_is_rank, "a positive integer (the LoRA rank)"),
    "lora_alpha": (_is_alpha, "a number > 0 that float32 holds (at most 3.4e38)"),
    "rank_pattern": (_is_rank, "a positive integer"),
    "alpha_pattern": (_is_alpha, "a number > 0 that float32 holds (at most 3.4e38)"),
}


def _regex(path: Path, key: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise ReleaseError(f"{path}: {key} {json_excerpt(pattern)} is not a regular expression ({e})") from None


def _check_settings(config: dict[str, Any], path: Path) -> None:
    """r, lora_alpha, their patterns, target_modules and use_rslora: refused as PEFT's types would not take them."""
    for key, (valid, what) in _SETTINGS.items():
        value = config.get(key)
        if key in ("r", "lora_alpha"):
            if key in config and not valid(value):
                raise ReleaseError(f"{path}: {key} is {json_excerpt(value)}; it must be {what}")
            continue
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ReleaseError(f"{path}: {key} is {json_excerpt(value)}; it must be an object of module patterns -> {what}")
        for pattern, item in value.items():
            _regex(path, f"{key} key", rf"(.*\.)?({pattern})$")
            if not valid(item):
                raise ReleaseError(f"{path}: {key}[{json_excerpt(pattern)}] is {json_excerpt(item)}; it must be {what}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        _regex(path, "target_modules", targets)
    elif targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise ReleaseError(
            f"{path}: target_modules is {json_excerpt(targets)}; it must be a regex, a list of module names, or all-linear"
        )
    if config.get("use_rslora") not in (None, True, False):
        raise ReleaseError(f"{path}: use_rslora is {json_excerpt(config['use_rslora'])}; it must be true or false")


def read_adapter_config(path: Path) -> dict[str, Any]:
    """A PEFT adapter_config.json, checked: a LoRA whose settings PEFT would take and a plain merge reproduces."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ReleaseError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        found = json_excerpt(config.get("peft_type")) if isinstance(config, dict) else f"JSON {type(config).__name__}, not a"
        raise ReleaseError(f"{path}: a {found} adapter; only LoRA adapters can be merged")
    for key, (default, why) in UNMERGEABLE.items():
        value = config.get(key, default)
        if value not in (default, None, [], {}, False, "none"):
            raise ReleaseError(
                f"{path}: {key} = {json_excerpt(value)} cannot be merged here ({why}); "
                "merge it with `clef-finetune merge`, then convert the folder it writes"
            )
    _check_settings(config, path)
    return config


def _adapter_config(adapter: Path) -> dict[str, Any]:
    path = adapter / ADAPTER_CONFIG
    if not path.exists() and not path.is_symlink():
        where = path.relative_to(adapter.parent)  # (in the system's form: adapter\adapter_config.json on Windows)
        raise ReleaseError(f"{adapter.parent.name}: {where} is missing: not a clef-finetune checkpoint")
    return read_adapter_config(path)


@dataclass(frozen=True)
class ModuleLora:
    """One module's LoRA settings, as PEFT's update_layer sets them: the update is scale * (B @ A)."""

    r: int
    alpha: float
    scale: float  # alpha / r, or alpha / sqrt(r) with use_rslora


def module_lora(config: dict[str, Any], module: str, path: Path | str = ADAPTER_CONFIG) -> ModuleLora:
    """r, alpha and scale of `module` under a checked adapter config (read_adapter_config): its rank_pattern and
    alpha_pattern first, then r and lora_alpha (PEFT's defaults 8 and 8)."""
    r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", 8))
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    if scale > FLOAT32_MAX:
        raise ReleaseError(f"{path}: lora_alpha {alpha:g} at rank {r} gives {module} a scale of {scale:.3g}, beyond float32")
    return ModuleLora(r, alpha, scale)


def _lora_pairs(adapter: Path) -> dict[str, dict[str, StoredTensor]]:
    """{module name in the base model: {"A": lora_A, "B": lora_B}} from the adapter's weights."""
    path = adapter / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ReleaseError(
            f"{adapter.parent.name}: {path.relative_to(adapter.parent)} is missing (a .bin adapter: save it as safetensors)"
        )
    pairs: dict[str, dict[str, StoredTensor]] = {}
    for key, tensor in read_safetensors_index(path).items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match is None:
            shown = json_excerpt(key)
            raise ReleaseError(f"{path.name}: tensor {shown} is not a LoRA A or B weight; only plain LoRA can be merged")
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
        lora = module_lora(config, module, adapter / ADAPTER_CONFIG)
        if len(a.shape) != 2 or len(b.shape) != 2 or len(weight.shape) != 2 or (b.shape[0], a.shape[1]) != weight.shape:
            raise ReleaseError(
                f"the adapter does not fit the base release {release.name}: {module} is {list(weight.shape)} there, "
                f"lora_B x lora_A is {list(b.shape)} x {list(a.shape)}: is --base the release it was trained from?"
            )
        if a.shape[0] != lora.r or b.shape[1] != lora.r:
            raise ReleaseError(
                f"{module}: adapter_config.json gives rank {lora.r}, but its lora_A has {a.shape[0]} rows and its lora_B "
                f"{b.shape[1]} columns (both must be the rank)"
            )
        merged[f"{module}.weight"] = MergedTensor(weight, a, b, lora.scale)
    return merged


def open_checkpoint(checkpoint: str | Path, base: str | Path) -> Release:
    """The base release with the checkpoint's LoRA merged into its backbone and the checkpoint's head in place of its own."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir() or not is_checkpoint(checkpoint):
        raise ReleaseError(f"{checkpoint}: not a clef-finetune checkpoint (expected {ADAPTER_DIR}/ and {HEAD_WEIGHTS})")
    head_path = checkpoint / HEAD_WEIGHTS
    if not head_path.is_file():
        raise ReleaseError(f"{checkpoint.name}: {HEAD_WEIGHTS} is missing: a clef-finetune checkpoint carries its trained head")
    adapter = checkpoint / ADAPTER_DIR
    if not adapter.is_dir():
        raise ReleaseError(
            f"{adapter}: a symbolic link that leads to no folder (a loop, or its target is gone): "
            f"point {ADAPTER_DIR}/ at the folder holding {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        )
    release = open_release(base)
    backbone = {**release.backbone, **merged_backbone(release, adapter)}
    head = read_safetensors_index(head_path)
    expected = C.reference_head_shapes(release.head_config)
    for name in sorted(set(expected) | set(head)):
        if name not in head or name not in expected or not _fits(head[name].shape, expected[name]):
            raise ReleaseError(
                f"the checkpoint's head does not fit the base release {release.name}: tensor {json_excerpt(name)} is "
                f"{list(head[name].shape) if name in head else 'missing'} in the checkpoint, "
                f"{list(expected[name]) if name in expected else 'absent'} in the base's {HEAD_CONFIG}"
            )
    return dataclasses.replace(release, backbone=backbone, head=head)


def _fits(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """The rule the conversion applies (graft.head_tensors): the same shape, or a scalar stored without dims.
    A transposed matrix has the right size but not the right shape."""
    return shape == tuple(expected) or (not shape and int(np.prod(expected)) == 1)


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's files, which an output must not overwrite."""
    return [p for p in checkpoint.rglob("*") if p.is_file()]
