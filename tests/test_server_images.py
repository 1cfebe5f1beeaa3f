"""Images over HTTP: every form the clients send reaches the model as the same images (server/media.py).

A live server over a model loaded with its mmproj; each answer is checked against a direct decide() with
the same images (the runtime's parity with the reference is tests/test_images.py's).
"""

from __future__ import annotations

import base64
import copy
import io
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import numpy as np
import pytest
import typesafe_sdk as ts
from gguf import GGUFValueType as VT
from live_server import served
from PIL import Image
from server_helpers import TIMEOUT, reuse_apart, start

import clef_gguf
from clef_gguf.check.pair import validate_pair
from clef_gguf.format import vision as V
from clef_gguf.format.header import GGUFFile, Header
from clef_gguf.runtime.model import ClefModel
from clef_gguf.server import ServeSettings, create_app
from clef_gguf.server.run import settings_app
from clef_gguf.server.workers_ai import PREFIXES, ROUTE
from clef_gguf.settings import IMAGE_ALLOWANCE, ModelSpec, body_limit
from clef_gguf.testing.gguf_bytes import kv_array, kv_f32, kv_i32, kv_str, kv_u32, pack_str, rebuild

WORKERS_AI = (PREFIXES[0] + ROUTE).replace("{account_id}", "acct").replace("{model_id:path}", "@cf/cloudflare/clef-flash")
QUESTIONS = {
    "damaged": {"type": "noul", "instructions": "Is the product damaged?"},
    "kind": {"type": "choice", "instructions": "What is shown?", "criteria": {"shoe": "a shoe", "box": None, "cup": "a cup"}},
}


def encoded(height: int, width: int, fmt: str, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


PNG, JPEG, WEBP = encoded(96, 160, "PNG", 1), encoded(200, 120, "JPEG", 2), encoded(64, 300, "WEBP", 3)
MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


def data_url(data: bytes, media: str) -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def model(ws) -> Iterator[clef_gguf.ClefModel]:
    with clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=4096, mmproj=ws.mmproj("untied_f32", "f32")) as m:
        yield m


