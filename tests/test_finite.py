"""No model holding NaN or Inf is written, and plain validate finds one in a file's head.

Checkpoints are made by hand in PEFT's layout (adapter/adapter_config.json, adapter/adapter_model.safetensors,
joint_head.safetensors): one LoRA pair on layer 0's down_proj of the untied f32 fixture release.
"""

from __future__ import annotations

import struct
import subprocess
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli
from file_helpers import RELEASE, make_checkpoint
from safetensors.numpy import load_file

import clef_gguf
from clef_gguf.check.finite import count_nonfinite
from clef_gguf.check.report import Verdict
from clef_gguf.check.validate import open_validated, validate
from clef_gguf.conversion.graft import graft
from clef_gguf.errors import CorruptModelError, NonFiniteWeightsError, ReleaseError
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama.qwen35_view import write_backbone_gguf
from clef_gguf.testing.gguf_bytes import poke

TENSOR = "blk.0.ffn_down.weight"  # its name in the GGUF
GT = gguf.GGMLQuantizationType


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The CLI in this process, a numpy warning on the way a failure (raised here), not a line on stderr."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (python -W error::RuntimeWarning)
        return run_cli(*args)


def _convert_cli(checkpoint: Path, base: Path, out: Path, file_type: str) -> subprocess.CompletedProcess[str]:
    return _cli("convert", checkpoint, "--base", base, "-o", out, "-t", file_type, "--no-mmproj")


def _one_line_refusal(run: subprocess.CompletedProcess[str], code: int, out: Path) -> str:
    assert run.returncode == code, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr and "Warning" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]  # (after the progress bar)
    assert len(errors) == 1 and run.stderr.strip().endswith(errors[0]), run.stderr
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    return errors[0]


@pytest.mark.parametrize("file_type", ["f32", "f16", "bf16", "q8_0", "q4_k_m"])
def test_a_nan_lora_weight_is_refused_naming_the_tensor(ws, tmp_path, file_type):
    """A diverged run's NaN LoRA weight: exit 5, the tensor named, no file, no numpy warning (was exit 0)."""
    a = np.random.default_rng(1).normal(0, 0.05, (4, 128)).astype(np.float32)
    a[2, 7] = np.nan
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path, a=a)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "m.gguf"
    stderr = _one_line_refusal(_convert_cli(checkpoint, ws.release(RELEASE), out, file_type), 5, out)
    # One NaN in A's column 7 spreads through B @ A to column 7 of the 64 rows.
    assert f"tensor {TENSOR}: 64 of its 8192 values are NaN or Inf" in stderr and "diverged fine-tune" in stderr, stderr


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -float("inf"), 1e39, 0, -2.0, "8", True, None])
def test_a_lora_alpha_that_float32_cannot_scale_by_is_refused_first(ws, tmp_path, alpha):
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path, config={"lora_alpha": alpha})
    with pytest.raises(ReleaseError, match=r"adapter_config\.json: lora_alpha is .*; it must be a number > 0") as raised:
        clef_gguf.convert(checkpoint, tmp_path / "out.gguf", "f32", base=ws.release(RELEASE), mmproj=False)
    assert "\n" not in str(raised.value) and not (tmp_path / "out.gguf").exists()


def test_a_nan_lora_alpha_exits_3_in_the_cli(ws, tmp_path):
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path, config={"lora_alpha": float("nan")})
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "m.gguf"
    stderr = _one_line_refusal(_convert_cli(checkpoint, ws.release(RELEASE), out, "q8_0"), 3, out)
    assert "lora_alpha is NaN" in stderr


