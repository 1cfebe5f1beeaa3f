"""llama.cpp quantizations (Q4_K_M above all), head precision, and grafting a head onto a backbone-only GGUF."""

from __future__ import annotations

import shutil
from collections import Counter

import gguf
import numpy as np
import pytest

import clef_gguf
from clef_gguf.conversion.graft import MismatchError, graft
from clef_gguf.conversion.quantize import load_imatrix, quantize
from clef_gguf.errors import ConversionError
from clef_gguf.format import contract as C
from clef_gguf.format.header import GGUFFile
from clef_gguf.format.lineage import KEY_SOURCE_DIGEST, KEY_SOURCE_VISION
from clef_gguf.llama.qwen35_view import write_backbone_gguf
from clef_gguf.testing.gguf_bytes import rebuild
from clef_gguf.testing.release_builder import ReleaseSpec, build_release
from clef_gguf.testing.request_suite import all_requests

GT = gguf.GGMLQuantizationType


def _types(path) -> dict[str, GT]:
    f = GGUFFile.open(path)
    types = {n: t.type for n, t in f.header.tensors.items()}
    f.close()
    return types


def _backbone_only(clef_path, out):
    f = GGUFFile.open(clef_path)
    write_backbone_gguf(f, out)
    f.close()
    return out


def _probabilities(answer: dict) -> dict[str, float]:
    return answer.get("probabilities") or {"true": answer["noul"], "false": 1 - answer["noul"]}


def test_q4_k_m_is_the_mixture_llama_quantize_makes(ws, tmp_path):
    """Same tensor types and bytes as llama.cpp's quantizer run on the plain bf16 backbone."""
    ours = ws.gguf("k256", "q4_k_m")
    plain_bf16 = _backbone_only(ws.gguf("k256", "bf16"), tmp_path / "bf16.gguf")
    quantize(plain_bf16, tmp_path / "q4_k_m.gguf", "q4_k_m")
    theirs = GGUFFile.open(tmp_path / "q4_k_m.gguf")
    mine = GGUFFile.open(ours)
    backbone = {n: t.type for n, t in mine.header.tensors.items() if not C.is_head_tensor(n)}
    assert backbone == {n: t.type for n, t in theirs.header.tensors.items()}
    assert {GT.Q4_K, GT.Q6_K} <= set(backbone.values())
    for name in backbone:
        assert np.array_equal(mine.tensor_bytes(name), theirs.tensor_bytes(name)), name
    heads = [n for n in mine.header.tensors if C.is_head_tensor(n)]
    assert len(heads) == C.head_tensor_count(1, 1)
    assert mine.header.get(C.KEY_DECISION_TYPE) == C.DECISION_TYPE
    theirs.close()
    mine.close()


@pytest.mark.slow
@pytest.mark.parametrize("file_type", ["q4_k_m", "q5_k_m", "q6_k", "q4_0", "iq4_nl"])
def test_quantized_files_agree_with_f32_on_the_top_option(ws, file_type):
    reference, quantized = ws.model("k256", "f32"), clef_gguf.load(ws.gguf("k256", file_type), max_prompt_tokens=8192)
    try:
        decisive = agreeing = 0
        for request in all_requests().values():
            expected, answers = reference.decide(request)["answers"], quantized.decide(request)["answers"]
            for qid, answer in expected.items():
                p = sorted(_probabilities(answer).values(), reverse=True)
                if p[0] - p[1] > 0.1:
                    decisive += 1
                    ours = _probabilities(answers[qid])
                    agreeing += max(ours, key=ours.get) == max(_probabilities(answer), key=_probabilities(answer).get)
        assert decisive >= 20 and agreeing >= 0.9 * decisive, (agreeing, decisive)
    finally:
        quantized.close()


@pytest.mark.parametrize("head_type", ["f16", "q8_0"])
def test_head_precision_is_a_choice(ws, head_type):
    path = ws.gguf("k256", "f32", head_type)
    types = Counter(t for n, t in _types(path).items() if C.is_head_tensor(n))
    assert types[GT[head_type.upper()]] > 0 and set(types) <= {GT.F32, GT[head_type.upper()]}
    request = all_requests()["mixed"]
    with clef_gguf.load(path) as model:
        answers = model.decide(request)["answers"]
    expected = ws.model("k256", "f32").decide(request)["answers"]
    worst = max(abs(_probabilities(a)[k] - _probabilities(expected[q])[k]) for q, a in answers.items() for k in _probabilities(a))
    assert worst < 0.02


