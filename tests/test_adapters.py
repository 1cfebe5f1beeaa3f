"""Many fine-tunes over one base (runtime/decider.py): two fine-tunes of one fixture release made by clef-finetune's
own `train` (ranks 8 and 4, each with its trained head) and a PEFT adapter with a rank_pattern, each converted to an
adapter file and to a merged model file; the base loaded with the three adapters answers as each merged file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli  # the CLI in this process

import clef_gguf
from clef_gguf.check.adapter_pair import validate_adapter_pair
from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.errors import AdapterBaseError, RequestError
from clef_gguf.testing import finetune
from clef_gguf.testing.release_builder import ReleaseSpec, build_release
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests

pytestmark = pytest.mark.slow  # two clef-finetune trainings

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "labelled.jsonl"
PATTERN = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": r".*language_model.*\.(q_proj|in_proj_qkv|in_proj_z|out_proj|down_proj|up_proj)",
    "rank_pattern": {"down_proj": 2, "in_proj_z": 6},
    "alpha_pattern": {"out_proj": 5},
}
CONTEXT = 4096
ROUNDED = 1e-4 + 1e-9  # answers are rounded to 4 decimals: float noise may move one by a unit


class Tunes:
    """The base's f32 file, and for each fine-tune its f32 adapter file and its merged f32 conversion."""

    def __init__(self, ws, root: Path) -> None:
        self.release = ws.release("untied_f32")
        self.base = clef_gguf.convert(self.release, root / "base-f32.gguf", "f32", mmproj=False)
        checkpoints = {
            "triage": finetune.train(self.release, DATA, root / "triage"),
            "urgency": finetune.train(self.release, DATA, root / "urgency", lora={"r": 4, "alpha": 4}, train={"lr": 0.03}),
            "pattern": finetune.peft_checkpoint(self.release, root / "pattern", PATTERN, {"prior_logit_scale": 0.5}),
        }
        self.adapters = {n: convert_adapter(c, self.release, root / f"{n}.adapter.gguf", "f32") for n, c in checkpoints.items()}
        self.merged = {
            n: clef_gguf.convert(c, root / f"{n}-merged-f32.gguf", "f32", base=self.release, mmproj=False)
            for n, c in checkpoints.items()
        }


@pytest.fixture(scope="module")
def tunes(ws, tmp_path_factory) -> Tunes:
    return Tunes(ws, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def served(tunes):
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapters=tunes.adapters) as model:
        yield model


def _as(name: str | None, request: dict) -> dict:
    return {**request, "model": name} if name is not None else request


def test_each_adapter_decides_as_its_merged_conversion(tunes, served):
    """Within 1e-4 at f32 (the LoRA unmerged in llama.cpp, the head the adapter's), and far from the base's."""
    for name, merged in tunes.merged.items():
        with clef_gguf.load(merged, max_prompt_tokens=CONTEXT) as alone:
            for request in labelled_requests(6):
                ours, theirs = served.decide(_as(name, request)), alone.decide(request)
                assert ours["usage"]["input_tokens"] == theirs["usage"]["input_tokens"]
                assert ours["model"] == name
                assert np.abs(np.subtract(flat_probabilities(ours), flat_probabilities(theirs))).max() <= ROUNDED, name
    base = [flat_probabilities(served.decide(r)) for r in labelled_requests(6)]
    tuned = [flat_probabilities(served.decide(_as("triage", r))) for r in labelled_requests(6)]
    assert max(np.abs(np.subtract(a, b)).max() for a, b in zip(base, tuned, strict=True)) > 0.01


def test_requests_for_three_models_together_get_their_own_answers(served):
    """The same state under the base and two adapters, interleaved in one dataset run (batches never mix models,
    the state cache is keyed by model): each answer equals that model's answer alone."""
    names = [None, "triage", "urgency"]
    alone = {(n, i): flat_probabilities(served.decide(_as(n, r))) for n in names for i, r in enumerate(labelled_requests(3))}
    mixed = [(n, i, _as(n, r)) for i, r in enumerate(labelled_requests(3)) for n in names]
    for (n, i, _), answer in zip(mixed, served.decide_many([m for *_, m in mixed]), strict=True):
        assert np.abs(np.subtract(flat_probabilities(answer), alone[(n, i)])).max() <= ROUNDED, (n, i)


def test_a_state_cached_under_one_model_never_serves_another(served):
    request = labelled_requests(1)[0]
    served.state_cache.clear()
    first = served.decide(_as("triage", request))
    again = served.decide(_as("triage", {**request, "questions": dict(list(request["questions"].items())[:1])}))
    other = served.decide(_as("urgency", request))
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["input_tokens"] == other["usage"]["input_tokens"]


def test_an_unknown_model_name_lists_the_names(served):
    with pytest.raises(RequestError, match="triage, urgency") as caught:
        served.encode(_as("nope", labelled_requests(1)[0]))
    assert caught.value.field == "model"
    assert served.decide(_as("clef-flash", labelled_requests(1)[0]))["answers"]  # Clef's own names are the base's


