"""Images in the runtime (load(mmproj=), request["images"]): the reference's answers, by every form, refused with a field.

The reference hands a request's images (PIL) to the release's Qwen3VLProcessor; clef-gguf decodes and
sizes them itself (runtime/images.py) and hands libmtmd the result. Compared here with the reference
(testing/oracle.py) on the untied fixture, whose pixel limits (16 to 256 tokens of 32 x 32 pixels) are
small enough that images are resized up, down and to odd aspect ratios.
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as processor_smart_resize

import clef_gguf
from clef_gguf.conversion.convert import default_mmproj_path
from clef_gguf.errors import ModelOutputError, RequestError
from clef_gguf.format import vision as V
from clef_gguf.runtime import images as I
from clef_gguf.runtime.state_cache import MIN_PREFIX_TOKENS
from clef_gguf.testing.golden import make_golden
from clef_gguf.testing.request_suite import largest_difference, long_state_text, response_probabilities

RELEASE = "untied_f32"
N_CTX = 4096
# The conversions compared with the reference: file type -> (head type, max |dp|), as tests/test_parity.py's. q8_0: a
# Q8_0 backbone and mmproj under an F32 head (the runtime's own error budget), and under the Q8_0 head convert
# writes by default, whose weight rounding adds its own. Measured, worst case of 1 image / of 4 images: f32 0.0001 /
# 0.0001; q8_0 0.012 / 0.012; q8_0 under the Q8_0 head 0.023 / 0.023.
CONVERSIONS = {"f32": ("auto", 0.005), "q8_0": ("f32", 0.02), "q8_0_q8_0_head": ("auto", 0.035)}
MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


# --- Images -----------------------------------------------------------------------------------------------
def picture(height: int, width: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Gradients, blocks and noise (not flat: resampling and JPEG have something to change), in `mode`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), ((x // 7 + y // 5) % 2) * 200], axis=-1)
    rgb = np.clip(base + rng.normal(0, 30, (height, width, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(rgb)
    if mode == "RGBA":  # alpha from opaque to fully transparent, with holes
        alpha = np.clip(x * 255 / max(width - 1, 1) + rng.normal(0, 20, (height, width)), 0, 255).astype(np.uint8)
        alpha[(x.astype(int) // 9 + y.astype(int) // 9) % 3 == 0] = 0
        image.putalpha(Image.fromarray(alpha))
        return image
    return image.convert(mode)


def file_of(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def palette_with_transparency() -> bytes:
    image = picture(90, 120, 5).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    return file_of(image, "PNG", transparency=3)


# name -> the file: (height, width) chosen for what the fixture's limits (16,384 to 262,144 pixels) do to it.
IMAGES: dict[str, bytes] = {
    "png_up": file_of(picture(100, 150, 1), "PNG"),  # 96 x 160 when rounded: under the minimum, resized up
    "jpeg": file_of(picture(300, 200, 2), "JPEG", quality=90),  # inside: rounded to 288 x 192
    "webp_wide": file_of(picture(40, 600, 3), "WEBP", quality=80),  # 1 x 19 tokens: an odd ratio
    "png_alpha_down": file_of(picture(700, 900, 4, "RGBA"), "PNG"),  # over the maximum, resized down; alpha
    "png_palette": palette_with_transparency(),  # tRNS on a palette, under the minimum
    "jpeg_gray_tall": file_of(picture(2400, 160, 6, "L"), "JPEG", quality=85),  # tall, over the maximum
    "webp_alpha": file_of(picture(64, 64, 7, "RGBA"), "WEBP", lossless=True),  # tiny: resized up 2x
    "png_ratio_200": file_of(picture(1, 200, 8), "PNG"),  # the largest ratio: a row of pixels, 1 x 57 tokens
    "jpeg_ratio_200": file_of(picture(3200, 16, 9), "JPEG", quality=90),  # and tall: 57 x 1 tokens
}


def fmt_of(data: bytes) -> str:
    return Image.open(io.BytesIO(data)).format


def data_url(data: bytes) -> str:
    return f"data:{MEDIA[fmt_of(data)]};base64,{base64.b64encode(data).decode()}"


def pil(data: bytes) -> Image.Image:
    """The image as the reference takes it: PIL's, opened from the very same bytes."""
    return Image.open(io.BytesIO(data))


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims a size (IHDR, RGB 8-bit) and holds almost nothing."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"\0" * 16)) + png_chunk(b"IEND", b"")
    )


# --- Requests ---------------------------------------------------------------------------------------------
QUESTIONS: dict[str, Any] = {
    "has_text": {"type": "noul", "instructions": "Does the picture show any text?"},
    "kind": {
        "type": "choice",
        "instructions": "What kind of picture is it?",
        "criteria": {"photo": "A photograph", "chart": "A chart or a plot", "screenshot": "A screenshot", "drawing": None},
    },
    "clutter": {"type": "score", "instructions": "How cluttered is it?", "criteria": ["empty", "sparse", "busy", "chaotic"]},
}
OTHER_QUESTIONS: dict[str, Any] = {
    "matches": {"type": "noul", "instructions": "Do the images match the ticket?", "criteria": {"true": "They show the item."}},
    "damage": {"type": "score", "instructions": "How damaged is the item?", "criteria": ["none", "scratched", "broken"]},
    "action": {"type": "choice", "criteria": {"refund": "Refund", "replace": ["Send a new one"], "reject": None}},
}
STATE = {"ticket": "The parcel arrived and the lamp in the photos is cracked.", "order": 4821}


