"""A base told from its fine-tunes: a merged fine-tune is no adapter's base.

Over the k256 fixture (rows of 256: llama.cpp's K-quants apply), a PEFT checkpoint of every linear with lora_B scaled
to 1/100 (its update's RMS about 7% of the weights' in the sampled rows, where clef-finetune's own `train` on the
fixture gives 21%: docs/finetune.md) is converted to an adapter and to merged files. Every quantization of the
base takes the adapter; a merged file is exit 7 in `validate`, `decide` and at load, with the keys clef-gguf writes
and, with them stripped (as llama.cpp's converter writes a file), by the content check alone; and with its base's
keys copied in, by the content check too, which runs whatever the keys say.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli  # the CLI in this process
from safetensors.numpy import load_file, save_file

import clef_gguf
from clef_gguf.check.adapter_pair import require_adapter, validate_adapter_pair
from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.conversion.lineage import FINETUNE_MARKER, release_digest
from clef_gguf.conversion.release import open_release
from clef_gguf.errors import AdapterBaseError
from clef_gguf.format import lineage as L
from clef_gguf.format.header import GGUFFile
from clef_gguf.testing import finetune
from clef_gguf.testing.gguf_bytes import kv_str, rebuild
from clef_gguf.testing.golden import make_golden
from clef_gguf.testing.processes import free_port
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests

EVERY_LINEAR = "q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj|gate_proj|up_proj|down_proj"
LORA = {"r": 8, "lora_alpha": 16, "target_modules": rf".*language_model.*\.({EVERY_LINEAR})"}
B_SCALE = 0.01
SOURCE_KEYS = {L.KEY_SOURCE_DIGEST, L.KEY_SOURCE_MERGED, L.KEY_SOURCE_BASE_DIGEST}
ADAPTER_KEYS = {L.KEY_BASE_DIGEST, L.KEY_SAMPLE_TENSORS, L.KEY_SAMPLE_ROWS, L.KEY_SAMPLE_WIDTHS}
ADAPTER_KEYS |= {L.KEY_SAMPLE_WEIGHTS, L.KEY_SAMPLE_DELTA}
CONTEXT = 2048


class Tune:
    """The k256 release, a checkpoint of it, its f16 adapter file and its merged conversions (f32, q4_k_m)."""

    def __init__(self, ws, root: Path) -> None:
        self.ws, self.root = ws, root
        self.release = ws.release("k256")
        self.checkpoint = finetune.peft_checkpoint(self.release, root, LORA, {"prior_logit_scale": 0.5})
        weights = self.checkpoint / "adapter" / "adapter_model.safetensors"
        save_file({n: t * B_SCALE if "lora_B" in n else t for n, t in load_file(weights).items()}, weights)
        self.adapter = convert_adapter(self.checkpoint, self.release, root / "tune.adapter.gguf")
        self.merged = {
            t: clef_gguf.convert(self.checkpoint, root / f"merged-{t}.gguf", t, base=self.release, mmproj=False)
            for t in ("f32", "q4_k_m")
        }

    def base(self, file_type: str) -> Path:
        return self.ws.gguf("k256", file_type)


@pytest.fixture(scope="module")
def tune(ws, tmp_path_factory) -> Tune:
    return Tune(ws, tmp_path_factory.mktemp("fingerprint"))


def _foreign(path: Path, out_dir: Path) -> Path:
    """The file as llama.cpp's converter (or an older clef-gguf) would have written it: no lineage key of ours."""
    return rebuild(path, out_dir / f"foreign-{path.name}", drop_keys=SOURCE_KEYS | {L.KEY_SOURCE_VISION})


def _keys(path: Path) -> dict:
    f = GGUFFile.open(path)
    try:
        return {k: f.header.get(k) for k in SOURCE_KEYS | ADAPTER_KEYS if k in f.header.fields}
    finally:
        f.close()


def _sample(adapter: Path) -> list[L.SampleRow] | None:
    f = GGUFFile.open(adapter)
    try:
        return L.read_sample(f.header)
    finally:
        f.close()


def _require(base: Path, adapter: Path) -> None:
    f, a = GGUFFile.open(base), GGUFFile.open(adapter)
    try:
        require_adapter(f, a.header, adapter.name)
    finally:
        a.close()
        f.close()


@pytest.mark.slow
def test_every_conversion_records_its_release_and_merged_files_say_so(tune):
    digest = release_digest(open_release(tune.release))
    for file_type in ("f16", "f32", "q8_0", "q4_k_m"):
        assert _keys(tune.base(file_type)) == {L.KEY_SOURCE_DIGEST: digest}, file_type
    merged = [_keys(p) for p in tune.merged.values()]
    assert merged[0] == merged[1]
    assert merged[0][L.KEY_SOURCE_MERGED] is True and merged[0][L.KEY_SOURCE_BASE_DIGEST] == digest
    assert L.is_digest(merged[0][L.KEY_SOURCE_DIGEST]) and merged[0][L.KEY_SOURCE_DIGEST] != digest
    adapter = _keys(tune.adapter)
    assert adapter[L.KEY_BASE_DIGEST] == digest
    sample = _sample(tune.adapter)
    assert sample and len({s.tensor for s in sample}) >= 4 and sum(s.weights.size for s in sample) <= L.SAMPLE_BUDGET