@pytest.fixture(scope="module")
def live(model) -> Iterator[str]:
    server = start(create_app(model, owns_model=False))
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def client(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def expected(model) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def decide(request: dict[str, Any]) -> dict[str, Any]:
        return reuse_apart(model.decide(copy.deepcopy(request)))

    return decide


def problem(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    [detail] = response.json()["detail"]
    return detail


def test_a_model_with_images_reads_image_sized_bodies(model):
    assert body_limit(model.max_prompt_tokens, images=True) == body_limit(model.max_prompt_tokens) + IMAGE_ALLOWANCE


def test_text_gets_the_text_limit_and_images_their_allowance(model, client, expected):
    """The allowance is for images: a body of text past the text-only limit is refused as it is (request_too_large),
    not tokenized first (a 14 MiB one took 2.8 s and 770 MB, then prompt_too_long); images past it in bytes, with
    a short text, are read as images, in each form a client sends them."""
    text_limit = body_limit(model.max_prompt_tokens)
    long_text = {"state": "word " * (text_limit // 5 + 100), "questions": QUESTIONS}
    response = client.post("/v1/systemone", json=long_text)
    assert response.status_code == 413 and response.json()["detail"]["error_type"] == "request_too_large", response.text
    assert "text" in response.json()["detail"]["message"]
    big = [encoded(140, 160, "PNG", seed) for seed in (4, 5)]  # noise: about 67 KB each, base64 90 KB
    assert sum(len(data_url(b, "image/png")) for b in big) > text_limit
    request = {"state": "A parcel photo.", "questions": QUESTIONS}
    want = expected({**request, "images": big})
    as_urls = {**request, "images": [data_url(b, "image/png") for b in big]}
    parts = [{"type": "image_url", "image_url": {"url": data_url(b, "image/png")}} for b in big]
    message = {"role": "user", "content": [{"type": "text", "text": "A parcel photo."}, *parts]}
    as_parts = {"state": [message], "questions": QUESTIONS}
    assert reuse_apart(client.post("/v1/systemone", json=as_urls).json()) == want
    answer = client.post("/v1/systemone", json=as_parts)
    assert answer.status_code == 200, answer.text


def test_workers_ai_images_in_both_documented_forms(client, expected):
    request = {"model": "clef-flash", "state": "A parcel photo.", "questions": QUESTIONS}
    direct = expected({**request, "images": [PNG, JPEG]})
    as_urls = {**request, "images": [data_url(PNG, "image/png"), data_url(JPEG, "image/jpeg")]}
    as_objects = {
        **request,
        "images": [{"content_type": "image/png", "base64": base64.b64encode(PNG).decode()}, data_url(JPEG, "image/jpg")],
    }
    for body in (as_urls, as_objects):
        assert reuse_apart(client.post("/v1/systemone", json=body).json()) == direct
        envelope = client.post(WORKERS_AI, json=body).json()
        assert envelope["success"] and reuse_apart(envelope["result"]) == direct
    assert direct["usage"]["input_tokens"] > expected(request)["usage"]["input_tokens"]  # the images were read


def test_llama_server_image_parts_of_chat_messages(client, expected):
    text = {"type": "text", "text": "Is this the shoe I ordered?"}
    image = {"type": "image_url", "image_url": {"url": data_url(WEBP, "image/webp")}}
    state = [{"role": "user", "content": [text, image]}]
    want = expected({"state": [{"role": "user", "content": [text]}], "questions": QUESTIONS, "images": [WEBP]})
    assert reuse_apart(client.post("/v1/systemone", json={"state": state, "questions": QUESTIONS}).json()) == want
    wrapped = {"state": {"messages": state}, "questions": QUESTIONS}
    want = expected({"state": {"messages": [{"role": "user", "content": [text]}]}, "questions": QUESTIONS, "images": [WEBP]})
    assert reuse_apart(client.post("/v1/systemone", json=wrapped).json()) == want


def test_a_bad_chat_part_image_is_named_where_it_is_in_the_state(client):
    """Not at images.N, where the runtime reads it (after the top-level images), but in its message."""
    text = {"type": "text", "text": "Is this the shoe I ordered?"}
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}}
    messages = [{"role": "user", "content": [text]}, {"role": "user", "content": [text, bad]}]
    for state, base in ((messages, ["body", "state"]), ({"messages": messages}, ["body", "state", "messages"])):
        body = {"state": state, "questions": QUESTIONS, "images": [data_url(PNG, "image/png")]}
        detail = problem(client.post("/v1/systemone", json=body))
        assert detail["loc"] == [*base, 1, "content", 1, "image_url"], detail


def test_the_typesafe_sdk_sends_image_assets_that_reach_the_model(live, expected):
    sent: list[httpx2.Request] = []
    questions = {"damaged": ts.Noul(instructions="Is the product damaged?")}
    # Uncompressed, to read the body it sent; then as it sends by default (zstd past 1 KiB when zstd is importable).
    for compression in (False, None):
        http = httpx2.Client(timeout=120, event_hooks={"request": [sent.append]})
        with ts.TypeSafeClient(base_url=live, api_key="local", http_client=http, compression=compression) as sdk:
            got = sdk.system_one(
                state="Compare photo1 with photo2.",
                questions=questions,
                assets={"photo1": ts.Image(PNG), "photo2": ts.Image(WEBP)},
            )
        want = expected(
            {
                "state": "Compare photo1 with photo2.",
                "questions": {"damaged": {"type": "noul", "instructions": "Is the product damaged?"}},
                "images": [PNG, WEBP],
            }
        )
        assert got.nouls["damaged"].noul == want["answers"]["damaged"]["noul"]
        assert got.usage.input_tokens == want["usage"]["input_tokens"]
    first, second = (r for r in sent if r.method == "POST")
    assert first.headers["content-type"].startswith("multipart/form-data") and b'name="asset-1"' in first.content
    assert second.headers.get("content-encoding") == "zstd"  # a compressed multipart body, decoded before it is split
    # An image placed in the state itself: the SDK's own placeholder, and one asset.
    with ts.TypeSafeClient(base_url=live, api_key="local") as sdk:
        got = sdk.system_one(state={"photo": ts.Image(JPEG)}, questions=questions)
        assert 0 <= got.nouls["damaged"].noul <= 1


def test_typesafe_json_assets_with_data_base64(client, expected):
    assets = {"<a>": {"type": "image", "format": "png", "data_base64": base64.b64encode(PNG).decode()}}
    body = {"state": "look <a>", "questions": QUESTIONS, "assets": assets}
    assert reuse_apart(client.post("/v1/systemone", json=body).json()) == expected(
        {"state": "look <a>", "questions": QUESTIONS, "images": [PNG]}
    )


def multipart(parts: list[tuple[str, str, bytes]], boundary: str = "b0undary") -> tuple[bytes, dict[str, str]]:
    out = b""
    for name, media, data in parts:
        out += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\nContent-Type: {media}\r\n\r\n'.encode()
            + data
            + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode(), {"content-type": f"multipart/form-data; boundary={boundary}"}


def test_bad_images_get_422_naming_the_image(client):
    request = {"state": "s", "questions": QUESTIONS}
    png = data_url(PNG, "image/png")
    cases = {
        "five images": ({**request, "images": [png] * 5}, ["body", "images"]),
        "a remote URL": ({**request, "images": [png, "https://example.com/a.png"]}, ["body", "images", 1]),
        "not base64": ({**request, "images": ["data:image/png;base64,%%%"]}, ["body", "images", 0]),
        "not an image": ({**request, "images": [data_url(b"hello, world", "image/png")]}, ["body", "images", 0]),
        "a truncated PNG": ({**request, "images": [data_url(PNG[: len(PNG) // 2], "image/png")]}, ["body", "images", 0]),
        "a media type": ({**request, "images": [data_url(PNG, "image/svg+xml")]}, ["body", "images", 0]),
        "a GIF": ({**request, "images": [data_url(encoded(8, 8, "GIF", 4), "image/gif")]}, ["body", "images", 0]),
        "a bad object": ({**request, "images": [{"content_type": "text/plain", "base64": "AAAA"}]}, ["body", "images", 0]),
        "an asset": (
            {**request, "assets": {"pic": {"type": "image", "format": "png", "data_base64": "AAAA"}}},
            ["body", "assets", "pic"],
        ),
        "an asset type": (
            {**request, "assets": {"clip": {"type": "video", "data_base64": "AAAA"}}},
            ["body", "assets", "clip", "type"],
        ),
        # Not a list, beside assets or not (beside them it was dropped, and the request answered).
        "images not a list": ({**request, "images": png}, ["body", "images"]),
        "images not a list, with assets": (
            {**request, "images": png, "assets": {"p": {"type": "image", "format": "png", "data_base64": png.split(",")[1]}}},
            ["body", "images"],
        ),
        "a video": ({**request, "videos": ["data:video/mp4;base64,AAAA"]}, ["body", "videos"]),
    }
    for name, (body, loc) in cases.items():
        detail = problem(client.post("/v1/systemone", json=body))
        assert detail["loc"] == loc, (name, detail)
    over = encoded(1, 1, "PNG", 5) + b"\0" * (4 << 20)  # over 4 MiB: refused unread, a 422 (not a 413)
    assert problem(client.post("/v1/systemone", json={**request, "images": [data_url(over, "image/png")]}))["loc"] == [
        "body",
        "images",
        0,
    ]


def test_bad_multipart_bodies_get_422(client):
    good = json.dumps({"state": "s", "questions": QUESTIONS, "assets": {"p": {"type": "image", "part": "asset-0"}}}).encode()
    cases = {
        "no request part": ([("asset-0", "image/png", PNG)], ["body", "request"]),
        "an unclaimed part": (
            [("request", "application/json", good), ("asset-0", "image/png", PNG), ("asset-1", "image/png", PNG)],
            ["body", "asset-1"],
        ),
        "a missing part": ([("request", "application/json", good)], ["body", "assets", "p", "part"]),
        "a corrupt image part": (
            [("request", "application/json", good), ("asset-0", "application/octet-stream", b"\x89PNG junk")],
            ["body", "assets", "p"],
        ),
    }
    for name, (parts, loc) in cases.items():
        content, headers = multipart(parts)
        assert problem(client.post("/v1/systemone", content=content, headers=headers))["loc"] == loc, name
    content, headers = multipart([("request", "application/json", good), ("asset-0", "application/octet-stream", WEBP)])
    response = client.post("/v1/systemone", content=content, headers=headers)
    assert response.status_code == 200, response.text
    unterminated = content[: content.rindex(b"--b0undary--")]
    assert problem(client.post("/v1/systemone", content=unterminated, headers=headers))["loc"] == ["body"]


# --- A fuzz of the mmproj header values validate reads: each file is refused, or its server answers images ----
def _header_edits(rng: np.random.Generator, header: Header) -> list[tuple[str, bytes, str]]:
    """One or two of the keys validate reads (hparams.read_vision_hparams), each given a value of its type from
    the edges (0, 1, one off, doubled, halved, int32 and uint32 maxima; tiny, huge, negative and non-finite
    floats) or another type: (key, packed key-value, what it was set to)."""
    keys = [
        V.KEY_EMBEDDING_LENGTH, V.KEY_HEAD_COUNT, V.KEY_FEED_FORWARD_LENGTH, V.KEY_BLOCK_COUNT, V.KEY_PROJECTION_DIM,
        V.KEY_IMAGE_SIZE, V.KEY_PATCH_SIZE, V.KEY_LAYER_NORM_EPS, V.KEY_SPATIAL_MERGE_SIZE, V.KEY_USE_GELU,
        V.KEY_USE_SILU, V.KEY_IMAGE_MEAN, V.KEY_IMAGE_STD, V.KEY_IMAGE_MIN_PIXELS, V.KEY_IMAGE_MAX_PIXELS,
        V.KEY_HAS_VISION, V.KEY_PROJECTOR,
    ]  # fmt: skip
    floats = [0.0, 1e-30, 1e-6, 0.5, 1.0, 3.0, -1.0, 1e38, float("inf"), float("nan")]
    edits = []
    for key in rng.choice(keys, size=int(rng.integers(1, 3)), replace=False):
        field = header.fields.get(key)
        kind = field.type if field is not None else VT.UINT32
        if rng.random() < 0.1:  # another type than clip.cpp reads (it asserts the type: an abort)
            kv, shown = (kv_i32(key, 1), "INT32 1") if kind != VT.INT32 else (kv_str(key, "1"), "STRING '1'")
        elif kind == VT.UINT32:
            old = int(field.value) if field is not None else 16 * 1024
            value = int(rng.choice([0, 1, 2, old - 1, old + 1, old * 2, old // 2, old * 1024 + 1, 2**31 - 1, 2**32 - 1]))
            value = min(max(value, 0), 2**32 - 1)
            kv, shown = kv_u32(key, value), str(value)
        elif kind == VT.FLOAT32:
            value = float(rng.choice(floats))
            kv, shown = kv_f32(key, value), repr(value)
        elif kind == VT.BOOL:
            value = not field.value
            kv, shown = pack_str(key) + bytes([VT.BOOL, 0, 0, 0, value]), repr(value)
        elif kind == VT.ARRAY:  # the mean or the std: one of the three channels
            triple = [float(v) for v in field.value]
            triple[int(rng.integers(3))] = float(rng.choice(floats))
            kv, shown = kv_array(key, VT.FLOAT32, "f", triple), repr(triple)
        else:
            value = str(rng.choice(["qwen2vl_merger", "qwen3vl_merger", ""]))
            kv, shown = kv_str(key, value), repr(value)
        edits.append((str(key), kv, shown))
    return edits


FUZZ_IMAGES = [(32, 32), (96, 160), (1, 300), (700, 40), (480, 640)]  # (height, width): aspect ratios up to 300


@contextmanager
def mmproj_served(gguf: Path, mmproj: Path, command: bool) -> Iterator[str]:
    """`clef-gguf serve GGUF --mmproj MMPROJ` (command: the subprocess), or the app it serves (server/launch.py's
    serve_file: the spec's ClefModel under settings_app, on uvicorn with serve's protocol) in this process, where each
    file costs no interpreter start: the URL either way."""
    if command:
        with served(gguf, "--mmproj", str(mmproj), "--state-cache", "0", "--max-prompt-tokens", "4096") as (url, _):
            yield url
        return
    spec = ModelSpec.of(gguf, mmproj=mmproj, state_cache=0, max_prompt_tokens=4096, n_threads=1)  # serve_process's --threads 1
    live = start(settings_app(ClefModel(spec), ServeSettings()))  # (the app owns the model: closed at its shutdown)
    try:
        yield live.url
    finally:
        live.stop()


@pytest.mark.slow
def test_any_mmproj_header_validate_passes_serves_its_images(ws, tmp_path):
    """A seeded fuzz of the mmproj's header values over the keys validate reads: each file gets a validate refusal,
    or a `clef-gguf serve --mmproj` that starts and answers image requests 200 (or, for an image the reference's
    processor itself refuses at these limits, 422 naming it); never a 500, and never a server that answers no image.
    The first file served is served by the command itself, the others by its app in this process (mmproj_served)."""
    gguf, seed = ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32")
    f = GGUFFile.open(seed)
    header = f.header
    f.close()
    rng = np.random.default_rng(23)
    requests = [
        {"state": "A parcel photo.", "questions": QUESTIONS, "images": [data_url(encoded(h, w, "PNG", h + w), "image/png")]}
        for h, w in FUZZ_IMAGES
    ]
    served_files, refused = [], 0
    for i in range(int(os.environ.get("CLEF_MMPROJ_FUZZ", "40"))):
        edits = _header_edits(rng, header)
        what = ", ".join(f"{key} = {shown}" for key, _, shown in edits)
        mmproj = rebuild(seed, tmp_path / f"{i}.mmproj.gguf", replace={key: kv for key, kv, _ in edits})
        report = validate_pair(gguf, mmproj)
        if report.exit_code:
            refused += 1
            continue
        with mmproj_served(gguf, mmproj, command=not served_files) as url:
            answers = [httpx.post(f"{url}/v1/systemone", json=r, timeout=TIMEOUT) for r in requests]
        for (h, w), answer in zip(FUZZ_IMAGES, answers, strict=True):
            if answer.status_code == 422:
                [detail] = answer.json()["detail"]
                assert detail["loc"] == ["body", "images", 0] and "pixels" in detail["msg"], (what, h, w, answer.text)
            else:
                assert answer.status_code == 200, (what, h, w, answer.text)
        assert any(a.status_code == 200 for a in answers), (what, [a.text for a in answers])
        served_files.append(what)
        os.remove(mmproj)
    print(f"\nmmproj header fuzz: {refused} refused by validate, {len(served_files)} served: {'; '.join(served_files)}")
    assert refused and served_files  # both sides of the line were reached
