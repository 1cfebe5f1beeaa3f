"""Users' own Clef: a fixture release fine-tuned by clef-finetune's own `train`, converted straight from the
checkpoint (`convert CHECKPOINT --base`), then measured by `eval` and `compare` against clef-finetune's own
`merge` and `eval` (clef_gguf/testing/finetune.py runs them)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli  # the CLI in this process

import clef_gguf
from clef_gguf.errors import ReleaseError
from clef_gguf.quality.labelled import BadLine, read_labelled
from clef_gguf.testing import finetune

pytestmark = pytest.mark.slow  # clef-finetune's train, merge and eval: minutes

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "labelled.jsonl"


class FineTune:
    def __init__(self, ws, root: Path) -> None:
        self.base = ws.release("untied_f32")
        self.checkpoint = finetune.train(self.base, DATA, root / "run")
        self.merged = finetune.merge(self.base, self.checkpoint, root / "merged")
        self.root = root

    def gguf(self, name: str, file_type: str = "f32") -> Path:
        out = self.root / f"{name}-{file_type}.gguf"
        if not out.exists():
            if name == "checkpoint":
                clef_gguf.convert(self.checkpoint, out, file_type, base=self.base, mmproj=False)
            else:
                clef_gguf.convert(self.base if name == "base" else self.merged, out, file_type, mmproj=False)
        return out


@pytest.fixture(scope="module")
def tuned(ws, tmp_path_factory) -> FineTune:
    return FineTune(ws, tmp_path_factory.mktemp("finetune"))


def _requests() -> list[dict]:
    with open(DATA, "rb") as file:
        return [r.request for r in read_labelled(file) if not isinstance(r, BadLine)]


def _probabilities(path: Path) -> list[list[np.ndarray]]:
    with clef_gguf.load(path, max_prompt_tokens=4096) as model:
        return [model.score_batch([model.encode(r)])[0].probabilities for r in _requests()]


def test_a_checkpoint_converts_to_what_merge_converts_to(tuned):
    """convert CHECKPOINT --base decides as the conversion of clef-finetune merge's folder, within 1e-4 at f32."""
    ours, merged, base = (_probabilities(tuned.gguf(n)) for n in ("checkpoint", "merged", "base"))
    diff = max(float(np.abs(a - b).max()) for x, y in zip(ours, merged, strict=True) for a, b in zip(x, y, strict=True))
    moved = max(float(np.abs(a - b).max()) for x, y in zip(ours, base, strict=True) for a, b in zip(x, y, strict=True))
    assert diff < 1e-4
    assert moved > 0.02, "the fine-tune did not move the answers: the test could not tell a merge from none"


def test_the_merged_tensors_are_peft_s(tuned):
    """Tensor by tensor, the streamed merge equals PEFT's merge_and_unload (both float32)."""
    ours = {t.name: np.array(t.data) for t in gguf.GGUFReader(tuned.gguf("checkpoint")).tensors}
    theirs = {t.name: np.array(t.data) for t in gguf.GGUFReader(tuned.gguf("merged")).tensors}
    assert ours.keys() == theirs.keys()
    worst = max(float(np.abs(ours[n].astype(np.float64) - theirs[n]).max()) for n in ours)
    assert worst < 1e-6