def test_graft_equals_converting_the_release_directly(ws, tmp_path):
    direct = ws.gguf("k256", "q4_k_m")
    backbone = _backbone_only(direct, tmp_path / "community-q4_k_m.gguf")
    assert not any(C.is_head_tensor(n) for n in _types(backbone))
    grafted = graft(backbone, ws.release("k256"), tmp_path / "grafted.gguf")
    # But for the release's weights digest and tower fingerprint that convert records: graft cannot vouch for a
    # backbone's source.
    unkeyed = rebuild(direct, tmp_path / "unkeyed.gguf", drop_keys={KEY_SOURCE_DIGEST, KEY_SOURCE_VISION})
    assert grafted.read_bytes() == unkeyed.read_bytes() != direct.read_bytes()
    request = all_requests()["mixed"]
    with clef_gguf.load(grafted) as model:
        assert model.decide(request) == ws.model("k256", "q4_k_m").decide(request)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (
            ReleaseSpec(seed=2, hidden=128, intermediate=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64),
            "embedding_length",
        ),
        (
            ReleaseSpec(
                seed=2, layers=8, hidden=256, intermediate=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64
            ),
            "block_count",
        ),
        (
            ReleaseSpec(
                seed=2, tied=True, hidden=256, intermediate=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64
            ),
            "ties",
        ),
    ],
)
def test_graft_refuses_a_release_that_does_not_belong(ws, tmp_path, spec, named):
    backbone = _backbone_only(ws.gguf("k256", "q4_k_m"), tmp_path / "backbone.gguf")
    other = build_release(tmp_path / "other", spec)
    out = tmp_path / "out.gguf"
    with pytest.raises(MismatchError, match=named):
        graft(backbone, other, out)
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


def test_graft_refuses_a_clef_file_as_backbone(ws, tmp_path):
    with pytest.raises(MismatchError, match="not a qwen35 backbone"):
        graft(ws.gguf("k256", "q4_k_m"), ws.release("k256"), tmp_path / "out.gguf")


def _imatrix(path, names: list[str], width: int) -> None:
    w = gguf.GGUFWriter(path, "imatrix")
    w.add_uint32("imatrix.chunk_count", 4)
    rng = np.random.default_rng(0)
    for name in names:
        w.add_tensor(f"{name}.in_sum2", rng.uniform(0.5, 50, size=(1, width)).astype(np.float32))
        w.add_tensor(f"{name}.counts", np.array([[10.0]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.slow
def test_an_importance_matrix_passes_through(ws, tmp_path):
    names = [f"blk.{i}.ffn_up.weight" for i in range(4)] + [f"blk.{i}.ffn_gate.weight" for i in range(4)]
    _imatrix(tmp_path / "imatrix.gguf", names, 256)
    data = load_imatrix(tmp_path / "imatrix.gguf")
    assert set(data) == set(names) and data[names[0]].shape == (256,)
    plain = clef_gguf.convert(ws.release("k256"), tmp_path / "plain.gguf", "iq4_nl")
    weighted = clef_gguf.convert(ws.release("k256"), tmp_path / "weighted.gguf", "iq4_nl", imatrix=tmp_path / "imatrix.gguf")
    a, b = GGUFFile.open(plain), GGUFFile.open(weighted)
    assert not np.array_equal(a.tensor_bytes("blk.0.ffn_up.weight"), b.tensor_bytes("blk.0.ffn_up.weight"))
    assert np.array_equal(a.tensor_bytes("blk.0.ffn_down.weight"), b.tensor_bytes("blk.0.ffn_down.weight"))
    a.close()
    b.close()


def test_a_failed_quantization_leaves_nothing_beside_the_output(ws, tmp_path):
    bad = tmp_path / "bad.imatrix"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ConversionError, match="imatrix"):
        clef_gguf.convert(ws.release("k256"), tmp_path / "out.gguf", "q4_k_m", imatrix=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.imatrix"]


def test_free_space_is_checked_before_starting(tmp_path):
    from clef_gguf.conversion.writer import check_free_space

    free = shutil.disk_usage(tmp_path).free
    check_free_space(tmp_path, free // 2)
    with pytest.raises(ConversionError, match="free; this conversion needs about"):
        check_free_space(tmp_path, free * 2)


def test_a_write_the_disk_cuts_short_says_the_disk_is_full(tmp_path):
    """numpy's tofile reports a short write with no errno; ENOSPC itself says the same."""
    import errno

    from clef_gguf.conversion.writer import writing

    for error in (OSError("4096 requested and 304 written"), OSError(errno.ENOSPC, "No space left on device")):
        with pytest.raises(ConversionError, match=r"is full \(.* free, ENOSPC\)"), writing(tmp_path / "out.gguf"):
            raise error


def test_sizes_are_printed_in_a_unit_that_fits():
    from clef_gguf.conversion.writer import human_size

    assert [human_size(n) for n in (0, 512, 3400, 12 << 20, 3 << 29, 5 << 40)] == [
        "0 bytes",
        "512 bytes",
        "3.3 KiB",
        "12.0 MiB",
        "1.50 GiB",
        "5.00 TiB",
    ]
