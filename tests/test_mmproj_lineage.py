"""Another release's vision tower is not this model's: a model file convert wrote records its release's tower
fingerprint, and the mmproj is fingerprinted by its own tensors (check/pair.py), so that `validate --mmproj`,
`decide --mmproj`, `serve --mmproj` (`--ray` too) and load() refuse, exit 7, an mmproj of the same width from another
release (other_f32: untied_f32's shapes, another seed), whatever its keys. A model file without the key (llama.cpp's
converter writes none) is paired by the width alone, and validate says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli  # the CLI in this process

import clef_gguf
from clef_gguf.check.pair import mmproj_fingerprint, validate_pair
from clef_gguf.errors import IncompleteModelError
from clef_gguf.format import lineage as L
from clef_gguf.format.header import GGUFFile
from clef_gguf.testing.gguf_bytes import rebuild
from clef_gguf.testing.processes import free_port
from clef_gguf.testing.request_suite import labelled_requests

CONTEXT = "2048"
ANOTHER = "another release's vision tower"


@pytest.fixture(scope="module")
def other_mmproj(ws) -> Path:
    """other_f32's tower: as wide as untied_f32's, with its keys (an mmproj holds no lineage key of ours)."""
    return ws.mmproj("other_f32", "f32")


def _recorded(model: Path) -> object:
    f = GGUFFile.open(model)
    try:
        return f.header.get(L.KEY_SOURCE_VISION)
    finally:
        f.close()


@pytest.mark.slow
def test_every_type_of_a_releases_mmproj_has_the_fingerprint_its_model_records(ws, other_mmproj):
    recorded = _recorded(ws.gguf("untied_f32", "f32"))
    assert L.is_digest(recorded) and _recorded(ws.gguf("untied_f32", "q8_0")) == recorded
    for file_type in ("f32", "q8_0"):  # an f32 and a q8_0 tower: their biases, norms and positions are F32 alike
        f = GGUFFile.open(ws.mmproj("untied_f32", file_type))
        try:
            assert mmproj_fingerprint(f) == recorded, file_type
        finally:
            f.close()
    pair = validate_pair(ws.gguf("untied_f32", "q8_0"), ws.mmproj("untied_f32", "f32"))
    assert pair.ok and "the vision tower of the model's release" in pair.summary, pair.summary


@pytest.mark.slow
def test_validate_refuses_another_releases_tower_of_the_same_width(ws, other_mmproj):
    model = ws.gguf("untied_f32", "f32")
    pair = validate_pair(model, other_mmproj)
    assert pair.first.ok and pair.second.ok and pair.exit_code == 7 and ANOTHER in pair.summary, pair.summary
    run = run_cli("validate", model, "--mmproj", other_mmproj, "--json")
    assert run.returncode == 7, run.stdout
    assert ANOTHER in json.loads(run.stdout)["pairing"]["problems"][0]
    # Its own tower, by the same check: the other release's model takes its mmproj.
    assert validate_pair(ws.gguf("other_f32", "f32"), other_mmproj).ok


@pytest.mark.slow
def test_decide_and_serve_refuse_another_releases_tower_in_one_line(ws, other_mmproj, tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps(labelled_requests(1)[0]))
    model = ws.gguf("untied_f32", "f32")
    for command in (
        ("decide", model, request, "--mmproj", other_mmproj, "--ctx", CONTEXT),
        ("serve", model, "--mmproj", other_mmproj, "--ctx", CONTEXT, "--port", str(free_port())),
        ("serve", model, "--ray", "--mmproj", other_mmproj, "--ctx", CONTEXT, "--port", str(free_port())),  # (no Ray yet)
    ):
        done = run_cli(*command, env={"RAY_ADDRESS": ""}, timeout=120)
        assert done.returncode == 7 and ANOTHER in done.stderr, (command[0], done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    with pytest.raises(IncompleteModelError, match=ANOTHER):
        clef_gguf.load(model, max_prompt_tokens=int(CONTEXT), mmproj=other_mmproj)


@pytest.mark.slow
def test_a_model_without_the_fingerprint_is_paired_by_width_and_says_so(ws, other_mmproj, tmp_path):
    """As llama.cpp's converter writes a model file: no fingerprint to compare the tower with."""
    foreign = rebuild(ws.gguf("untied_f32", "f32"), tmp_path / "foreign.gguf", drop_keys={L.KEY_SOURCE_VISION})
    pair = validate_pair(foreign, other_mmproj)
    assert pair.ok and "records no vision tower fingerprint" in pair.summary and "only the width" in pair.summary
    assert "records no vision tower fingerprint" in pair.to_dict()["pairing"]["basis"]