@pytest.mark.parametrize(
    "lora",
    [
        pytest.param(
            {
                "r": 4,
                "lora_alpha": 8,
                "target_modules": ["q_proj", "v_proj", "in_proj_qkv", "down_proj"],
                "rank_pattern": {"down_proj": 2},
                "alpha_pattern": {r"layers\.0\.linear_attn\.in_proj_qkv": 32},
            },
            id="patterns",
        ),
        pytest.param({"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj", "o_proj"], "use_rslora": True}, id="rslora"),
        pytest.param({"r": 2, "lora_alpha": 3, "target_modules": ["up_proj"], "fan_in_fan_out": True}, id="fan_in_fan_out"),
    ],
)
def test_adapter_settings_merge_as_peft_merges_them(ws, tmp_path, lora):
    base = ws.release("untied_f32")
    merged = tmp_path / "merged"
    checkpoint = finetune.peft_checkpoint(base, tmp_path, lora, merged=merged)
    ours = clef_gguf.convert(checkpoint, tmp_path / "ours.gguf", "f32", base=base, mmproj=False)
    theirs = clef_gguf.convert(merged, tmp_path / "theirs.gguf", "f32", mmproj=False)
    before = {t.name: np.array(t.data) for t in gguf.GGUFReader(ws.gguf("untied_f32", "f32")).tensors}
    a = {t.name: np.array(t.data) for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: np.array(t.data) for t in gguf.GGUFReader(theirs).tensors}
    assert max(float(np.abs(a[n].astype(np.float64) - b[n]).max()) for n in a) < 1e-5
    assert sum(not np.array_equal(a[n], before[n]) for n in a) > 0


def test_a_configuration_trained_already_is_copied_naming_its_own_folders(tuned, tmp_path):
    """finetune.train trains each configuration once per session (test_adapters, test_adapter_file and test_readme
    ask for this one again): the same checkpoint, its train_config.json naming this call's release and output folder,
    without a training (which takes a minute and more)."""
    release = Path(shutil.copytree(tuned.base, tmp_path / "release"))  # the same files under another name
    started = time.monotonic()
    again = finetune.train(release, DATA, tmp_path / "again")
    assert time.monotonic() - started < 2  # a copy takes milliseconds; a training's process takes seconds to import torch
    for name in ("adapter/adapter_model.safetensors", "joint_head.safetensors"):
        assert (again / name).read_bytes() == (tuned.checkpoint / name).read_bytes(), name
    config = json.loads((again / "train_config.json").read_text())
    assert (config["model"]["path"], config["output_dir"]) == (str(release), str(tmp_path / "again"))
    assert str(tuned.base) not in (again / "train_config.json").read_text()


def test_a_checkpoint_without_base_names_the_fix(tuned, tmp_path):
    done = run_cli("convert", str(tuned.checkpoint), "-o", str(tmp_path / "x.gguf"))
    assert done.returncode == 3
    assert "--base" in done.stderr and str(tuned.base) in done.stderr  # train_config.json's model.path
    assert "Traceback" not in done.stderr and not (tmp_path / "x.gguf").exists()


def _copy_checkpoint(tuned, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tuned.checkpoint, tmp_path / "checkpoint"))


def test_refusals_name_the_fix(ws, tuned, tmp_path):
    out = tmp_path / "x.gguf"
    with pytest.raises(ReleaseError, match="does not fit the base release"):
        clef_gguf.convert(tuned.checkpoint, out, "f32", base=ws.release("k256"), mmproj=False)
    with pytest.raises(ReleaseError, match="--base is for a clef-finetune checkpoint"):
        clef_gguf.convert(tuned.base, out, "f32", base=tuned.base, mmproj=False)
    dora = _copy_checkpoint(tuned, tmp_path)
    config = json.loads((dora / "adapter" / "adapter_config.json").read_text())
    (dora / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ReleaseError, match="use_dora = true cannot be merged here.*clef-finetune merge"):
        clef_gguf.convert(dora, out, "f32", base=tuned.base, mmproj=False)
    shutil.rmtree(dora)
    headless = _copy_checkpoint(tuned, tmp_path)
    (headless / "joint_head.safetensors").unlink()
    with pytest.raises(ReleaseError, match="joint_head.safetensors is missing"):
        clef_gguf.convert(headless, out, "f32", base=tuned.base, mmproj=False)
    assert not out.exists()


