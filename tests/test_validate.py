"""`clef-gguf validate`: complete files, backbone-only files, mismatched heads, corrupt headers, remote files."""

from __future__ import annotations

import json
import re
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import run_cli as clef_gguf_cli  # the CLI in this process

import clef_gguf
from clef_gguf.check import validate as V
from clef_gguf.check.deep import file_sha256
from clef_gguf.check.report import Report, Verdict
from clef_gguf.check.validate import validate
from clef_gguf.conversion.convert import FILE_TYPES
from clef_gguf.errors import CorruptModelError, IncompleteModelError, NotADecisionModelError
from clef_gguf.format import contract as C
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama.qwen35_view import write_backbone_gguf
from clef_gguf.testing.gguf_bytes import f32_tensor, kv_i32_array, kv_str, kv_str_array, kv_u32, poke, rebuild
from clef_gguf.testing.release_builder import CLEF_FLASH_LAYOUT, build_release

FLASH_MESSAGE = (
    "427 backbone tensors, 0 of the 206 head tensors of Clef-flash (the 160 of joint_head.safetensors): "
    "this file can generate text but cannot make decisions"
)


@pytest.fixture(scope="module")
def flash_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Clef-flash layout (32 layers, 6 + 3 head) as a Clef file and as its backbone-only export."""
    root = tmp_path_factory.mktemp("flash")
    clef = clef_gguf.convert(build_release(root / "release", CLEF_FLASH_LAYOUT), root / "flash.gguf", "f16")
    f = GGUFFile.open(clef)
    try:
        write_backbone_gguf(f, root / "flash-backbone.gguf")
    finally:
        f.close()
    return {"clef": clef, "backbone": root / "flash-backbone.gguf"}


def assert_one_line(report: Report) -> None:
    assert "\n" not in report.summary and report.summary
    json.dumps(report.to_dict())  # the --json output is always serializable


# --- Complete files ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("release", "file_type", "head_type"),
    [
        ("untied_f32", "f32", None),
        ("untied_f32", "f16", None),
        ("untied_f32", "bf16", None),
        ("untied_f32", "q8_0", None),
        ("tied_bf16", "bf16", None),
        ("k256", "q4_k_m", "q8_0"),  # llama.cpp's K-quant mixture, a Q8_0 head
    ],
)
def test_a_complete_file_of_each_type_is_complete(ws, release, file_type, head_type):
    if file_type not in FILE_TYPES:
        pytest.skip(f"convert has no {file_type}")
    path = ws.gguf(release, file_type, head_type or "auto")
    report = validate(path)
    assert report.verdict is Verdict.COMPLETE and report.exit_code == 0, report.problems
    assert report.problems == ()
    c = report.counts
    assert c.backbone == c.backbone_expected and c.head == c.head_expected == C.head_tensor_count(1, 1)
    assert report.summary.startswith("complete Clef decision model")
    assert report.seconds < 1.0
    assert_one_line(report)


def test_the_clef_flash_layout_is_complete_with_427_and_206_tensors(flash_files):
    report = validate(flash_files["clef"])
    assert report.ok, report.summary
    assert (report.counts.backbone, report.counts.head) == (427, 206)
    assert (report.counts.backbone_expected, report.counts.head_expected) == (427, 206)


def test_deep_reads_every_tensor_and_checks_the_sha256(ws):
    path = ws.gguf("untied_f32", "q8_0")
    digest = file_sha256(path)
    report = validate(path, deep=True, sha256=digest.upper())
    assert report.ok and report.deep and report.sha256 == digest, report.summary
    wrong = validate(path, sha256="0" * 64)
    assert wrong.verdict is Verdict.CORRUPT and "sha256" in wrong.summary and wrong.exit_code == 5
    with pytest.raises(ValueError, match="64 hex digits"):
        validate(path, sha256="abc")
    run = clef_gguf_cli("validate", str(path), "--sha256", "xyz")
    assert run.returncode == 2 and "64 hex digits" in run.stderr


# --- Not a decision model -----------------------------------------------------------------------------
def test_the_backbone_only_file_is_named_with_its_counts_and_the_remedy(flash_files):
    report = validate(flash_files["backbone"])
    assert report.verdict is Verdict.NOT_A_DECISION_MODEL and report.exit_code == 6
    assert report.summary.startswith(FLASH_MESSAGE), report.summary
    assert "clef-gguf graft" in report.summary and "clef-gguf convert" in report.summary
    assert report.problems == ()  # the backbone itself is complete
    assert (report.counts.backbone, report.counts.backbone_expected, report.counts.head) == (427, 427, 0)
    assert report.architecture == "qwen35"
    assert_one_line(report)


def test_the_cli_prints_the_verdict_and_exits_with_its_code(flash_files):
    run = clef_gguf_cli("validate", str(flash_files["backbone"]))
    assert run.returncode == 6, run.stderr
    assert FLASH_MESSAGE in run.stdout.splitlines()[0]
    as_json = json.loads(clef_gguf_cli("validate", str(flash_files["backbone"]), "--json").stdout)
    assert as_json["verdict"] == "not_a_decision_model" and as_json["exit_code"] == 6
    assert as_json["counts"]["backbone"] == 427 and as_json["counts"]["head"] == 0


def test_runtime_and_decide_refuse_it_with_validates_message(flash_files, tmp_path):
    summary = validate(flash_files["backbone"]).summary
    with pytest.raises(NotADecisionModelError) as refused:
        clef_gguf.load(flash_files["backbone"])
    assert summary in str(refused.value)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}))
    run = clef_gguf_cli("decide", str(flash_files["backbone"]), str(request))
    assert run.returncode == 6 and FLASH_MESSAGE in run.stderr and run.stdout == ""


def test_another_architecture_is_not_a_decision_model(tmp_path):
    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    report = validate(path)
    assert report.verdict is Verdict.NOT_A_DECISION_MODEL and "'llama'" in report.summary


# --- Incomplete or inconsistent ------------------------------------------------------------------------
def _head_for(config: C.HeadConfig) -> list:
    rng = np.random.default_rng(0)
    return [f32_tensor(n, s, rng) for n, s in C.head_tensor_shapes(config).items()]


def test_a_head_from_another_backbone_is_refused(ws, tmp_path):
    src = ws.gguf("untied_f32", "f32")  # hidden size 64
    other = C.HeadConfig(hidden_size=96, width=32, routing_layers=1, layers=1, heads=2, feedforward=64)
    mixed = rebuild(src, tmp_path / "mixed.gguf", keep=lambda n: not C.is_head_tensor(n), extra=_head_for(other))
    report = validate(mixed)
    assert report.verdict is Verdict.INCOMPLETE and report.exit_code == 7
    assert re.search(r"head tensor \S+ has shape \[.*96.*\], the head implies .*another backbone", report.summary), report.summary
    with pytest.raises(IncompleteModelError, match="head"):
        clef_gguf.load(mixed)


def test_missing_head_and_backbone_tensors_are_counted(ws, tmp_path):
    src = ws.gguf("untied_f32", "f32")
    dropped = {"decision.proj_question.weight", "decision.field_norm.bias", "decision.scales"}
    report = validate(rebuild(src, tmp_path / "head.gguf", keep=lambda n: n not in dropped))
    assert report.verdict is Verdict.INCOMPLETE
    assert "61 of the 64 head tensors (20 + 18*1 + 26*1, holding the 54 of joint_head.safetensors)" in report.summary
    report = validate(rebuild(src, tmp_path / "backbone.gguf", keep=lambda n: n != "blk.2.ffn_up.weight"))
    assert report.verdict is Verdict.INCOMPLETE and "1 of the 56 backbone tensors" in report.summary
    assert "blk.2.ffn_up.weight" in report.summary


def test_a_clef_gguf_0_1_0_file_is_recognized_with_the_remedy(ws, tmp_path):
    src = ws.gguf("untied_f32", "f32")
    old = rebuild(src, tmp_path / "old.gguf", replace={"clef.decision.type": kv_str("clef.decision.type", "joint_schema")})
    report = validate(old)
    assert report.verdict is Verdict.INCOMPLETE and "clef-gguf 0.1.0" in report.summary and "clef-gguf convert" in report.summary


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ({"replace": {"clef.full_attention_interval": kv_u32("clef.full_attention_interval", 0)}}, "full_attention_interval = 0"),
        ({"replace": {"clef.block_count": kv_u32("clef.block_count", 5)}}, "backbone tensors llama.cpp asks for are missing"),
        ({"drop_keys": {"clef.decision.type"}}, "clef.decision.type is None"),
        ({"drop_keys": {"tokenizer.ggml.merges"}}, "merges is missing"),
        ({"replace": {"tokenizer.ggml.merges": kv_str_array("tokenizer.ggml.merges", ["nospace"])}}, "separated by a space"),
        ({"drop_keys": {C.KEY_TEMPLATE}}, "tokenizer.chat_template.systemone (the prompt) is missing"),
        ({"replace": {C.KEY_TEMPLATE: kv_str(C.KEY_TEMPLATE, "{{ lipsum() }}")}}, "uses Call"),
        ({"replace": {C.KEY_TEMPLATE: kv_str(C.KEY_TEMPLATE, "{% for x in state %}x{% endfor %}")}}, "loops over"),
        ({"drop_keys": {C.KEY_HEAD_NORM_EPS}}, "LayerNorm epsilon"),
        (
            {"replace": {"clef.rope.dimension_sections": kv_i32_array("clef.rope.dimension_sections", [9, 9, 9, 0])}},
            "rotary pairs",
        ),
        ({"replace": {C.KEY_HEAD_COUNT: kv_u32(C.KEY_HEAD_COUNT, 3)}}, "is not a multiple of clef.decision.head_count = 3"),
        ({"replace": {C.KEY_JOINT_BLOCKS: kv_u32(C.KEY_JOINT_BLOCKS, 1 << 30)}}, "block_count = 1073741824 is outside"),
        ({"replace": {C.KEY_JOINT_BLOCKS: kv_u32(C.KEY_JOINT_BLOCKS, 2)}}, "64 of the 90 head tensors"),
    ],
)
def test_inconsistent_metadata_is_named(ws, tmp_path, edit, reason):
    report = validate(rebuild(ws.gguf("untied_f32", "f32"), tmp_path / "edited.gguf", **edit))
    assert report.verdict is Verdict.INCOMPLETE and report.exit_code == 7, report.summary
    assert any(reason in p.message for p in report.problems), report.problems


def test_template_tokens_must_be_special(ws, tmp_path):
    src = ws.gguf("untied_f32", "f32")
    f = GGUFFile.open(src)
    tokens, types = f.header.get("tokenizer.ggml.tokens"), list(f.header.get("tokenizer.ggml.token_type"))
    f.close()
    types[tokens.index("<|im_start|>")] = gguf.TokenType.NORMAL
    edited = rebuild(
        src, tmp_path / "t.gguf", replace={"tokenizer.ggml.token_type": kv_i32_array("tokenizer.ggml.token_type", types)}
    )
    report = validate(edited)
    assert report.verdict is Verdict.INCOMPLETE and "<|im_start|>" in report.summary and "would split" in report.summary


def test_deep_finds_nan_and_zeroed_tensors(ws, tmp_path):
    src = ws.gguf("untied_f32", "f32")
    f = GGUFFile.open(src)
    t = f.header.tensors["blk.1.ffn_down.weight"]
    start, n_bytes = f.header.data_offset + t.offset, t.n_bytes
    f.close()
    data = src.read_bytes()
    nan = tmp_path / "nan.gguf"
    nan.write_bytes(poke(data, start + 40, struct.pack("<f", float("nan"))))
    zero = tmp_path / "zero.gguf"
    zero.write_bytes(poke(data, start, bytes(n_bytes)))
    assert validate(nan).ok  # header-only does not read the data
    report = validate(nan, deep=True)
    assert report.verdict is Verdict.CORRUPT and "blk.1.ffn_down.weight holds NaN or Inf" in report.summary
    report = validate(zero, deep=True)
    assert report.verdict is Verdict.CORRUPT and "blk.1.ffn_down.weight is all zeros" in report.summary


# --- Corrupt headers ----------------------------------------------------------------------------------
def _corruptions(path: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (damaged bytes, what the summary must say)."""
    data = path.read_bytes()
    f = GGUFFile.open(path)
    h = f.header
    first_kv = next(iter(h.fields.values()))
    tokens = h.fields["tokenizer.ggml.tokens"]
    infos = list(h.tensors.values())
    same_length = [t for t in infos if len(t.name) == len(infos[0].name) and t is not infos[0]][0]
    f.close()
    u64 = lambda v: struct.pack("<Q", v)  # noqa: E731
    ends_inside = "the file ends inside its header"
    return {
        "truncated in the key-values": (data[: tokens.value_start + 1000], ends_inside),
        "truncated in the tensor infos": (data[: (infos[0].start + infos[-1].end) // 2], ends_inside),
        "truncated in the data": (data[: h.data_offset + (len(data) - h.data_offset) // 2], "the file is truncated"),
        "truncated after the magic": (data[:6], ends_inside),
        "bad magic": (b"GGML" + data[4:], "not a GGUF file"),
        "unsupported version": (poke(data, 4, struct.pack("<I", 7)), "unsupported GGUF version 7"),
        "huge tensor count": (poke(data, 8, u64(1 << 63)), "far beyond any model"),
        "huge key-value count": (poke(data, 16, u64(1 << 40)), "far beyond any model"),
        "plausible but impossible count": (poke(data, 8, u64(200_000)), ends_inside),
        "huge key length": (poke(data, first_kv.start, u64(1 << 62)), ends_inside),
        "huge string array count": (poke(data, tokens.value_start + 8, u64(1 << 61)), ends_inside),
        "huge string length": (poke(data, tokens.value_start + 16, u64((1 << 64) - 1)), ends_inside),
        "huge dimension": (poke(data, infos[3].start + 8 + len(infos[3].name) + 4, u64(1 << 50)), "invalid dimensions"),
        "unknown tensor type": (poke(data, infos[3].end - 12, struct.pack("<I", 99)), "unknown type 99"),
        "unknown value type": (poke(data, first_kv.value_start, struct.pack("<I", 77)), "unknown value type 77"),
        "misplaced tensor data": (poke(data, infos[5].end - 8, u64(infos[5].offset + 32)), "where ggml expects"),
        "tensor data past the end": (poke(data, infos[-1].end - 8, u64(1 << 40)), "where ggml expects"),
        "duplicate tensor name": (poke(data, same_length.start + 8, infos[0].name.encode()), "duplicate tensor"),
        "invalid UTF-8": (poke(data, first_kv.start + 8, b"\xff"), "not valid UTF-8"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "truncated in the key-values",
        "truncated in the tensor infos",
        "truncated in the data",
        "truncated after the magic",
        "bad magic",
        "unsupported version",
        "huge tensor count",
        "huge key-value count",
        "plausible but impossible count",
        "huge key length",
        "huge string array count",
        "huge string length",
        "huge dimension",
        "unknown tensor type",
        "unknown value type",
        "misplaced tensor data",
        "tensor data past the end",
        "duplicate tensor name",
        "invalid UTF-8",
    ],
)
def test_each_header_corruption_is_one_line_and_exit_5(ws, tmp_path, case):
    data, reason = _corruptions(ws.gguf("tied_bf16", "bf16"))[case]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    started = time.perf_counter()
    report = validate(path)
    assert time.perf_counter() - started < 2.0
    assert report.verdict is Verdict.CORRUPT and report.exit_code == 5, report.summary
    assert reason in report.summary, report.summary
    assert_one_line(report)
    with pytest.raises(CorruptModelError):
        clef_gguf.load(path)


def test_unreadable_sources_are_corrupt_or_unreadable(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for source, reason in ((tmp_path / "missing.gguf", "No such file"), (tmp_path, "Is a directory"), (empty, "empty")):
        report = validate(source)
        assert report.verdict is Verdict.CORRUPT and reason in report.summary, report.summary
    run = clef_gguf_cli("validate", str(tmp_path / "missing.gguf"))
    assert run.returncode == 5 and "cannot read" in run.stdout and "Traceback" not in run.stderr


# --- Remote files -------------------------------------------------------------------------------------
class RangeServer:
    """A loopback HTTP server for files in `root`, honouring Range (or not), and counting bytes sent.

    Hub-style URLs /{owner}/{repo}/resolve/{revision}/{file} redirect to /files/{file}, as the Hub
    redirects to its CDN.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bytes_sent = 0
        self.requests: list[str] = []
        self.honour_range = True
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                server.requests.append(self.headers.get("Range", ""))
                hub = re.match(r"^/[^/]+/[^/]+/resolve/[^/]+/(.+)$", self.path)
                if hub:
                    self.send_response(302)
                    self.send_header("Location", f"/files/{hub[1]}")
                    self.end_headers()
                    return
                path = server.root / self.path.removeprefix("/files/")
                if not self.path.startswith("/files/") or not path.is_file():
                    self.send_error(404)
                    return
                size = path.stat().st_size
                match = re.match(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
                start, end = 0, size - 1
                if match and server.honour_range:
                    start, end = int(match[1]), min(int(match[2]), size - 1)
                    if start >= size:
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(end + 1 - start))
                self.end_headers()
                with path.open("rb") as f:
                    f.seek(start)
                    left = end + 1 - start
                    while left > 0:  # in chunks: the client hangs up once it has the header
                        chunk = f.read(min(left, 1 << 20))
                        try:
                            self.wfile.write(chunk)
                        except (BrokenPipeError, ConnectionResetError):
                            return
                        server.bytes_sent += len(chunk)
                        left -= len(chunk)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def server(flash_files, ws, tmp_path, monkeypatch) -> Iterator[RangeServer]:
    for name, path in (("backbone.gguf", flash_files["backbone"]), ("clef.gguf", ws.gguf("untied_f32", "f32"))):
        (tmp_path / name).write_bytes(path.read_bytes())
    data = (tmp_path / "clef.gguf").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) - 1000])
    srv = RangeServer(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.setattr(V, "FIRST_FETCH", 4096)  # the fixtures are small: make the header take several requests
    yield srv
    srv.close()


def test_remote_backbone_only_file_is_caught_from_its_header(server, flash_files):
    report = validate("someone/clef-flash-early:backbone.gguf")
    assert report.verdict is Verdict.NOT_A_DECISION_MODEL and report.summary.startswith(FLASH_MESSAGE)
    size = flash_files["backbone"].stat().st_size
    assert report.file_size == size and report.counts.backbone == 427
    assert report.bytes_read < 3 * report.header_size < size  # the header, not the file
    assert len(server.requests) > 1 and all(r.startswith("bytes=") for r in server.requests)


def test_remote_urls_revisions_and_failures(server):
    assert validate(f"{server.url}/files/clef.gguf").ok
    assert validate("someone/clef@v1.0:clef.gguf").ok
    truncated = validate(f"{server.url}/files/truncated.gguf")
    assert truncated.verdict is Verdict.CORRUPT and "the file is truncated" in truncated.summary
    missing = validate("someone/clef:nothing.gguf")
    assert missing.verdict is Verdict.CORRUPT and "not found (HTTP 404)" in missing.summary
    with pytest.raises(ValueError, match="download it"):
        validate("someone/clef:clef.gguf", deep=True)
    server.honour_range = False  # a server that ignores Range: read the start of the body, then hang up
    assert validate(f"{server.url}/files/clef.gguf").ok


def test_remote_cli(server):

    run = clef_gguf_cli("validate", "someone/clef-flash-early:backbone.gguf", env={"HF_ENDPOINT": server.url})
    assert run.returncode == 6, run.stderr
    assert FLASH_MESSAGE in run.stdout and "bytes over HTTP" in run.stdout


# --- Values (--deep) and the load-time probe --------------------------------------------------------
def _filled(f: GGUFFile, name: str, value: float) -> tuple:
    t = f.header.tensors[name]
    return name, t.dims, int(gguf.GGMLQuantizationType.F32), np.full(t.n_elements, value, dtype=np.float32).tobytes()


@pytest.mark.parametrize(
    ("name", "value", "verdict"),
    [
        ("dec.blk.0.ffn_up.bias", 0.0, Verdict.COMPLETE),  # zero biases are a trained model's, not a download's
        ("decision.hidden_norm.bias", 0.0, Verdict.COMPLETE),
        ("decision.proj_memory.weight", 0.0, "all zeros"),
        ("decision.proj_memory.weight", 3e38, "overflow float32"),
        ("blk.0.ffn_up.weight", float("nan"), "NaN or Inf"),
    ],
)
def test_deep_flags_broken_values_and_passes_zero_biases(ws, tmp_path, name, value, verdict):
    src = ws.gguf("untied_f32", "f32")
    f = GGUFFile.open(src)
    edited = rebuild(src, tmp_path / "edited.gguf", keep=lambda n: n != name, extra=[_filled(f, name, value)])
    f.close()
    assert validate(edited).ok  # the header is fine: only --deep reads values
    report = validate(edited, deep=True)
    if verdict is Verdict.COMPLETE:
        assert report.ok, report.summary
    else:
        assert report.verdict is Verdict.CORRUPT and verdict in report.summary and name in report.summary, report.summary


@pytest.mark.slow
def test_a_model_whose_scores_overflow_is_refused_at_load(ws, tmp_path):
    """Weights that parse but make NaN: the load's probe decision refuses them, so no request ever gets a NaN."""
    from clef_gguf.errors import ModelOutputError

    src = ws.gguf("untied_f32", "f32")
    f = GGUFFile.open(src)
    name = "decision.proj_memory.weight"
    edited = rebuild(src, tmp_path / "overflow.gguf", keep=lambda n: n != name, extra=[_filled(f, name, 3e38)])
    f.close()
    with pytest.raises(ModelOutputError, match="not finite"):
        clef_gguf.load(edited, max_prompt_tokens=1024)
    request = json.dumps({"state": "s", "questions": {"q": {"type": "noul"}}})
    run = clef_gguf_cli("decide", str(edited), "-", stdin=request)
    assert run.returncode == 5 and "not finite" in run.stderr and run.stdout == "" and "Traceback" not in run.stderr