def _request(images: list[Any], questions: dict[str, Any] = QUESTIONS, state: Any = STATE) -> dict[str, Any]:
    return {"model": "jev-latest", "state": state, "questions": questions, "images": images}


def _cached(response: dict[str, Any]) -> int:
    return response["usage"]["input_tokens_details"]["cached_tokens"]


# --- Fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_of(ws):
    """The fixture's model with its vision tower per file type, loaded once for the module."""
    loaded: dict[str, clef_gguf.ClefModel] = {}

    def get(conversion: str) -> clef_gguf.ClefModel:
        if conversion not in loaded:
            gguf = ws.gguf(RELEASE, conversion.split("_q8_0_head")[0], CONVERSIONS[conversion][0])
            loaded[conversion] = clef_gguf.load(gguf, max_prompt_tokens=N_CTX, state_cache=0, mmproj=default_mmproj_path(gguf))
        return loaded[conversion]

    yield get
    for model in loaded.values():
        model.close()


@pytest.fixture(scope="module")
def config(ws) -> dict[str, Any]:
    return json.loads((ws.release(RELEASE) / V.PREPROCESSOR_CONFIG).read_text())


@pytest.fixture(scope="module")
def limits(config) -> I.ImageLimits:
    return I.ImageLimits(
        config["patch_size"] * config["merge_size"], config["size"]["shortest_edge"], config["size"]["longest_edge"]
    )


@pytest.fixture(scope="module")
def processor(config) -> Qwen2VLImageProcessorPil:
    """The release's image processor, as the oracle builds it (testing/oracle.release_processor)."""
    return Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if k not in ("processor_class", "image_processor_type")})


# --- 1. Parity with the reference -------------------------------------------------------------------------
# case -> (images, questions); one image in each format and resize, and four of different sizes and formats.
CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "1_png_up": (["png_up"], QUESTIONS),
    "1_jpeg": (["jpeg"], OTHER_QUESTIONS),
    "1_webp_wide": (["webp_wide"], QUESTIONS),
    "1_png_alpha_down": (["png_alpha_down"], OTHER_QUESTIONS),
    "4_mixed": (["png_alpha_down", "jpeg", "webp_wide", "png_palette"], QUESTIONS),
    "4_other": (["jpeg_gray_tall", "webp_alpha", "png_up", "jpeg"], OTHER_QUESTIONS),
    "4_ratio_200": (["png_ratio_200", "jpeg_ratio_200", "png_palette", "webp_wide"], QUESTIONS),
}


@pytest.fixture(scope="module")
def reference(ws):
    """The oracle's (input ids, probabilities) per case, its images PIL images of the same bytes."""
    done: dict[str, tuple[list[int], dict[str, dict[str, float]]]] = {}

    def get(case: str) -> tuple[list[int], dict[str, dict[str, float]]]:
        if case not in done:
            names, questions = CASES[case]
            request = _request([pil(IMAGES[n]) for n in names], questions)
            oracle = ws.oracle(RELEASE)
            done[case] = oracle.input_ids(request), oracle.probabilities(request)
        return done[case]

    return get


def test_the_images_cover_every_format_and_resize(limits):
    formats = {name: fmt_of(data) for name, data in IMAGES.items()}
    assert set(formats.values()) == {"PNG", "JPEG", "WEBP"}
    modes = {pil(data).mode for data in IMAGES.values()}
    assert {"RGB", "RGBA", "P", "L"} <= modes and pil(IMAGES["png_palette"]).info.get("transparency") is not None
    rounded = {}
    for name, data in IMAGES.items():
        width, height = pil(data).size
        rounded[name] = round(height / limits.factor) * round(width / limits.factor) * limits.factor**2
    assert rounded["png_up"] < limits.min_pixels and rounded["webp_alpha"] < limits.min_pixels
    assert rounded["png_alpha_down"] > limits.max_pixels and rounded["jpeg_gray_tall"] > limits.max_pixels
    assert limits.min_pixels <= rounded["jpeg"] <= limits.max_pixels
    ratios = {name: max(pil(d).size) / min(pil(d).size) for name, d in IMAGES.items()}
    assert ratios["webp_wide"] == ratios["jpeg_gray_tall"] == 15 and ratios["png_ratio_200"] == ratios["jpeg_ratio_200"] == 200


@pytest.mark.device
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_answers_match_the_reference(model_of, reference, conversion, case):
    names, questions = CASES[case]
    request = _request([data_url(IMAGES[n]) for n in names], questions)
    model = model_of(conversion)
    expected_ids, expected = reference(case)
    prompt = model.encode(request)
    assert prompt.tokens == expected_ids  # the image pads, as many as the processor's grid gives, in the same place
    assert len(prompt.images) == len(names)
    response = model.decide(request)
    assert response["usage"]["input_tokens"] == len(expected_ids)
    assert list(response["answers"]) == list(questions)
    # Parity means little if every answer is 1/n: the fixture must be decisive on these requests.
    assert max(max(p.values()) * len(p) for p in expected.values()) > 1.5, expected
    worst = largest_difference(response_probabilities(response), expected)
    print(f"\nmax |dp| {conversion} {case}: {worst:.5f}")
    assert worst <= CONVERSIONS[conversion][1], f"max |dp| = {worst:.5f}"


