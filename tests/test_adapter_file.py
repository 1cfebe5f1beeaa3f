"""Adapter files (`convert CHECKPOINT --base R --to-adapter`): the LoRA in llama.cpp's adapter layout and the head
tensors of its own, checked against the merged conversion of the same checkpoint, and `validate` of a file and a
pair. Checkpoints are PEFT's own (get_peft_model + save_pretrained) with random lora_A / lora_B."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli  # the CLI in this process
from safetensors.numpy import load_file, save_file

import clef_gguf
from clef_gguf.check.adapter_pair import validate_adapter_pair
from clef_gguf.check.validate import validate
from clef_gguf.conversion.adapter import convert_adapter, release_fingerprint
from clef_gguf.conversion.release import open_release
from clef_gguf.errors import ConversionError
from clef_gguf.format import adapter as A
from clef_gguf.format import contract as C
from clef_gguf.format.header import GGUFFile
from clef_gguf.testing import finetune
from clef_gguf.testing.gguf_bytes import rewritten_adapter
from clef_gguf.testing.release_builder import ReleaseSpec, build_release

LANGUAGE = r".*language_model.*\."  # PEFT's target_modules as a regex: the text backbone's modules only
EVERY_LINEAR = "q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj|gate_proj|up_proj|down_proj"
PLAIN = {"r": 8, "lora_alpha": 16, "target_modules": f"{LANGUAGE}({EVERY_LINEAR})"}
RSLORA = {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": f"{LANGUAGE}(o_proj|gate_proj|in_proj_a|in_proj_b)"}
PATTERNS = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": f"{LANGUAGE}(q_proj|in_proj_qkv|in_proj_z|out_proj|down_proj)",
    "rank_pattern": {"down_proj": 2, "in_proj_z": 6},
    "alpha_pattern": {r"layers\.0\.linear_attn\.in_proj_qkv": 32, "out_proj": 5},
}
CHANGED_HEAD = ("layers.0.linear1.weight", "prior_logit_scale")
PAIRS = 4 * 3 + 3 * 5 + 4  # PLAIN on the fixture: 4 layers' MLP, 3 linear attention layers' 5 matrices, one full's 4


def _checkpoint(base: Path, out: Path, lora: dict, change_head: bool = False) -> Path:
    """A clef-finetune checkpoint: PEFT's LoRA of the given settings (random A and B) and a head (the base's, or the
    base's with CHANGED_HEAD moved)."""
    return finetune.peft_checkpoint(base, out, lora, dict.fromkeys(CHANGED_HEAD, 0.25) if change_head else None)


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32, numpy shape."""
    reader = gguf.GGUFReader(path)
    return {
        t.name: gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        for t in reader.tensors
    }


def _applied(base_gguf: Path, adapter: Path) -> dict[str, np.ndarray]:
    """The base file's tensors with the adapter applied as llama.cpp applies it: W + alpha / r * B' A'."""
    weights, lora = _tensors(base_gguf), _tensors(adapter)
    f = GGUFFile.open(adapter)
    alpha = float(f.header.get(A.KEY_ALPHA))
    f.close()
    for name in weights:
        if name + A.LORA_A in lora:
            a, b = lora[name + A.LORA_A].astype(np.float64), lora[name + A.LORA_B].astype(np.float64)
            weights[name] = weights[name] + alpha / b.shape[1] * (b @ a)
    return weights | {n: t for n, t in lora.items() if C.is_head_tensor(n)}


@pytest.fixture(scope="module")
def plain(ws, tmp_path_factory) -> tuple[Path, Path, Path]:
    """A plain checkpoint with a changed head: (checkpoint, its f32 adapter, its merged f32 conversion)."""
    root, base = tmp_path_factory.mktemp("adapter"), ws.release("untied_f32")
    checkpoint = _checkpoint(base, root, PLAIN, change_head=True)
    adapter = convert_adapter(checkpoint, base, root / "plain-f32.adapter.gguf", "f32")
    merged = clef_gguf.convert(checkpoint, root / "merged-f32.gguf", "f32", base=base, mmproj=False)
    return checkpoint, adapter, merged