def test_a_nan_head_in_a_checkpoint_is_refused(ws, tmp_path):
    head = load_file(str(ws.release(RELEASE) / "joint_head.safetensors"))
    name = "evidence_layers.0.feedforward.0.weight"
    head[name] = head[name].copy()
    head[name][3, 5] = np.inf
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path, head=head)
    with pytest.raises(NonFiniteWeightsError, match=r"^tensor dec\.\S+: 1 of its 2048 values are NaN or Inf"):
        clef_gguf.convert(checkpoint, tmp_path / "out.gguf", "q8_0", base=ws.release(RELEASE), mmproj=False)
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize(
    ("size", "file_type", "refused"),
    [(100.0, "f32", False), (100.0, "f16", True), (100.0, "q8_0", False), (2000.0, "q8_0", True)],
)
def test_a_value_beyond_the_storage_type_is_refused(ws, tmp_path, size, file_type, refused):
    """B @ A * 2 = 8e4: finite in float32 and within Q8_0's range (65504 * 127), Inf in F16; 3.2e7 is Inf in Q8_0."""
    a, b = np.full((4, 128), size, dtype=np.float32), np.full((64, 4), size, dtype=np.float32)
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path, a=a, b=b)
    out = tmp_path / "out.gguf"
    if not refused:
        clef_gguf.convert(checkpoint, out, file_type, base=ws.release(RELEASE), mmproj=False)
        f = GGUFFile.open(out)
        assert count_nonfinite(f.tensor_bytes(TENSOR), f.header.tensors[TENSOR].type) == 0
        f.close()
        return
    with pytest.raises(NonFiniteWeightsError, match=rf"^tensor {TENSOR}: 8192 of its 8192 values become Inf stored as"):
        clef_gguf.convert(checkpoint, out, file_type, base=ws.release(RELEASE), mmproj=False)
    assert not out.exists()


def _poked(src: Path, dst: Path, tensor: str, value: bytes, at: int = 0) -> Path:
    f = GGUFFile.open(src)
    start = f.header.data_offset + f.header.tensors[tensor].offset
    f.close()
    dst.write_bytes(poke(src.read_bytes(), start + at, value))
    return dst


@pytest.mark.parametrize(
    ("file_type", "value"), [("f32", struct.pack("<f", float("nan"))), ("q8_0", struct.pack("<e", float("inf")))]
)
def test_graft_refuses_a_backbone_holding_nan(ws, tmp_path, file_type, value):
    """graft copies the backbone byte for byte: a NaN there (or an Inf scale of a Q8_0 block) is refused too."""
    f = GGUFFile.open(ws.gguf(RELEASE, file_type))
    write_backbone_gguf(f, tmp_path / "backbone.gguf")
    f.close()
    backbone = _poked(tmp_path / "backbone.gguf", tmp_path / "broken.gguf", TENSOR, value)
    expected = 1 if file_type == "f32" else 32  # a Q8_0 block of 32 values shares its scale
    with pytest.raises(NonFiniteWeightsError, match=rf"^tensor {TENSOR}: {expected} of its 8192 values are NaN or Inf"):
        graft(backbone, ws.release(RELEASE), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize(
    ("file_type", "value"), [("f32", struct.pack("<f", float("nan"))), ("q8_0", struct.pack("<e", float("nan")))]
)
def test_plain_validate_reads_the_head_values(ws, tmp_path, file_type, value):
    """Without --deep: a NaN in the head makes every decision NaN; validate says so from the head's bytes (was complete)."""
    src = ws.gguf(RELEASE, file_type)
    name = "decision.proj_memory.weight"
    f = GGUFFile.open(src)
    assert f.header.tensors[name].type == (GT.F32 if file_type == "f32" else GT.Q8_0)
    f.close()
    broken = _poked(src, tmp_path / "broken.gguf", name, value)
    report = validate(broken)
    assert report.verdict is Verdict.CORRUPT and report.exit_code == 5, report.summary
    assert f"head tensor {name} holds" in report.summary and "NaN or Inf" in report.summary, report.summary
    with pytest.raises(CorruptModelError, match=name):
        open_validated(broken)
    run = _cli("validate", broken)
    assert run.returncode == 5 and name in run.stdout + run.stderr, (run.returncode, run.stdout, run.stderr)
    # The backbone, the bulk of a file, is read by --deep only.
    backbone_nan = _poked(src, tmp_path / "backbone.gguf", TENSOR, value)
    assert validate(backbone_nan).ok and validate(backbone_nan, deep=True).verdict is Verdict.CORRUPT