def test_the_reference_response_is_ours(ws, model_of):
    """Beyond the probabilities: the reference's own systemone on four images, its usage and choices."""
    names, questions = CASES["4_mixed"]
    theirs = ws.oracle(RELEASE).answer(_request([pil(IMAGES[n]) for n in names], questions))
    ours = model_of("f32").decide(_request([data_url(IMAGES[n]) for n in names], questions))
    assert {k: v for k, v in ours["usage"].items() if k != "input_tokens_details"} == theirs["usage"]
    for qid, expected in theirs["answers"].items():
        answer = ours["answers"][qid]
        assert answer["type"] == expected["type"] and answer.get("choice") == expected.get("choice")
        for key in ("noul", "score"):
            assert answer.get(key) == pytest.approx(expected.get(key), abs=0.002)


@pytest.mark.device
def test_the_images_change_the_answers(model_of):
    """Not a tower whose output is ignored: another image, or none, gives other answers."""
    model = model_of("f32")
    answers = [
        model.decide(_request(images))["answers"] for images in ([], [data_url(IMAGES["jpeg"])], [data_url(IMAGES["png_up"])])
    ]
    assert answers[0] != answers[1] != answers[2] != answers[0]


# --- 2. Sizing as the processor's ---------------------------------------------------------------------------
def _sides(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    pairs = []
    while len(pairs) < n:
        h, w = (int(v) for v in np.exp(rng.uniform(0, math.log(8000), 2)))
        if max(h, w) / min(h, w) <= I.MAX_ASPECT_RATIO:  # the processor's smart_resize refuses the rest
            pairs.append((h, w))
    return pairs


# Halves (48 / 32 = 1.5, 80 / 32 = 2.5: round() to even), each side of the limits, the aspect-ratio bound.
EDGE_SIDES = [(1, 1), (1, 200), (200, 1), (48, 48), (80, 80), (48, 80), (112, 144), (128, 128), (127, 129)]
EDGE_SIDES += [(512, 512), (512, 513), (16, 3200), (3200, 16), (4000, 4000), (1, 20), (7, 1400)]


@pytest.mark.parametrize(
    "limit_set",
    [
        None,  # the fixture's (from its preprocessor_config.json)
        I.ImageLimits(32, 65_536, 16_777_216),  # Qwen3.5's: 64 to 16,384 tokens
        I.ImageLimits(32, 8 * 1024, 4096 * 1024),  # llama.cpp's Qwen-VL defaults
        I.ImageLimits(28, 56 * 56, 28 * 28 * 1280),  # Qwen2-VL's own
    ],
)
def test_smart_resize_is_the_processors(limits, limit_set):
    chosen = limits if limit_set is None else limit_set
    pairs = _sides(np.random.default_rng(11), 400) + EDGE_SIDES
    for h, w in pairs:
        expected = processor_smart_resize(h, w, factor=chosen.factor, min_pixels=chosen.min_pixels, max_pixels=chosen.max_pixels)
        assert I.smart_resize(h, w, chosen) == expected, (h, w)


def test_the_limits_come_from_the_mmproj(model_of, limits):
    for conversion in CONVERSIONS:
        assert model_of(conversion).image_limits == limits == I.ImageLimits(32, 16 * 1024, 256 * 1024)


def _pixel_cases() -> dict[str, bytes]:
    """The parity images and every PNG/JPEG mode PIL reads, each a conversion to RGB of its own."""
    rng = np.random.default_rng(12)
    gray = picture(70, 110, 13, "L")
    apng = io.BytesIO()
    picture(60, 90, 14).save(apng, "PNG", save_all=True, append_images=[picture(60, 90, 15)])
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotated; neither the processor nor the runtime applies it (see the EXIF test below)
    cases = dict(IMAGES)
    cases |= {
        "png_16bit": file_of(Image.fromarray(rng.integers(0, 65535, (90, 130), dtype=np.uint16)), "PNG"),
        "png_16bit_trns": file_of(Image.fromarray(rng.integers(0, 65535, (90, 130), dtype=np.uint16)), "PNG", transparency=999),
        "png_gray_trns": file_of(gray, "PNG", transparency=7),
        "png_1bit": file_of(gray.convert("1"), "PNG"),
        "png_la": file_of(Image.merge("LA", [gray, gray.point(lambda v: 255 - v)]), "PNG"),
        "png_rgb_trns": file_of(picture(70, 110, 16), "PNG", transparency=(10, 20, 30)),
        "jpeg_cmyk": file_of(picture(150, 100, 17).convert("CMYK"), "JPEG"),
        "jpeg_exif_rotated": file_of(picture(120, 200, 18), "JPEG", exif=exif),
        "jpeg_progressive": file_of(picture(333, 444, 19), "JPEG", progressive=True),
        "apng_first_frame": apng.getvalue(),
        "webp_lossy_alpha": file_of(picture(200, 50, 20, "RGBA"), "WEBP", quality=70),
    }
    return cases


PIXEL_CASES = _pixel_cases()


def _unpatchify(pixel_values: np.ndarray, gh: int, gw: int, patch: int, merge: int, temporal: int) -> np.ndarray:
    """The processor's flattened patches (Qwen2VLImageProcessorPil.patchify) back to (C, H, W), each temporal copy checked."""
    x = pixel_values.reshape(gh // merge, gw // merge, merge, merge, 3, temporal, patch, patch)
    for t in range(1, temporal):
        assert np.array_equal(x[:, :, :, :, :, t], x[:, :, :, :, :, 0])  # an image is its frame `temporal` times
    return x[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * patch, gw * patch)


@pytest.mark.parametrize("name", list(PIXEL_CASES))
def test_prepared_pixels_are_the_processors(config, limits, processor, name):
    data = PIXEL_CASES[name]
    prepared = I.prepare(data, limits, "images.0")
    out = processor(images=[pil(data)], return_tensors="np")
    patch, merge, temporal = config["patch_size"], config["merge_size"], config["temporal_patch_size"]
    ((t, gh, gw),) = out["image_grid_thw"].tolist()
    assert (t, gh, gw) == (1, prepared.ny * merge, prepared.nx * merge)
    assert prepared.pixels.shape == (gh * patch, gw * patch, 3) and prepared.pixels.dtype == np.uint8
    theirs = _unpatchify(np.asarray(out["pixel_values"]), gh, gw, patch, merge, temporal)
    mean, std = np.float32(config["image_mean"]), np.float32(config["image_std"])
    ours = ((prepared.pixels.astype(np.float32) / np.float32(255) - mean) / std).transpose(2, 0, 1)
    # One step of a uint8 pixel is 1 / 255 / 0.28 = 0.014: any pixel off by one is caught; float32 rounding is not.
    assert np.abs(ours - theirs).max() < 1e-5


def test_exif_orientation_is_ignored_as_the_references_own_loader_ignores_it(limits, tmp_path):
    """An image is its stored pixels, whatever its EXIF orientation says. The reference loads a record's images with
    `Image.open(path).convert("RGB")` (clef_finetune.data.resolve_images), which does not apply the orientation, and
    hands PIL images to its processor, which does not either: transformers' load_image would (exif_transpose), but the
    reference never calls it. llama.cpp's stb_image ignores EXIF too. Rotating here would answer about another image."""
    from clef_finetune.data import resolve_images
    from transformers.image_utils import load_image

    image = picture(120, 200, 18)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees clockwise for display
    rotated, plain = file_of(image, "JPEG", exif=exif), file_of(image, "JPEG")
    (tmp_path / "rotated.jpg").write_bytes(rotated)
    [loaded] = resolve_images({"images": ["rotated.jpg"]}, tmp_path)["images"]
    assert loaded.size == (200, 120) and np.array_equal(np.asarray(loaded), np.asarray(pil(plain)))
    assert load_image(str(tmp_path / "rotated.jpg")).size == (120, 200)  # the choice is real: this one would rotate
    ours, unrotated = I.prepare(rotated, limits, "images.0"), I.prepare(plain, limits, "images.0")
    assert (ours.nx, ours.ny, ours.digest) == (unrotated.nx, unrotated.ny, unrotated.digest) and ours.nx > ours.ny


# --- 3. The same image by every form ----------------------------------------------------------------------
def _forms(data: bytes) -> dict[str, Any]:
    b64 = base64.b64encode(data).decode()
    media = MEDIA[fmt_of(data)]
    return {
        "data_url": f"data:{media};base64,{b64}",
        "data_url_upper_case": f"DATA:{media.upper()};BASE64,{b64}",
        "data_url_no_media_type": f"data:;base64,{b64}",
        "data_url_mislabelled": f"data:image/png;base64,{b64}",  # a JPEG: the format is read from the bytes
        "object": {"content_type": media, "base64": b64},
        "base64": b64,
        "base64_mime_lines": "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76)),
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "pil": pil(data),
        "pil_loaded_rgb": pil(data).convert("RGB"),
    }


def test_every_form_of_an_image_gives_the_same_answers(model_of):
    model = model_of("f32")
    data = IMAGES["jpeg"]
    expected = model.decide(_request([data_url(data)]))
    for form, value in _forms(data).items():
        got = model.decide(_request([value]))
        assert got == expected, form
    other = model.decide(_request([data_url(IMAGES["png_up"])]))
    assert other["answers"] != expected["answers"]


def _message(text: str, *images: Any, part_first: bool = False) -> dict[str, Any]:
    parts: list[Any] = [{"type": "image_url", "image_url": {"url": image}} for image in images]
    text_part = {"type": "text", "text": text}
    return {"role": "user", "content": [*parts, text_part] if part_first else [text_part, *parts]}


def test_image_parts_of_chat_messages_are_taken_out_and_placed_with_the_others(model_of):
    model = model_of("f32")
    one, two = data_url(IMAGES["jpeg"]), data_url(IMAGES["png_palette"])
    messages = [
        {"role": "system", "content": "You look at parcels."},
        _message("Here is the lamp.", one),
        {"role": "assistant", "content": "Thanks."},
        _message("And the box.", two, part_first=True),
    ]
    text_only = [messages[0], _message("Here is the lamp."), messages[2], _message("And the box.", part_first=True)]
    assert text_only[1]["content"] == [{"type": "text", "text": "Here is the lamp."}]
    expected = model.decide(_request([one, two], state=text_only))
    assert model.encode(_request([], state=messages)).tokens == model.encode(_request([one, two], state=text_only)).tokens
    assert model.decide(_request([], state=messages)) == expected
    wrapped = model.decide(_request([], state={"messages": messages, "channel": "email"}))
    assert wrapped == model.decide(_request([one, two], state={"messages": text_only, "channel": "email"}))
    # The request's `images` first, then the messages' in order; a bare-string image_url too (llama-server's older form).
    text = [_message("Here is the lamp.")]
    in_order = model.decide(_request([one, two], state=text))
    mixed = [
        {"role": "user", "content": [{"type": "text", "text": "Here is the lamp."}, {"type": "image_url", "image_url": two}]}
    ]
    assert model.decide(_request([one], state=mixed)) == in_order
    swapped = model.decide(_request([two], state=[_message("Here is the lamp.", one)]))
    assert swapped == model.decide(_request([two, one], state=text)) and swapped["answers"] != in_order["answers"]
    # A state that only looks like messages (no image part) is left as it is.
    plain = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "url": one}]}]
    assert model.encode(_request([], state=plain)).images == ()