@pytest.fixture(scope="module")
def other_base(tmp_path_factory) -> Path:
    """A release of the fixture's shapes with other weights (another seed), converted to f32."""
    root = tmp_path_factory.mktemp("other")
    release = build_release(root / "release", ReleaseSpec(seed=7, vision=False))
    return clef_gguf.convert(release, root / "other-f32.gguf", "f32", mmproj=False)


def _close(ours: dict[str, np.ndarray], merged: Path) -> None:
    theirs = _tensors(merged)
    assert set(ours) >= {n for n in theirs if not C.is_head_tensor(n)}
    worst = max(float(np.abs(ours[n] - theirs[n]).max()) for n in theirs if not C.is_head_tensor(n))
    assert worst < 1e-5


@pytest.mark.slow
def test_the_plain_adapter_over_its_base_is_the_merged_conversion(ws, plain):
    checkpoint, adapter, merged = plain
    applied = _applied(ws.gguf("untied_f32", "f32"), adapter)
    _close(applied, merged)
    lora = _tensors(adapter)  # (read once: a read per base tensor took a minute)
    moved = [n for n in _tensors(ws.gguf("untied_f32", "f32")) if n + A.LORA_A in lora]
    assert len(moved) == PAIRS
    # The factor is exactly 1: lora_b is PEFT's lora_B, byte for byte, where no transform reorders it.
    peft = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    b = peft["base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.weight"]
    assert np.array_equal(lora["blk.0.ffn_down.weight.lora_b"], b)


@pytest.mark.parametrize("lora", [pytest.param(RSLORA, id="rslora"), pytest.param(PATTERNS, id="patterns")])
def test_rslora_and_patterns_fold_their_scales_into_b(ws, tmp_path, lora):
    base = ws.release("untied_f32")
    checkpoint = _checkpoint(base, tmp_path, lora)
    adapter = convert_adapter(checkpoint, base, tmp_path / "a.adapter.gguf", "f32")
    merged = clef_gguf.convert(checkpoint, tmp_path / "merged.gguf", "f32", base=base, mmproj=False)
    before = _tensors(ws.gguf("untied_f32", "f32"))
    applied = _applied(ws.gguf("untied_f32", "f32"), adapter)
    _close(applied, merged)
    assert sum(not np.array_equal(applied[n], before[n]) for n in before) >= 4
    ranks = {t.shape[1] for n, t in _tensors(adapter).items() if n.endswith(A.LORA_B)}
    assert ranks == ({2, 4, 6} if "rank_pattern" in lora else {4})


def test_only_the_head_tensors_that_changed_are_stored(ws, plain):
    _, adapter, merged = plain
    ours, theirs, base = _tensors(adapter), _tensors(merged), _tensors(ws.gguf("untied_f32", "f32"))
    changed = {n for n in theirs if C.is_head_tensor(n) and not np.array_equal(theirs[n], base[n])}
    assert changed == {n for n in ours if C.is_head_tensor(n)} == {"dec.blk.1.ffn_up.weight", C.SCALES}
    assert all(np.array_equal(ours[n], theirs[n]) for n in changed)


def test_an_unchanged_head_stores_none(ws, tmp_path):
    base = ws.release("untied_f32")
    checkpoint = _checkpoint(base, tmp_path, RSLORA)
    adapter = convert_adapter(checkpoint, base, tmp_path / "a.adapter.gguf")
    assert not any(C.is_head_tensor(n) for n in _tensors(adapter))
    report = validate(adapter)
    assert report.ok and "head: 0 tensors of its own" in report.summary


def test_the_fingerprint_is_the_same_from_the_release_and_every_conversion(ws, other_base):
    release = ws.release("untied_f32")
    fingerprints = set()
    for file_type in ("f32", "q8_0"):
        f = GGUFFile.open(ws.gguf("untied_f32", file_type))
        fingerprints.add(A.model_fingerprint(f))
        f.close()
    assert fingerprints == {release_fingerprint(open_release(release))}
    f = GGUFFile.open(other_base)
    assert A.model_fingerprint(f) not in fingerprints
    f.close()


