"""Files that tests of several modules make: a real small or read-only file system (test_outputs.py,
test_convert_files.py) and a hand-made clef-finetune checkpoint (test_finite.py, test_fuzz_checkpoint.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

RELEASE = "untied_f32"  # make_checkpoint's base (conftest.Workspace.release)
MODULE = "model.language_model.layers.0.mlp.down_proj"  # (64, 128) in the fixture


@contextmanager
def mounted_tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real small or read-only file system at `path`, a new folder (root only: skipped elsewhere)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextmanager
def read_only_folder(path: Path) -> Iterator[Path]:
    """A folder nobody may write in: permissions, or for root (whom they do not bind) a read-only tmpfs."""
    if os.geteuid() == 0:
        with mounted_tmpfs(path, "ro,size=1m") as folder:
            yield folder
        return
    path.mkdir()
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


def make_checkpoint(
    release: Path,
    folder: Path,
    *,
    config: dict[str, Any] | None = None,
    a: np.ndarray | None = None,
    b: np.ndarray | None = None,
    head: dict[str, np.ndarray] | None = None,
) -> Path:
    """A clef-finetune checkpoint in PEFT's layout: LoRA A (4, 128) and B (64, 4) on MODULE, r 4, alpha 8."""
    rng = np.random.default_rng(0)
    checkpoint = folder / "checkpoint"
    (checkpoint / "adapter").mkdir(parents=True)
    a = rng.normal(0, 0.05, (4, 128)).astype(np.float32) if a is None else a
    b = rng.normal(0, 0.05, (64, 4)).astype(np.float32) if b is None else b
    prefix = f"base_model.model.{MODULE}"
    save_file(
        {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}, str(checkpoint / "adapter" / "adapter_model.safetensors")
    )
    settings = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["down_proj"], **(config or {})}
    (checkpoint / "adapter" / "adapter_config.json").write_text(json.dumps(settings))
    if head is None:
        shutil.copy(release / "joint_head.safetensors", checkpoint / "joint_head.safetensors")
    else:
        save_file(head, str(checkpoint / "joint_head.safetensors"))
    return checkpoint