# --- 4. The state cache with images ----------------------------------------------------------------------
@pytest.mark.device
def test_the_state_cache_keys_a_state_by_its_images(ws, model_of):
    gguf = ws.gguf(RELEASE, "f32")
    state = {"ticket": long_state_text(2)}
    first, same_size = data_url(IMAGES["jpeg"]), data_url(file_of(picture(300, 200, 99), "JPEG", quality=90))
    with clef_gguf.load(gguf, max_prompt_tokens=N_CTX, state_cache=1 << 30, mmproj=default_mmproj_path(gguf)) as model:
        prompt = model.encode(_request([first], state=state))
        assert prompt.state_prefix >= MIN_PREFIX_TOKENS
        assert model.encode(_request([same_size], state=state)).tokens == prompt.tokens  # only the pixels differ
        cold, hit = model.decide(_request([first], state=state)), model.decide(_request([first], state=state))
        assert (_cached(cold), _cached(hit)) == (prompt.preamble, prompt.state_prefix) and hit == {**cold, "usage": hit["usage"]}
        assert hit["answers"] == cold["answers"]
        # The same pixels by another form: the same key (the digest is of the pixels, not of the file).
        assert _cached(model.decide(_request([IMAGES["jpeg"]], state=state))) == prompt.state_prefix
        # Another image of the same size: its own prefix, computed, other answers.
        other = model.decide(_request([same_size], state=state))
        assert _cached(other) == prompt.preamble and other["answers"] != cold["answers"]
        assert len(model.state_cache) == 3  # (and the template's preamble, before the images)
        # A new schema on a cached state and image: only the schema is computed, as without the cache.
        new_schema = model.decide(_request([same_size], OTHER_QUESTIONS, state=state))
        assert _cached(new_schema) == prompt.state_prefix
        # Two images in the other order are another prefix.
        both = [model.decide(_request(images, state=state)) for images in ([first, same_size], [same_size, first])]
        assert [_cached(r) for r in both] == [prompt.preamble] * 2 and both[0]["answers"] != both[1]["answers"]
        assert _cached(model.decide(_request([same_size, first], state=state))) > prompt.preamble
    off = model_of("f32")  # the cache off, the same ubatch: the same answers, to the bit
    assert off.decide(_request([first], state=state))["answers"] == cold["answers"]
    assert off.decide(_request([same_size], OTHER_QUESTIONS, state=state))["answers"] == new_schema["answers"]