@pytest.mark.parametrize("file_type", ["f16", "q8_0"])
@pytest.mark.slow
def test_f16_and_q8_0_adapters_validate_and_stay_close(ws, plain, tmp_path, file_type):
    checkpoint, _, merged = plain
    adapter = convert_adapter(checkpoint, ws.release("untied_f32"), tmp_path / f"{file_type}.adapter.gguf", file_type)
    reader = gguf.GGUFReader(adapter)
    types = {t.name: t.tensor_type for t in reader.tensors}
    want = gguf.GGMLQuantizationType.F16 if file_type == "f16" else gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.ffn_up.weight.lora_a"] == want  # (8, 64): whole q8_0 blocks
    assert types["blk.0.ffn_up.weight.lora_b"] == gguf.GGMLQuantizationType.F16  # (128, 8): rows of 8, F16's fallback
    report = validate(adapter)
    assert report.ok, report.summary
    assert report.summary.startswith(f"an adapter for a Clef base: {PAIRS} LoRA pairs")
    assert validate_adapter_pair(ws.gguf("untied_f32", "q8_0"), adapter).exit_code == 0
    applied, reference = _applied(ws.gguf("untied_f32", "f32"), adapter), _tensors(merged)
    worst = max(float(np.abs(applied[n] - reference[n]).max()) for n in reference if not C.is_head_tensor(n))
    assert 0 < worst < (0.01 if file_type == "f16" else 0.05)


def test_validate_pairs_an_adapter_with_its_base_only(ws, plain, other_base, tmp_path):
    _, adapter, _ = plain
    for file_type in ("f32", "q8_0"):
        assert validate_adapter_pair(ws.gguf("untied_f32", file_type), adapter).exit_code == 0
    refused = validate_adapter_pair(other_base, adapter)
    assert refused.exit_code == 7 and "trained over another base (fingerprint" in refused.summary
    done = run_cli("validate", str(other_base), "--adapter", str(adapter), "--json")
    assert done.returncode == 7, done.stderr
    assert "trained over another base" in json.loads(done.stdout)["pairing"]["problems"][0]
    swapped = validate_adapter_pair(adapter, ws.gguf("untied_f32", "f32"))
    assert swapped.exit_code == 6


@pytest.mark.slow
def test_validate_refuses_an_adapter_whose_shapes_do_not_fit_the_base(ws, plain, tmp_path):
    _, adapter, _ = plain
    a = _tensors(adapter)["blk.0.ffn_up.weight.lora_a"]
    wider = rewritten_adapter(adapter, tmp_path / "wider.adapter.gguf", {"blk.0.ffn_up.weight.lora_a": np.hstack([a, a])})
    assert validate(wider).ok  # consistent in itself
    refused = validate_adapter_pair(ws.gguf("untied_f32", "f32"), wider)
    assert refused.exit_code == 7 and "blk.0.ffn_up.weight is [128, 64] in the base" in refused.summary
    b = _tensors(adapter)["blk.0.ffn_up.weight.lora_b"]
    unpaired = rewritten_adapter(adapter, tmp_path / "rank.adapter.gguf", {"blk.0.ffn_up.weight.lora_b": b[:, :4].copy()})
    report = validate(unpaired)
    assert report.exit_code == 7 and "both must have one rank r" in report.summary


def test_the_llama_server_variant_holds_only_lora_tensors(ws, plain, tmp_path):
    checkpoint, adapter, _ = plain
    out = tmp_path / "server.adapter.gguf"
    done = run_cli("convert", checkpoint, "--base", ws.release("untied_f32"), "--to-adapter", "--llama-server", "-o", out)
    assert done.returncode == 0, done.stderr
    f = GGUFFile.open(out)
    names, keys = set(f.header.tensors), set(f.header.fields)
    assert names and all(A.lora_target(n) for n in names)
    assert names == {n for n in _tensors(adapter) if A.lora_target(n)}
    assert not any(k.startswith(("clef.decision.", "clef.attention.", "clef.reference.")) for k in keys)
    assert f.header.get(gguf.Keys.General.ARCHITECTURE) == C.ARCH and f.header.get(A.KEY_GENERAL_TYPE) == "adapter"
    f.close()
    report = validate(out)
    assert report.ok and "no head" in report.summary
    assert validate_adapter_pair(ws.gguf("untied_f32", "f32"), out).exit_code == 0


