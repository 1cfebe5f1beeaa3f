"""A model's identity covers its weights: a base and its fine-tunes converted to the same type share
their header (but for the release digest clef-gguf records, absent from llama.cpp's conversions), not their identity,
so their prompts and answers files never mix; a copy of a file is the same model."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli
from safetensors.numpy import load_file, save_file

import clef_gguf
from clef_gguf.conversion.rekey import rekey
from clef_gguf.data import DEMO_CONTEXT, DEMO_REQUEST
from clef_gguf.errors import RequestError
from clef_gguf.format.header import IDENTITY_WINDOW, GGUFFile
from clef_gguf.format.lineage import KEY_SOURCE_BASE_DIGEST, KEY_SOURCE_DIGEST, KEY_SOURCE_MERGED, KEY_SOURCE_VISION
from clef_gguf.testing.gguf_bytes import rebuild

BASE = "k256"  # its MLP matrices (512 KiB in f32) are over the sample's 64 KiB: the identity samples them
ADAPTED = "model.language_model.layers.1.mlp.down_proj.weight"
DEMO = json.loads(DEMO_REQUEST.read_text())


def _fine_tune(release: Path, out: Path, seed: int) -> Path:
    """A copy of `release` whose ADAPTED matrix has a merged rank-4 LoRA (every element moves, as a LoRA's do), in a
    folder of the same name (general.name is the folder's)."""
    out = Path(shutil.copytree(release, out / release.name))
    weights = load_file(out / "model.safetensors")
    w = weights[ADAPTED]
    rng = np.random.default_rng(seed)
    delta = rng.standard_normal((w.shape[0], 4)) @ rng.standard_normal((4, w.shape[1])) * 0.01
    weights[ADAPTED] = (w + delta).astype(w.dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _identities(*paths: Path) -> list[tuple[str, str]]:
    """(header digest, identity) of each file."""
    found = []
    for path in paths:
        f = GGUFFile.open(path)
        try:
            found.append((f.digest(), f.identity()))
        finally:
            f.close()
    return found


@pytest.fixture(scope="module")
def tunes(ws, tmp_path_factory) -> tuple[Path, Path]:
    """Two fine-tunes of BASE (two seeds of one LoRA), converted to f32 as ws.gguf(BASE, "f32") is."""
    root = tmp_path_factory.mktemp("tunes")
    return tuple(  # type: ignore[return-value]
        clef_gguf.convert(_fine_tune(ws.release(BASE), root / f"tune{seed}", seed), root / f"tune{seed}.gguf", "f32")
        for seed in (1, 2)
    )


def _as_foreign(path: Path, out_dir: Path) -> Path:
    """The file without clef-gguf's lineage keys (clef.source.*: its release's weights digest, in the header), as
    llama.cpp's converter writes one: then the header alone cannot tell a base from its fine-tunes."""
    drop = {KEY_SOURCE_DIGEST, KEY_SOURCE_MERGED, KEY_SOURCE_BASE_DIGEST, KEY_SOURCE_VISION}
    return rebuild(path, out_dir / f"foreign-{path.name}", drop_keys=drop)


def test_a_base_and_its_fine_tunes_share_the_header_not_the_identity(ws, tunes, tmp_path):
    base = ws.gguf(BASE, "f32")
    (base_header, base_id), (header_1, id_1), (header_2, id_2) = _identities(*(_as_foreign(p, tmp_path) for p in (base, *tunes)))
    assert base_header == header_1 == header_2  # the same layout and type: only the weights tell them apart
    assert len({base_id, id_1, id_2}) == 3


def test_a_calibrated_base_and_fine_tune_differ_and_each_differs_from_its_source(ws, tunes, tmp_path):
    keys = {"clef.decision.temperature.choice": 1.5}
    base, tune = (_as_foreign(p, tmp_path) for p in (ws.gguf(BASE, "f32"), tunes[0]))
    calibrated = [rekey(source, tmp_path / f"calibrated{i}.gguf", keys) for i, source in enumerate((base, tune))]
    (_, base_id), (_, tune_id), (base_header, cal_base), (tune_header, cal_tune) = _identities(base, tune, *calibrated)
    assert base_header == tune_header  # the same keys on the same layout
    assert len({base_id, tune_id, cal_base, cal_tune}) == 4


def test_a_change_anywhere_in_a_head_tensor_or_a_sampled_window_changes_the_identity(tmp_path):
    """Any GGUF (an adapter's too): a head tensor hashed whole, another sampled (its last window included)."""
    rng = np.random.default_rng(0)
    tensors = {"decision.scorer.weight": rng.standard_normal((256, 512)), "blk.0.ffn_up.weight": rng.standard_normal((256, 512))}

    def write(name: str, edit: tuple[str, int] | None = None) -> Path:
        w = gguf.GGUFWriter(tmp_path / name, "clef")
        for key, value in tensors.items():
            data = value.astype(np.float32).ravel()
            if edit is not None and edit[0] == key:
                data[edit[1]] += 1.0
            w.add_tensor(key, data.reshape(value.shape))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    middle_of_a_gap = (256 * 512 * 4 // 15 // 2 + IDENTITY_WINDOW) // 4  # between the first two windows: not sampled
    edits = [None, ("decision.scorer.weight", middle_of_a_gap), ("blk.0.ffn_up.weight", 256 * 512 - 1)]
    found = _identities(*(write(f"{i}.gguf", edit) for i, edit in enumerate(edits)))
    assert len({header for header, _ in found}) == 1
    assert len({identity for _, identity in found}) == 3


def test_a_prompt_encoded_by_the_base_is_refused_by_a_fine_tune_and_taken_by_a_copy(ws, tunes, tmp_path):
    base = ws.model(BASE, "f32")
    prompt = base.encode(DEMO)
    copy = shutil.copyfile(ws.gguf(BASE, "f32"), tmp_path / "copy.gguf")
    with clef_gguf.load(copy, max_prompt_tokens=DEMO_CONTEXT) as same:
        assert same.identity == base.identity
        assert same.decide(prompt)["answers"] == base.decide(prompt)["answers"]
    with clef_gguf.load(tunes[0], max_prompt_tokens=DEMO_CONTEXT) as tune:
        assert tune.identity != base.identity
        with pytest.raises(RequestError, match="encoded by another model"):
            tune.decide(prompt)


def _lines(n: int) -> str:
    return "".join(json.dumps({**DEMO, "id": f"r{i}", "state": {"ticket": f"ticket {i}"}}) + "\n" for i in range(n))


def _decide(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("decide", "--ctx", str(DEMO_CONTEXT), model, *args)  # in this process


def test_resuming_a_base_s_answers_with_its_fine_tune_is_refused(ws, tunes, tmp_path):
    source = tmp_path / "requests.jsonl"
    source.write_text(_lines(2))
    out = tmp_path / "answers.jsonl"
    base = ws.gguf(BASE, "f32")
    assert _decide(base, str(source), "-o", str(out)).returncode == 0
    source.write_text(_lines(3))
    before = out.read_text()
    other = _decide(tunes[0], str(source), "-o", str(out), "--resume")
    assert other.returncode == 2, other.stderr
    [(_, base_id)] = _identities(base)
    assert "decided by another model" in other.stderr and f"model_sha256 {base_id[:12]}" in other.stderr
    assert out.read_text() == before


def test_resuming_an_older_clef_gguf_s_answers_names_the_reason(ws, tmp_path):
    """Answers whose model_sha256 is the header-only digest (what clef-gguf wrote before) cannot tell the weights."""
    base = ws.gguf(BASE, "f32")
    source = tmp_path / "requests.jsonl"
    source.write_text(_lines(2))
    out = tmp_path / "answers.jsonl"
    assert _decide(base, str(source), "-o", str(out)).returncode == 0
    [(header, identity)] = _identities(base)
    older = out.read_text().replace(identity, header)
    assert older != out.read_text()
    out.write_text(older)
    resumed = _decide(base, str(source), "-o", str(out), "--resume")
    assert resumed.returncode == 2, resumed.stderr
    assert "older clef-gguf" in resumed.stderr and "header only" in resumed.stderr
    assert out.read_text() == older