@pytest.mark.parametrize("file_type", ["f16", "f32", "q8_0", "q4_k_m"])
def test_every_quantization_of_the_base_takes_the_adapter(tune, tmp_path, file_type):
    report = validate_adapter_pair(tune.base(file_type), tune.adapter)
    assert report.exit_code == 0 and "the release it was trained over" in report.summary, report.summary
    foreign = _foreign(tune.base(file_type), tmp_path)
    report = validate_adapter_pair(foreign, tune.adapter)
    assert report.exit_code == 0 and "none of the adapter's update in the weights (content check" in report.summary
    _require(foreign, tune.adapter)


@pytest.mark.parametrize("file_type", ["f32", "q4_k_m"])
def test_a_merged_file_as_base_is_exit_7_with_why(tune, tmp_path, file_type):
    merged = tune.merged[file_type]
    report = validate_adapter_pair(merged, tune.adapter)
    assert report.exit_code == 7 and "a fine-tune merged into the release this adapter was trained over" in report.summary
    done = run_cli("validate", str(merged), "--adapter", str(tune.adapter), "--json")
    assert done.returncode == 7, done.stderr
    assert "merged" in json.loads(done.stdout)["pairing"]["problems"][0]
    with pytest.raises(AdapterBaseError, match="merged"):
        clef_gguf.load(merged, max_prompt_tokens=CONTEXT, adapters={"tune": tune.adapter})
    # Without our keys, the content check: the adapter's own update is in the weights.
    foreign = _foreign(merged, tmp_path)
    report = validate_adapter_pair(foreign, tune.adapter)
    assert report.exit_code == 7 and "hold the adapter's own update already" in report.summary, report.summary
    with pytest.raises(AdapterBaseError, match="update already"):
        _require(foreign, tune.adapter)


def _forged(merged: Path, base: Path, out_dir: Path) -> Path:
    """A merged fine-tune whose lineage keys claim its base: the base's clef.source.digest, the merged mark dropped
    (what a tool that copies its base's key-values into its output writes)."""
    digest = kv_str(L.KEY_SOURCE_DIGEST, _keys(base)[L.KEY_SOURCE_DIGEST])
    drop = {L.KEY_SOURCE_MERGED, L.KEY_SOURCE_BASE_DIGEST}
    return rebuild(merged, out_dir / f"forged-{merged.name}", drop_keys=drop, replace={L.KEY_SOURCE_DIGEST: digest})


@pytest.mark.slow
@pytest.mark.parametrize("file_type", ["f32", "q4_k_m"])
def test_a_merged_file_with_its_bases_keys_is_exit_7_everywhere(tune, tmp_path, file_type):
    """Keys refuse early, never accept alone: the content check runs whatever they say."""
    forged = _forged(tune.merged[file_type], tune.base(file_type), tmp_path)
    assert _keys(forged) == _keys(tune.base(file_type))  # its keys are the base's, word for word
    report = validate_adapter_pair(forged, tune.adapter)
    assert report.exit_code == 7 and "hold the adapter's own update already" in report.summary, report.summary
    assert "keys (clef.source.digest) name the release the adapter was trained over" in report.summary
    request = tmp_path / "request.json"
    request.write_text(json.dumps(labelled_requests(1)[0]))
    for command in (
        ("validate", forged, "--adapter", tune.adapter),
        ("decide", forged, request, "--adapter", tune.adapter, "--ctx", str(CONTEXT)),
        ("serve", forged, "--adapter", f"tune={tune.adapter}", "--ctx", str(CONTEXT), "--port", str(free_port())),
        ("serve", forged, "--ray", "--adapter", f"tune={tune.adapter}", "--ctx", str(CONTEXT), "--port", str(free_port())),
    ):
        done = run_cli(*command, env={"RAY_ADDRESS": ""}, timeout=120)
        assert done.returncode == 7 and "update already" in done.stdout + done.stderr, (command[0], done.stderr)
        assert "Traceback" not in done.stderr
    with pytest.raises(AdapterBaseError, match="update already"):
        clef_gguf.load(forged, max_prompt_tokens=CONTEXT, adapters={"tune": tune.adapter})