def test_a_target_llama_cpp_cannot_adapt_is_refused(ws, tmp_path):
    base = ws.release("untied_f32")
    checkpoint = _checkpoint(base, tmp_path, {"r": 2, "lora_alpha": 4, "target_modules": ["lm_head"]})
    weights = checkpoint / "adapter" / "adapter_model.safetensors"  # PEFT saves lm_head itself too: the LoRA alone
    save_file({n: t for n, t in load_file(weights).items() if ".lora_" in n}, weights)
    with pytest.raises(ConversionError, match="lm_head.weight, which llama.cpp applies no LoRA to"):
        convert_adapter(checkpoint, base, tmp_path / "x.adapter.gguf")
    assert not (tmp_path / "x.adapter.gguf").exists()
    shutil.rmtree(checkpoint)


@pytest.mark.slow
def test_damaged_adapter_headers_get_a_one_line_report(ws, plain, tmp_path):
    """Validate and the pairing never raise on an adapter whose header's counts, lengths, types and values are poked."""
    _, adapter, _ = plain
    data = adapter.read_bytes()
    f = GGUFFile.open(adapter)
    points = sorted({p for field in f.header.fields.values() for p in (field.start, field.value_start, field.end - 4)})
    points += sorted({p for t in f.header.tensors.values() for p in (t.start + 8, t.end - 20, t.end - 12, t.end - 8)})
    f.close()
    rng, damaged, verdicts = np.random.default_rng(0), tmp_path / "damaged.adapter.gguf", set()
    for _ in range(300):
        buf = bytearray(data)
        for _ in range(int(rng.integers(1, 3))):
            at = int(rng.choice(points))
            buf[at : at + 4] = int(rng.choice([0, 1, 7, 8, 255, 2**31, 2**32 - 1])).to_bytes(4, "little")
        damaged.write_bytes(bytes(buf))
        report = validate(damaged)
        assert "\n" not in report.summary and report.seconds < 5
        verdicts.add(report.verdict)
        validate_adapter_pair(ws.gguf("untied_f32", "f32"), damaged)
    assert len(verdicts) >= 2


@pytest.mark.slow
def test_a_clef_finetune_checkpoint_as_an_adapter_is_its_merged_conversion(ws, tmp_path):
    """clef-finetune's own `train` (its target discovery, its names, a trained head): adapter over base = merge."""
    from clef_gguf.testing import finetune

    base = ws.release("untied_f32")
    checkpoint = finetune.train(base, Path(__file__).resolve().parent.parent / "examples" / "labelled.jsonl", tmp_path / "run")
    adapter = convert_adapter(checkpoint, base, tmp_path / "tuned.adapter.gguf", "f32")
    merged = clef_gguf.convert(checkpoint, tmp_path / "merged.gguf", "f32", base=base, mmproj=False)
    applied = _applied(ws.gguf("untied_f32", "f32"), adapter)
    _close(applied, merged)
    theirs = _tensors(merged)
    head = {n for n in _tensors(adapter) if C.is_head_tensor(n)}
    assert head and all(np.array_equal(applied[n], theirs[n]) for n in head)
    assert validate_adapter_pair(ws.gguf("untied_f32", "q8_0"), adapter).exit_code == 0


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--llama-server"], 2, "--llama-server is a variant of --to-adapter"),
        (["--to-adapter", "--no-base"], 2, "give the release it was trained from with --base"),
        (["--adapter", "--no-base"], 2, "convert --adapter is now --to-adapter"),  # (the old spelling, for one release)
        (["--to-adapter", "-t", "q4_k_m"], 4, "an adapter's --type is one of f32, f16, q8_0"),
    ],
)
def test_adapter_options_that_cannot_work_are_one_line_errors(ws, plain, tmp_path, args, code, message):
    checkpoint, _, _ = plain
    base = [] if "--no-base" in args else ["--base", str(ws.release("untied_f32"))]
    args = [a for a in args if a != "--no-base"]
    out = tmp_path / "x.adapter.gguf"
    done = run_cli("convert", str(checkpoint), *base, *args, "-o", str(out))
    assert done.returncode == code and message in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