def test_eval_equals_clef_finetune_eval(tuned, tmp_path):
    """The same metrics, names and shape as clef-finetune's tuned_metrics.json, within 0.01 (both float32)."""
    theirs = finetune.evaluate(tuned.merged, DATA, tmp_path / "theirs")["metrics"]
    done = run_cli("eval", str(tuned.gguf("checkpoint")), str(DATA), "--json", "-o", str(tmp_path / "ours"))
    assert done.returncode == 0, done.stderr
    ours = json.loads(done.stdout)["metrics"]
    assert json.loads((tmp_path / "ours" / "metrics.json").read_text())["metrics"] == ours

    def compare(a, b, where="metrics"):
        if isinstance(a, dict):
            assert set(a) == set(b), where
            for k in a:
                compare(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, float):
            assert abs(a - b) <= 0.01, where
        else:
            assert a == b, where

    compare(theirs, ours)
    assert ours["overall"]["n"] == 72 and set(ours["per_question"]) == {"complaint", "intent", "urgency"}
    predictions = [json.loads(line) for line in (tmp_path / "ours" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 72 and set(predictions[0]) == {"record_id", "question_id", "type", "option_ids", "probs", "target"}
    assert predictions[1]["option_ids"] == ["question", "refund", "replacement"]  # sorted, as clef-finetune's
    for qtype in ("noul", "choice", "score"):
        assert (tmp_path / "ours" / f"reliability-{qtype}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_counts_are_those_of_decide_s_answers(tuned, tmp_path):
    done = run_cli("compare", str(tuned.gguf("base")), str(tuned.gguf("checkpoint")), str(DATA), "--json", "-o", str(tmp_path))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (tmp_path / "report.md").is_file() and "metrics" in result  # the data is labelled: both models' metrics

    def tops(path: Path) -> list[dict[str, str]]:
        with clef_gguf.load(path, max_prompt_tokens=4096) as model:
            out = []
            for request in _requests():
                answers = model.decide(request)["answers"]
                out.append({q: _top(a) for q, a in answers.items()})
            return out

    a, b = tops(tuned.gguf("base")), tops(tuned.gguf("checkpoint"))
    types = {q: spec["type"] for q, spec in _requests()[0]["questions"].items()}
    changed: dict[str, int] = {}
    for x, y in zip(a, b, strict=True):
        for q in x:
            changed[types[q]] = changed.get(types[q], 0) + (x[q] != y[q])
    assert {t: c["changed"] for t, c in result["changes"]["per_type"].items()} == changed
    assert result["changes"]["overall"]["changed"] == sum(changed.values()) > 0
    assert result["changes"]["overall"]["n"] == 72


def _top(answer: dict) -> str:
    if answer["type"] == "noul":
        return "true" if answer["noul"] >= 0.5 else "false"
    if answer["type"] == "choice":
        return answer["choice"]
    probabilities = answer["probabilities"]
    return max(probabilities, key=probabilities.__getitem__)


def test_bad_labels_are_reported_with_line_numbers(tuned, tmp_path):
    lines = DATA.read_text().splitlines()[:4]
    bad = [json.loads(line) for line in lines[:3]]
    bad[0]["labels"]["intent"] = "exchange"
    bad[1]["labels"]["urgency"] = 3
    bad[2]["labels"]["mood"] = "angry"
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join([*map(json.dumps, bad), "{not json", lines[3]]) + "\n")
    done = run_cli("eval", str(tuned.gguf("checkpoint")), str(data), "--json")
    assert done.returncode == 8, done.stderr  # some lines are errors; the others were counted
    result = json.loads(done.stdout)
    assert result["metrics"]["overall"]["n"] == 3
    assert (
        result["errors"][0]
        == "line 1 (t01): intent: choice label 'exchange' not in options ['question', 'refund', 'replacement']"
    )
    assert result["errors"][1] == "line 2 (t02): urgency: score label 3 outside 0..2"
    assert result["errors"][2] == "line 3 (t03): label for unknown question 'mood'"
    assert result["errors"][3].startswith("line 4 (?): invalid JSON")
    assert "Traceback" not in done.stderr