# --- 5. Bad images: RequestErrors naming the image -----------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


PNG = IMAGES["png_up"]
# name -> (request changes, the field, a phrase of the message)
BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "five_images": ({"images": [data_url(PNG)] * 5}, "images", "at most 4"),
    "not_a_list": ({"images": data_url(PNG)}, "images", "list"),
    "https_url": ({"images": ["https://example.com/cat.png"]}, "images.0", "remote image URLs are not fetched"),
    "http_url": ({"images": [data_url(PNG), " http://example.com/cat.png"]}, "images.1", "remote"),
    "file_url": ({"images": ["file:///etc/passwd"]}, "images.0", "remote"),
    "invalid_base64": ({"images": ["this is not base64!"]}, "images.0", "neither a data URL nor base64"),
    "invalid_base64_in_data_url": ({"images": ["data:image/png;base64,@@@@"]}, "images.0", "base64"),
    "data_url_not_base64": ({"images": ["data:image/png,%89PNG"]}, "images.0", "must be base64"),
    "text_plain": ({"images": ["data:text/plain;base64," + _b64(PNG)]}, "images.0", "'text/plain'"),
    "tiff_media_type": ({"images": ["data:image/tiff;base64," + _b64(PNG)]}, "images.0", "'image/tiff'"),
    "svg_media_type": ({"images": ["data:image/svg+xml;base64," + _b64(b"<svg/>")]}, "images.0", "'image/svg+xml'"),
    "object_gif_type": ({"images": [{"content_type": "image/gif", "base64": _b64(PNG)}]}, "images.0", "content_type"),
    "object_no_type": ({"images": [{"base64": _b64(PNG)}]}, "images.0", "content_type"),
    "object_type_not_a_string": ({"images": [{"content_type": 7, "base64": _b64(PNG)}]}, "images.0", "content_type"),
    "object_no_base64": ({"images": [{"content_type": "image/png", "data": _b64(PNG)}]}, "images.0", "a data URL"),
    "over_4_mib_bytes": ({"images": [b"\x89PNG" + bytes(4 << 20)]}, "images.0", "4 MiB"),
    "over_4_mib_base64": ({"images": [data_url(PNG) + "A" * (6 << 20)]}, "images.0", "4 MiB"),
    "over_8_mib_in_all": ({"images": [bytes(3 << 20)] * 3}, "images", "8 MiB"),
    "over_16_megapixels": ({"images": [png_header_only(5000, 4000)]}, "images.0", "16,000,000"),
    "a_decompression_bomb": ({"images": [png_header_only(40000, 40000)]}, "images.0", ""),
    "aspect_ratio_over_200": ({"images": [file_of(picture(1, 201, 1), "PNG")]}, "images.0", "aspect ratio is over 200"),
    "aspect_ratio_tall": ({"images": [file_of(picture(700, 3, 1), "PNG")]}, "images.0", "aspect ratio is over 200"),
    "gif": ({"images": [file_of(picture(64, 64, 1), "GIF")]}, "images.0", "format"),
    "gif_labelled_png": ({"images": ["data:image/png;base64," + _b64(file_of(picture(64, 64, 1), "GIF"))]}, "images.0", "format"),
    "bmp": ({"images": [file_of(picture(64, 64, 1), "BMP")]}, "images.0", "format"),
    "tiff_bytes": ({"images": [file_of(picture(64, 64, 1), "TIFF")]}, "images.0", "format"),
    "svg_bytes": ({"images": [b'<svg xmlns="http://www.w3.org/2000/svg"/>']}, "images.0", "format"),
    "empty_string": ({"images": [""]}, "images.0", "empty"),
    "blank_string": ({"images": ["  \n "]}, "images.0", "empty"),
    "empty_data_url": ({"images": ["data:image/png;base64,"]}, "images.0", "empty"),
    "empty_bytes": ({"images": [b""]}, "images.0", "empty"),
    "a_number": ({"images": [42]}, "images.0", "data URL"),
    "a_float": ({"images": [data_url(PNG), 1.5]}, "images.1", "data URL"),
    "null": ({"images": [None]}, "images.0", "data URL"),
    "a_list": ({"images": [[data_url(PNG)]]}, "images.0", "data URL"),
    "truncated_png": ({"images": [PNG[: len(PNG) // 2]]}, "images.0", "could not be decoded"),
    "the_third_image_is_bad": ({"images": [PNG, PNG, PNG[:100]]}, "images.2", ""),
    "an_image_part_without_url": (
        {"state": [{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "high"}}]}]},
        "images.0",
        "data URL",
    ),
    "a_bad_image_part": (
        {"images": [PNG], "state": [_message("see", "https://example.com/a.png")]},
        "images.1",
        "remote",
    ),
    "videos": ({"videos": ["data:video/mp4;base64,AAAA"]}, "videos", "videos are not supported"),
    "videos_and_images": ({"images": [data_url(PNG)], "videos": [{"url": "x"}]}, "videos", "videos"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_image_is_a_request_error_naming_it(model_of, name):
    changes, field, phrase = BAD[name]
    request = {**_request([]), **changes}
    model = model_of("f32")
    with pytest.raises(RequestError) as raised:
        model.encode(request)
    assert raised.value.field == field, raised.value
    assert phrase in raised.value.reason and "\n" not in str(raised.value)
    with pytest.raises(RequestError):  # decide too, before any compute
        model.decide(request)


def test_the_limits_are_inclusive(model_of):
    """Exactly 4 images, a ratio of exactly 200, exactly 4 MiB: answered."""
    model = model_of("f32")
    exactly_200 = file_of(picture(1, 200, 1), "PNG")
    assert model.encode(_request([exactly_200])).images[0].image.n_tokens >= 16
    assert len(model.encode(_request([data_url(IMAGES["webp_wide"])] * 4)).images) == 4
    padded = PNG + bytes(I.MAX_IMAGE_BYTES - len(PNG))  # PNG ignores what follows IEND
    assert len(padded) == I.MAX_IMAGE_BYTES and model.encode(_request([padded])).images
    # In base64 too, in MIME's lines of 76 (the line breaks are not the image's bytes), in a data URL or bare.
    for text in (base64.b64encode(padded).decode(), base64.encodebytes(padded).decode()):
        for value in (text, "data:image/png;base64," + text.replace("\n", "\r\n")):
            assert len(model.encode(_request([value])).images) == 1
    with pytest.raises(RequestError, match="4 MiB"):
        model.encode(_request([base64.encodebytes(padded + b"\0").decode()]))
    assert model.encode({**_request([]), "videos": []}).images == ()  # an empty videos list is no video


def test_without_the_vision_tower_images_are_refused_saying_how_to_add_it(ws):
    model = ws.model(RELEASE, "f32")  # loaded without mmproj
    assert model.image_limits is None and model.vision is None
    with pytest.raises(RequestError) as raised:
        model.decide(_request([data_url(PNG)]))
    assert raised.value.field == "images"
    assert "mmproj" in raised.value.reason and "without its vision tower" in raised.value.reason
    image_part = [_message("see", data_url(PNG))]
    with pytest.raises(RequestError, match="mmproj"):
        model.encode(_request([], state=image_part))
    assert model.decide(_request([]))["answers"]  # no images: answered as ever


# --- 6. Fuzz -------------------------------------------------------------------------------------------------
def _fuzz_bases() -> list[bytes]:
    small = picture(48, 64, 30)
    return [
        file_of(small, "PNG"),
        file_of(picture(40, 40, 31, "RGBA"), "PNG"),
        file_of(small.convert("P", palette=Image.Palette.ADAPTIVE, colors=16), "PNG", transparency=2),
        file_of(small, "JPEG", quality=80),
        file_of(small, "JPEG", progressive=True),
        file_of(small, "WEBP", quality=70),
        file_of(picture(40, 40, 32, "RGBA"), "WEBP", lossless=True),
    ]


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, i = [], 8
    while i + 8 <= len(data):
        (length,) = struct.unpack(">I", data[i : i + 4])
        chunks.append((data[i + 4 : i + 8], data[i + 8 : i + 8 + length]))
        i += 12 + length
    return chunks


def _corrupt_png(rng: np.random.Generator, data: bytes) -> bytes:
    """Chunks damaged with valid CRCs, so that the decoder, not the checksum, meets the damage."""
    chunks = _png_chunks(data)
    kind = int(rng.integers(0, 7))
    if kind == 0:  # an IHDR field out of range: width, height, bit depth, colour type, interlace
        fields = list(struct.unpack(">IIBBBBB", chunks[0][1]))
        field = [0, 1, 2, 3, 6][int(rng.integers(0, 5))]
        choices = {
            0: [0, 1, 3, 1 << 16, 1 << 31],
            1: [0, 1, 3, 1 << 16, 1 << 31],
            2: [0, 3, 7, 32],
            3: [1, 5, 7, 255],
            6: [2, 255],
        }
        fields[field] = int(rng.choice(choices[field]))
        chunks[0] = (b"IHDR", struct.pack(">IIBBBBB", *fields))
    elif kind == 1:  # IDAT: random bytes, or a valid stream of the wrong length
        payload = (
            rng.bytes(int(rng.integers(1, 400))) if rng.random() < 0.5 else zlib.compress(rng.bytes(int(rng.integers(1, 9000))))
        )
        chunks = [(k, payload if k == b"IDAT" else p) for k, p in chunks]
    elif kind == 2:  # a broken zlib stream in IDAT
        chunks = [(k, bytearray(p) if k == b"IDAT" else p) for k, p in chunks]
        for k, p in chunks:
            if k == b"IDAT":
                for _ in range(3):
                    p[int(rng.integers(0, len(p)))] ^= 1 << int(rng.integers(0, 8))
        chunks = [(k, bytes(p)) for k, p in chunks]
    elif kind == 3:  # ancillary chunks with nonsense: compressed text, ICC profile, palette, transparency, gamma
        name = [b"zTXt", b"iCCP", b"iTXt", b"PLTE", b"tRNS", b"gAMA", b"pHYs", b"sBIT", b"eXIf", b"acTL"][
            int(rng.integers(0, 10))
        ]
        chunks.insert(1, (name, rng.bytes(int(rng.integers(0, 64)))))
    elif kind == 4:  # a compressed text chunk whose stream is a zip bomb-like run
        chunks.insert(1, (b"zTXt", b"k\0\0" + zlib.compress(bytes(int(rng.integers(1, 1 << 22))))))
    elif kind == 5:  # chunks dropped or repeated
        i = int(rng.integers(0, len(chunks)))
        chunks = chunks[:i] + chunks[i + 1 :] if rng.random() < 0.5 else chunks[: i + 1] + chunks[i:]
    else:  # a chunk length past the end
        out = b"\x89PNG\r\n\x1a\n" + b"".join(png_chunk(k, p) for k, p in chunks)
        i = 8 + 12 + len(chunks[0][1])
        return out[:i] + struct.pack(">I", int(rng.integers(1 << 20, 1 << 31))) + out[i + 4 :]
    return b"\x89PNG\r\n\x1a\n" + b"".join(png_chunk(k, p) for k, p in chunks)


def _fuzz_cases(n: int, seed: int = 2024) -> list[bytes]:
    rng = np.random.default_rng(seed)
    bases = _fuzz_bases()
    cases = []
    for i in range(n):
        base = bases[i % len(bases)]
        kind = i % 5
        if kind == 0:  # truncated at a random length
            data = base[: int(rng.integers(1, len(base)))]
        elif kind == 1:  # random bit flips
            data = bytearray(base)
            for _ in range(int(rng.integers(1, 9))):
                data[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
            data = bytes(data)
        elif kind == 2:  # random bytes behind the format's signature (or none)
            data = base[: int(rng.choice([0, 4, 12, 16]))] + rng.bytes(int(rng.integers(1, 2000)))
        elif kind == 3 and base.startswith(b"\x89PNG"):
            data = _corrupt_png(rng, base)
        else:  # a run of bytes overwritten
            data = bytearray(base)
            start = int(rng.integers(0, len(data)))
            run = min(int(rng.integers(1, 64)), len(data) - start)
            data[start : start + run] = rng.bytes(run)
            data = bytes(data)
        cases.append(data)
    return cases


@pytest.mark.slow
def test_corrupt_images_are_request_errors_or_answered(model_of):
    model = model_of("f32")
    questions = {"ok": {"type": "noul", "instructions": "Is it a lamp?"}}
    refused, answered = 0, set()
    for i, data in enumerate(_fuzz_cases(400)):
        form = [data, _b64(data), {"content_type": "image/webp", "base64": _b64(data)}][i % 3]
        request = _request([form], questions, state="look")
        try:
            prompt = model.encode(request)
        except RequestError as e:
            assert e.field is not None and e.field.startswith("images"), (i, e)
            refused += 1
            continue
        digest = prompt.images[0].image.digest
        if digest in answered:  # the same pixels as an earlier case: the same decision
            continue
        answered.add(digest)
        response = model.decide(prompt)
        noul = response["answers"]["ok"]["noul"]
        assert math.isfinite(noul) and 0 <= noul <= 1, i
    print(f"\nfuzz: {refused} refused, {len(answered)} distinct images answered")
    assert refused > 100 and len(answered) > 10  # both paths were taken


# --- 7. An mmproj of llama.cpp's own converter ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_cpp_model(ws, tmp_path_factory):
    """The f32 model with the vision tower llama.cpp's convert_hf_to_gguf.py --mmproj writes (clef_gguf/testing/golden.py)."""
    mmproj = make_golden(ws.release(RELEASE), tmp_path_factory.mktemp("golden-mmproj"), "f32", mmproj=True)
    with clef_gguf.load(ws.gguf(RELEASE, "f32"), max_prompt_tokens=N_CTX, state_cache=0, mmproj=mmproj) as model:
        yield model


@pytest.mark.slow
def test_llama_cpps_mmproj_gives_our_answers(llama_cpp_model, model_of, limits):
    # It writes no pixel limits: llama.cpp's Qwen-VL defaults apply (8 to 4096 tokens).
    assert llama_cpp_model.image_limits == I.ImageLimits(32, 8 * 1024, 4096 * 1024) != limits
    square = file_of(picture(400, 380, 40), "PNG")  # 12 x 12 tokens (12.5 rounds to even)
    for data in (IMAGES["jpeg"], IMAGES["webp_wide"], square):  # sizes both limits leave as rounded
        width, height = pil(data).size
        rounded = (round(height / 32) * 32, round(width / 32) * 32)
        assert I.smart_resize(height, width, limits) == I.smart_resize(height, width, llama_cpp_model.image_limits) == rounded
    for images, questions in (
        ([IMAGES["jpeg"]], QUESTIONS),
        ([IMAGES["webp_wide"]], OTHER_QUESTIONS),
        ([square, IMAGES["jpeg"], IMAGES["webp_wide"]], QUESTIONS),
    ):
        request = _request([data_url(d) for d in images], questions)
        assert llama_cpp_model.decide(request) == model_of("f32").decide(request)
    # Under the fixture's minimum, llama.cpp's limits give the image its own size: other tokens, as the file says.
    small = _request([data_url(IMAGES["png_up"])])
    theirs, ours = llama_cpp_model.encode(small).images[0].image, model_of("f32").encode(small).images[0].image
    assert (theirs.nx, theirs.ny) == (5, 3) and ours.n_tokens >= 16


# --- Sizes the reference gives that mtmd would change ---------------------------------------------------
@pytest.mark.parametrize(("min_tokens", "max_tokens"), [(4, 64), (16, 1024), (256, 256)])
def test_every_image_size_is_answered_or_refused_naming_the_image(ws, tmp_path, min_tokens, max_tokens):
    """A seeded fuzz of sides (1 to 20,000 px, aspect ratios up to 300) against a tower's pixel limits: the
    reference's size where mtmd encodes it as such, else a RequestError naming the image: never a ComputeError
    (mtmd resizes an image outside the limits to another grid; smart_resize can end there at extreme ratios,
    and nearly always with equal limits)."""
    from clef_gguf.testing.gguf_bytes import kv_u32, rebuild

    gguf = ws.gguf(RELEASE, "f32")
    per_token = 32 * 32  # the fixture's patch 16, merge 2
    replace = {
        key: kv_u32(key, n * per_token) for key, n in ((V.KEY_IMAGE_MIN_PIXELS, min_tokens), (V.KEY_IMAGE_MAX_PIXELS, max_tokens))
    }
    mmproj = rebuild(default_mmproj_path(gguf), tmp_path / "limits.mmproj.gguf", replace=replace)
    rng = np.random.default_rng(min_tokens + max_tokens)
    sides = [(1, 20_000), (20_000, 2), (32, 6400), (6400, 32), (64, 4300), (300, 1)]
    while len(sides) < 14:
        h, ratio = int(np.exp(rng.uniform(0, math.log(20_000)))), float(np.exp(rng.uniform(0, math.log(300))))
        w = max(1, min(20_000, int(h * ratio) if rng.random() < 0.5 else int(h / ratio)))
        if h * w <= 4_000_000:  # the image is made and encoded for real: keep the fuzz fast
            sides.append((h, w))
    answered = refused = 0
    with clef_gguf.load(gguf, max_prompt_tokens=N_CTX, state_cache=0, mmproj=mmproj) as model:
        for h, w in sides:
            try:
                model.decide(_request([data_url(file_of(Image.new("RGB", (w, h), (200, 30, 90)), "PNG"))]))
                answered += 1
            except RequestError as e:
                assert e.field == "images.0" and "pixels" in e.reason, e
                refused += 1
    assert refused and (answered or min_tokens == max_tokens), (answered, refused)


@pytest.mark.parametrize("tensor", ["mm.2.weight", "v.patch_embd.weight"])
def test_a_tower_that_cannot_answer_is_refused_at_load(ws, tmp_path, tensor):
    """Weights that parse but hold a NaN or an Inf: the header validate passes them (--deep does not), and the
    load's probe decides with one small image, so the server never starts answering every image with a 500."""
    from clef_gguf.format.header import GGUFFile
    from clef_gguf.testing.gguf_bytes import rebuild

    gguf = ws.gguf(RELEASE, "f32")
    f = GGUFFile.open(default_mmproj_path(gguf))
    t = f.header.tensors[tensor]
    values = f.tensor_bytes(tensor).view(np.float32).copy()
    f.close()
    values[0] = np.nan if tensor.startswith("mm") else np.inf
    broken = rebuild(
        default_mmproj_path(gguf),
        tmp_path / "broken.mmproj.gguf",
        keep=lambda n: n != tensor,
        extra=[(tensor, t.dims, int(t.type), values.tobytes())],
    )
    with pytest.raises(ModelOutputError, match="not finite"):
        clef_gguf.load(gguf, max_prompt_tokens=N_CTX, mmproj=broken)
