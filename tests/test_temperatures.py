"""Softmax temperatures, llama.cpp's way: `clef.decision.temperature.<type>[.<bucket>]` applied as
llama-server applies them (tools/server/server-decision.cpp:682-700, rendered in numpy below, independently of the
package), refused by validate when not a finite number > 0, and fitted by `calibrate`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli  # the CLI in this process

import clef_gguf
from clef_gguf.check.validate import validate
from clef_gguf.conversion.rekey import rekey
from clef_gguf.errors import IncompleteModelError
from clef_gguf.testing.request_suite import temperature_buckets_request

PREFIX = "clef.decision.temperature."
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "labelled.jsonl"
# A key at every bucket of choice; score by its fallback (3 levels) and a bucket (7 levels); noul by its type.
KEYS = {"choice.2": 0.5, "choice.3_5": 2.5, "choice.6_10": 0.8, "choice.11": 1.7, "noul": 0.6, "score": 1.9, "score.6_10": 0.7}


def llama_server_probabilities(scores: np.ndarray, qtype: str, keys: dict[str, float]) -> np.ndarray:
    """server_decision_context::get_temperature and format_answer's softmax, one variant."""
    n = len(scores)
    bucket = "2" if n <= 2 else "3_5" if n <= 5 else "6_10" if n <= 10 else "11"
    temperature = next((keys[name] for name in (f"{qtype}.{bucket}", qtype) if name in keys), 1.0)
    p = np.exp((scores.astype(np.float64) - scores.max()) / np.float32(temperature))
    return p / p.sum()


@pytest.fixture(scope="module")
def keyed(ws, tmp_path_factory) -> Path:
    keys = {PREFIX + k: v for k, v in KEYS.items()}
    return rekey(ws.gguf("untied_f32", "f32"), tmp_path_factory.mktemp("keyed") / "keyed.gguf", keys)


@pytest.mark.slow
def test_every_bucket_boundary_follows_llama_server_s_rule(ws, keyed):
    plain = ws.model("untied_f32", "f32")
    request = temperature_buckets_request()
    [scores] = plain.score_batch([plain.encode(request)])
    types = {qid: q["type"] for qid, q in request["questions"].items()}
    with clef_gguf.load(keyed, max_prompt_tokens=8192) as model:
        [tempered] = model.score_batch([model.encode(request)])
        answers = model.decide(request)["answers"]
    moved = 0.0
    for qid, z, p, p_plain in zip(scores.questions, scores.logits, tempered.probabilities, scores.probabilities, strict=True):
        want = llama_server_probabilities(z, types[qid], KEYS)
        assert np.abs(p - want).max() < 1e-9, qid
        moved = max(moved, float(np.abs(p - p_plain).max()))
    assert moved > 0.05  # the keys change the answers: the comparison could fail
    # The confidences follow from the tempered probabilities (TypeSafe's formula, as llama-server's).
    p = tempered.probabilities[scores.questions.index("c3")]
    assert answers["c3"]["confidence"] == round((p.max() - 1 / 3) / (1 - 1 / 3), 4)


def test_the_keys_change_no_tensor_and_validate_lists_them(ws, keyed):
    original = gguf.GGUFReader(ws.gguf("untied_f32", "f32"))
    copy = gguf.GGUFReader(keyed)
    assert [t.name for t in copy.tensors] == [t.name for t in original.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(original.tensors, copy.tensors, strict=True))
    report = validate(keyed)
    assert report.ok and report.temperatures == pytest.approx(KEYS, rel=1e-7)  # float32 in the file
    assert list(report.temperatures) == sorted(KEYS)
    done = run_cli("validate", str(keyed), "--json")
    assert json.loads(done.stdout)["temperatures"] == report.temperatures


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_validate_and_load_refuse_a_temperature_that_is_not_a_finite_positive_number(ws, tmp_path, value):
    path = rekey(ws.gguf("untied_f32", "f32"), tmp_path / "bad.gguf", {PREFIX + "choice": value})
    done = run_cli("validate", str(path))
    assert done.returncode == 7
    assert f"{PREFIX}choice = {value!r}: a temperature must be a finite number > 0" in done.stdout
    with pytest.raises(IncompleteModelError, match=f"{PREFIX}choice"):
        clef_gguf.load(path)


def test_a_key_no_question_can_use_is_a_note(ws, tmp_path):
    path = rekey(ws.gguf("untied_f32", "f32"), tmp_path / "odd.gguf", {PREFIX + "noul.11": 2.0, PREFIX + "scroe": 2.0})
    report = validate(path)
    assert report.ok
    assert sum("is used by no question" in note for note in report.notes) == 2


@pytest.mark.slow
def test_calibrate_lowers_nll_and_eval_sees_the_calibrated_file(ws, tmp_path):
    model = ws.gguf("untied_f32", "f32")
    out = tmp_path / "calibrated.gguf"
    done = run_cli("calibrate", str(model), str(DATA), "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["temperatures"]) == {"noul", "choice", "score"}  # 24 labelled questions each: >= 20
    assert result["after"]["fit"]["nll"] < result["before"]["fit"]["nll"]
    evaluated = run_cli("eval", str(out), str(DATA), "--json")
    assert json.loads(evaluated.stdout)["metrics"]["overall"]["nll"] == pytest.approx(result["after"]["fit"]["nll"], abs=1e-9)
    assert validate(out).temperatures == pytest.approx(result["temperatures"])
    again = run_cli("calibrate", str(model), str(DATA), "-o", str(out))
    assert again.returncode == 9 and "--force" in again.stderr  # an existing output is not overwritten
    in_place = run_cli("calibrate", str(model), str(DATA), "-o", str(model), "--force")
    assert in_place.returncode != 0 and validate(model).temperatures == {}


def test_a_held_out_part_is_measured_apart(ws, tmp_path):
    out = tmp_path / "calibrated.gguf"
    done = run_cli("calibrate", ws.gguf("untied_f32", "f32"), DATA, "-o", out, "--holdout", "0.3", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["before"]["holdout"]["n"] + result["before"]["fit"]["n"] == 72
    assert result["before"]["holdout"]["n"] > 0 and set(result["after"]) == {"fit", "holdout"}