def test_decide_refuses_a_merged_base_in_one_line(tune, tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps(labelled_requests(1)[0]))
    merged = _foreign(tune.merged["q4_k_m"], tmp_path)
    done = run_cli("decide", str(merged), str(request), "--adapter", str(tune.adapter), "--ctx", str(CONTEXT))
    assert done.returncode == 7 and "update already" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_foreign_q4_k_m_base_decides_with_the_adapter(tune, tmp_path):
    """A base without our keys takes the adapter, and decides with it as the same file with the keys does."""
    request = labelled_requests(1)[0]
    answers = []
    for base in (_foreign(tune.base("q4_k_m"), tmp_path), tune.base("q4_k_m")):
        with clef_gguf.load(base, max_prompt_tokens=CONTEXT, adapters={"tune": tune.adapter}) as model:
            answers.append([flat_probabilities(model.decide(r)) for r in ({**request, "model": "tune"}, request)])
    assert answers[0] == answers[1]
    assert answers[0][0] != answers[0][1]  # the adapter applied (its head's prior_logit_scale moved)


@pytest.fixture(scope="module")
def merge_folder(tune) -> Path:
    """clef-finetune's own `merge` of the checkpoint: a release folder with its CLEF_FINETUNE.json."""
    return finetune.merge(tune.release, tune.checkpoint, tune.root / "merged-release")


@pytest.mark.slow
def test_a_clef_finetune_merge_folder_is_marked_merged(tune, merge_folder, tmp_path):
    assert (merge_folder / FINETUNE_MARKER).is_file()
    converted = clef_gguf.convert(merge_folder, tmp_path / "merged-release-f32.gguf", "f32", mmproj=False)
    keys = _keys(converted)
    assert keys[L.KEY_SOURCE_MERGED] is True and keys[L.KEY_SOURCE_DIGEST] == release_digest(open_release(merge_folder))
    report = validate_adapter_pair(converted, tune.adapter)
    assert report.exit_code == 7 and "a folder clef-finetune merge wrote" in report.summary, report.summary
    report = validate_adapter_pair(_foreign(converted, tmp_path), tune.adapter)
    assert report.exit_code == 7 and "update already" in report.summary, report.summary


@pytest.mark.slow
def test_llama_cpps_own_conversions_take_the_adapter_and_not_over_its_merge(tune, merge_folder, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (clef_gguf/testing/golden.py) writes none of our keys: the content check
    takes its conversion of the release and refuses its conversion of the merged folder."""
    for file_type in ("f32", "q8_0"):
        base = make_golden(tune.release, tmp_path / "release", file_type)
        assert not _keys(base)
        report = validate_adapter_pair(base, tune.adapter)
        assert report.exit_code == 0 and "(content check: " in report.summary, report.summary
    merged = make_golden(merge_folder, tmp_path / "merged", "q8_0")
    report = validate_adapter_pair(merged, tune.adapter)
    assert report.exit_code == 7 and "hold the adapter's own update already" in report.summary, report.summary


def test_an_old_adapter_still_loads_over_its_base(tune, tmp_path):
    """An adapter written before these keys: the norms as before, a note that says what it cannot tell; a file marked
    merged is refused (it cannot show it was trained over that one)."""
    old = rebuild(tune.adapter, tmp_path / "old.adapter.gguf", drop_keys=ADAPTER_KEYS)
    for base in (tune.base("q4_k_m"), _foreign(tune.base("f32"), tmp_path)):
        report = validate_adapter_pair(base, old)
        assert report.exit_code == 0 and "norms fingerprint only" in report.summary, report.summary
    with clef_gguf.load(tune.base("q8_0"), max_prompt_tokens=CONTEXT, adapters={"old": old}) as model:
        assert model.decide({**labelled_requests(1)[0], "model": "old"})["model"] == "old"
    report = validate_adapter_pair(tune.merged["f32"], old)
    assert report.exit_code == 7 and f"records no {L.KEY_BASE_DIGEST}" in report.summary


def test_another_release_and_a_damaged_sample_are_exit_7(tune, tmp_path):
    other = rebuild(
        tune.base("f32"), tmp_path / "other.gguf", replace={L.KEY_SOURCE_DIGEST: kv_str(L.KEY_SOURCE_DIGEST, "0" * 64)}
    )
    report = validate_adapter_pair(other, tune.adapter)
    assert report.exit_code == 7 and "trained over another release (weights digest" in report.summary
    damaged = rebuild(tune.adapter, tmp_path / "damaged.adapter.gguf", drop_keys={L.KEY_SAMPLE_DELTA})
    report = validate_adapter_pair(_foreign(tune.base("f32"), tmp_path), damaged)
    assert report.exit_code == 7 and "base sample" in report.summary and "\n" not in report.summary


def test_the_content_check_reads_a_few_rows_only(tune, tmp_path):
    """Its rows are dequantized as stored: the f32 base gives exactly 0, the f32 merged file 1 within float error."""
    sample = _sample(tune.adapter)
    base, merged = GGUFFile.open(_foreign(tune.base("f32"), tmp_path)), GGUFFile.open(_foreign(tune.merged["f32"], tmp_path))
    try:
        at_base, at_merged = L.sample_share(base, sample), L.sample_share(merged, sample)
    finally:
        base.close()
        merged.close()
    assert at_base is not None and at_base.value == 0 and at_base.error == 0
    assert at_merged is not None and abs(at_merged.value - 1) < 1e-4 and at_merged.error < 1e-4