def test_an_adapter_is_refused_on_another_base(tunes, tmp_path):
    other = build_release(tmp_path / "other", ReleaseSpec(seed=7))  # the same shapes, other weights
    base = clef_gguf.convert(other, tmp_path / "other-f32.gguf", "f32", mmproj=False)
    with pytest.raises(AdapterBaseError, match="another base"):
        clef_gguf.load(base, max_prompt_tokens=CONTEXT, adapters={"triage": tunes.adapters["triage"]})


def test_the_lru_unloads_and_reloads_with_the_same_answers(tunes, tmp_path):
    folder = tmp_path / "adapters"
    folder.mkdir()
    for name, path in tunes.adapters.items():
        (folder / f"{name}.adapter.gguf").symlink_to(path)
    request = labelled_requests(1)[0]
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, max_adapters=1, state_cache=0) as model:
        first = {n: flat_probabilities(model.decide(_as(n, request))) for n in ("triage", "urgency", "pattern")}
        assert model.decider.loaded == ["pattern"]
        for name in ("triage", "urgency", "pattern"):
            assert flat_probabilities(model.decide(_as(name, request))) == first[name]
            assert model.decider.loaded == [name]


def test_a_prompt_encoded_for_an_adapter_is_decided_by_it(served):
    """The prompt carries its model: decide_batch never mixes models, one batch a model."""
    request = labelled_requests(1)[0]
    prompts = [served.encode(_as(n, request)) for n in ("triage", "urgency")]
    assert not served.batchable(prompts)
    assert prompts[0].model != prompts[1].model
    assert json.dumps(served.decide(prompts[0])) == json.dumps(served.decide(_as("triage", request)))


def test_serve_answers_each_model_by_its_name(tunes, served):
    """`serve BASE --adapter NAME=FILE`: System One's `model` and Workers AI's `lora` pick the fine-tune, Clef's
    names and a request without one the base; an unknown name is a 4xx naming the models; /v1/models lists them."""
    import httpx
    from live_server import served as serving

    request = labelled_requests(1)[0]
    pairs = [f"{n}={tunes.adapters[n]}" for n in ("triage", "urgency")]
    args = ("--ctx", str(CONTEXT), "--adapter", pairs[0], "--adapter", pairs[1])
    with serving(tunes.base, *args) as (url, _), httpx.Client(base_url=url, timeout=120) as client:
        for name in (None, "triage", "urgency", "clef-flash"):
            body = client.post("/v1/systemone", json=_as(name, request)).json()
            expected = served.decide(_as(name if name != "clef-flash" else None, request))
            assert np.abs(np.subtract(flat_probabilities(body), flat_probabilities(expected))).max() <= ROUNDED, name
        run = client.post("/accounts/x/ai/run/@cf/cloudflare/clef-flash", json={**request, "lora": "urgency"}).json()
        assert run["success"] and flat_probabilities(run["result"]) == flat_probabilities(
            client.post("/v1/systemone", json=_as("urgency", request)).json()
        )
        unknown = client.post("/v1/systemone", json=_as("nope", request))
        assert unknown.status_code == 422 and "triage" in unknown.text and "urgency" in unknown.text
        listed = [m["name"] for m in client.get("/v1/models").json()["models"]]
        assert {"triage", "urgency"} <= set(listed)


def _cli(*args: str) -> dict:
    run = run_cli(*args, "--json", "--ctx", str(CONTEXT))
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_eval_compare_and_calibrate_take_an_adapter(tunes, tmp_path):
    """eval --adapter measures the fine-tune as its merged file measures; compare --adapter-a against the merged file
    changes nothing; calibrate --adapter writes a new adapter file with the temperatures, which then apply."""
    adapter, merged = str(tunes.adapters["triage"]), str(tunes.merged["triage"])
    ours = _cli("eval", str(tunes.base), str(DATA), "--adapter", adapter)["metrics"]["overall"]
    theirs = _cli("eval", merged, str(DATA))["metrics"]["overall"]
    assert ours["n"] == theirs["n"] and abs(ours["nll"] - theirs["nll"]) < 1e-4 and ours["accuracy"] == theirs["accuracy"]
    compared = _cli("compare", str(tunes.base), merged, str(DATA), "--adapter-a", adapter)["changes"]["overall"]
    assert compared["changed"] == 0 and compared["abs_dp"]["max"] < 1e-4
    out = tmp_path / "triage-calibrated.adapter.gguf"
    fitted = _cli("calibrate", str(tunes.base), str(DATA), "-o", str(out), "--adapter", adapter)["temperatures"]
    assert fitted and validate_adapter_pair(tunes.base, out).exit_code == 0
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapter=out) as model:
        assert model.catalog.pinned is not None and dict(model.catalog.pinned.temperatures) == pytest.approx(fitted, rel=1e-6)
    after = _cli("eval", str(tunes.base), str(DATA), "--adapter", str(out))["metrics"]["overall"]
    assert after["nll"] <= ours["nll"]  # (the fit minimizes it on these very records)
