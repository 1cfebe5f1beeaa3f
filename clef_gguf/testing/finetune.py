"""clef-finetune 0.1.0 itself, run on the fixture releases: `train` (a LoRA + head checkpoint), `merge` (a release
folder) and `eval` (its metrics), each in a child process (`python -m clef_gguf.testing.finetune ARGS`).

Its `load_tokenizer_and_processor` asks AutoProcessor, which needs torchvision for Qwen3.5, and torchvision does not
load beside torch 2.13.0 CPU (FACTS.md): for text-only data the tokenizer alone is what it needs, so this module
replaces that one function before calling clef-finetune's own CLI. Nothing else of clef-finetune is changed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# A fine-tune that moves the fixture's answers in a few steps: a high learning rate, no warm-up, rank 8.
TRAIN: dict[str, Any] = {
    "lora": {"r": 8, "alpha": 16},
    "train": {
        "max_steps": 4,
        "grad_accum": 2,
        "lr": 0.02,
        "head_lr": 0.005,
        "warmup_steps": 0,
        "save_every": 4,
        "gradient_checkpointing": False,
        "augment_train": False,
        "label_smoothing": 0.0,
    },
}


def run_cli(*args: str) -> None:
    """clef-finetune's CLI in a child process (torch's threads and memory go with it)."""
    env = {**os.environ, "CLEF_FINETUNE_JSM": "vendored", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", __name__, *args], check=True, env=env)


# A process's trainings, by what they were trained on (_configuration_digest): a private copy of the checkpoint (its
# first caller may move or change its own), and the release and output folder its files name. The suite trains one
# configuration for several test modules (test_finetune, test_adapters, test_adapter_file, test_readme), minutes each.
_trained: dict[str, tuple[Path, str, str]] = {}
_kept_in: list[Path] = []  # the folder of those copies, made on first use, removed when the process exits


def train(release: Path, data: Path, out_dir: Path, **overrides: Any) -> Path:
    """clef-finetune train on `release` and `data`; the checkpoint folder it writes. Once per process for each
    configuration (the release's and the data's bytes, the settings): again, the same checkpoint is copied to out_dir,
    its files naming this release and out_dir where train's own would (its train_config.json is the configuration)."""
    config = {
        "model": {"path": str(release), "dtype": "float32"},
        "data": {"train": str(data), "max_length": 4096},
        "output_dir": str(out_dir),
        "lora": {**TRAIN["lora"], **overrides.get("lora", {})},
        "train": {**TRAIN["train"], **overrides.get("train", {})},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "train.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    checkpoint = out_dir / f"checkpoint-{config['train']['max_steps']}"
    key = _configuration_digest(config)
    if key in _trained:
        kept, trained_release, trained_out = _trained[key]
        _copy_checkpoint(kept, checkpoint, {trained_release: str(release), trained_out: str(out_dir)})
        return checkpoint
    run_cli("train", str(path))
    if not _kept_in:
        _kept_in.append(Path(tempfile.mkdtemp(prefix="clef-finetune-trained-")))
        atexit.register(shutil.rmtree, _kept_in[0], True)
    _trained[key] = (Path(shutil.copytree(checkpoint, _kept_in[0] / key)), str(release), str(out_dir))
    return checkpoint


def _configuration_digest(config: dict[str, Any]) -> str:
    """What a training depends on: the release's files and the data's bytes, the settings (not the folders' paths)."""
    settings = {"dtype": config["model"]["dtype"], "max_length": config["data"]["max_length"]}
    digest = hashlib.sha256(json.dumps([settings, config["lora"], config["train"]], sort_keys=True).encode())
    release = Path(config["model"]["path"])
    for file in sorted(p for p in release.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(release)).encode() + b"\0" + file.read_bytes())
    digest.update(Path(config["data"]["train"]).read_bytes())
    return digest.hexdigest()


def _copy_checkpoint(source: Path, target: Path, paths: dict[str, str]) -> None:
    """Copy a checkpoint, its JSON files (train_config.json, PEFT's adapter_config.json) naming `paths`' values
    where they named its keys."""
    shutil.copytree(source, target)
    for file in target.rglob("*.json"):
        text = file.read_text()
        for old, new in paths.items():
            text = text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
        file.write_text(text)


def merge(release: Path, checkpoint: Path, out_dir: Path) -> Path:
    """clef-finetune merge, in float32 (backbone and head): the release folder it writes."""
    run_cli(
        "merge",
        "--model",
        str(release),
        "--checkpoint",
        str(checkpoint),
        "--output",
        str(out_dir),
        "--dtype",
        "float32",
        "--head-dtype",
        "float32",
    )
    return out_dir


def peft_checkpoint(
    base: Path,
    out: Path,
    lora: dict[str, Any],
    head_shift: dict[str, float] | None = None,
    seed: int = 0,
    merged: Path | None = None,
) -> Path:
    """A checkpoint in clef-finetune's layout made by PEFT itself (get_peft_model + save_pretrained) with random
    lora_A / lora_B, and the base's head with the tensors of `head_shift` moved by their values: any LoraConfig
    (rank_pattern, rsLoRA, ...) in seconds, where `train` takes minutes and only its own settings. With `merged`,
    also PEFT's own merge of it (merge_and_unload) there: a release folder with the checkpoint's head."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.numpy import load_file, save_file
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    checkpoint = out / "checkpoint-4"
    peft_model.save_pretrained(checkpoint / "adapter")
    head = load_file(base / "joint_head.safetensors")
    for name, shift in (head_shift or {}).items():
        head[name] = np.asarray(head[name] + shift, dtype=head[name].dtype)
    save_file(head, checkpoint / "joint_head.safetensors")
    if merged is not None:
        peft_model.merge_and_unload().save_pretrained(merged)
        for name in ("joint_head_config.json", "tokenizer.json", "tokenizer_config.json", "joint_schema_model.py"):
            shutil.copy(base / name, merged / name)
        shutil.copy(checkpoint / "joint_head.safetensors", merged / "joint_head.safetensors")
    return checkpoint


def evaluate(release: Path, data: Path, out_dir: Path) -> dict[str, Any]:
    """clef-finetune eval of a release in float32: its tuned_metrics.json."""
    run_cli(
        "eval",
        "--model",
        str(release),
        "--data",
        str(data),
        "--output-dir",
        str(out_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
    )
    return json.loads((out_dir / "tuned_metrics.json").read_text())


def main(argv: list[str]) -> int:
    import torch
    from clef_finetune import cli, model
    from transformers import AutoTokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model.load_tokenizer_and_processor = lambda model_dir: (AutoTokenizer.from_pretrained(model_dir), None)
    return cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
