"""The vendored libmtmd (llama_cpp.mtmd_cpp) loads clef-gguf's mmproj and encodes images as the release's tower does.

Groundwork for images in the runtime: the tower runs in llama.cpp, its embeddings are checked against
transformers' Qwen3.5 vision model on the same pixels (an image whose size needs no resizing, so that
only the tower is compared, not two resize implementations).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import f16_tiles, offloaded
from transformers import Qwen3_5ForConditionalGeneration

from clef_gguf.check.mmproj import describe_mmproj
from clef_gguf.check.validate import open_validated
from clef_gguf.conversion.mmproj import MMPROJ_TYPES
from clef_gguf.errors import ModelFileError
from clef_gguf.format import vision as V
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama.backbone import Backbone, prompt_positions
from clef_gguf.llama.mtmd import VisionEncoder
from clef_gguf.settings import offload_default

pytestmark = pytest.mark.device  # in the device set (tests/conftest.py)

# Max |difference| of an embedding from transformers' (embeddings have a std of ~0.66); measured: f32 0.0014,
# f16 0.0027, bf16 0.012, q8_0 0.038.
TOLERANCE = {"f32": 0.005, "f16": 0.005, "bf16": 0.05, "q8_0": 0.1}
# On a device whose products round their operands to F16 (conftest.f16_tiles), clip.cpp's graph rounds too: it is
# llama.cpp's, run as llama-server runs it, and sets no precision (F16 weights then accumulate in F16 as well).
# Measured on lavapipe (2026-12-02): f32 0.0150, f16 0.0140, bf16 0.0185, q8_0 0.0344; the same with flash attention
# off (0.0143 at f32); with F32 tiles (GGML_VK_DISABLE_F16=1) 0.0007, 0.0016, 0.0093, 0.0246, within TOLERANCE.
# The answers with images on such a device stay within test_images' tolerances.
F16_TILES_TOLERANCE = {"f32": 0.03, "f16": 0.03, "bf16": 0.05, "q8_0": 0.1}


@pytest.fixture(scope="module")
def backbone(ws):
    f = open_validated(ws.gguf("untied_f32", "f32"))
    b = Backbone(f.file, max_prompt_tokens=512, n_threads=2, n_gpu_layers=offload_default())
    yield b
    b.close()
    f.close()


def token_limits(mmproj) -> tuple[int, int]:
    """The release's image token range, from the pixel limits clef-gguf writes into the mmproj."""
    f = GGUFFile.open(mmproj)
    d = describe_mmproj(f.header)
    f.close()
    assert d is not None and d.min_pixels is not None and d.max_pixels is not None
    per_token = V.pixels_per_token(d.shape.patch_size)
    return d.min_pixels // per_token, d.max_pixels // per_token


def encoder(mmproj, backbone: Backbone) -> VisionEncoder:
    low, high = token_limits(mmproj)
    return VisionEncoder(mmproj, backbone.model, n_threads=2, use_gpu=offloaded(), min_tokens=low, max_tokens=high)


@pytest.mark.parametrize("file_type", list(MMPROJ_TYPES))
def test_libmtmd_loads_our_mmproj_and_frees_it(ws, backbone, file_type):
    for _ in range(2):  # a second context after the first is freed: nothing of the first is left in use
        with encoder(ws.mmproj("untied_f32", file_type), backbone) as enc:
            assert enc.ctx and enc.width == 64
        assert enc.ctx is None
    enc.close()  # closing twice is harmless


def test_images_are_encoded_into_the_release_token_range(ws, backbone):
    rng = np.random.default_rng(1)
    low, high = token_limits(ws.mmproj("untied_f32", "f32"))
    with encoder(ws.mmproj("untied_f32", "f32"), backbone) as enc:
        aligned = enc.encode(rng.integers(0, 256, (128, 160, 3), dtype=np.uint8))
        assert (aligned.nx, aligned.ny, aligned.embeddings.shape) == (5, 4, (20, 64))  # 32-pixel tokens
        for shape in ((8, 8, 3), (40, 300, 3), (900, 700, 3)):  # below the smallest, odd, above the largest
            e = enc.encode(rng.integers(0, 256, shape, dtype=np.uint8))
            assert low <= e.n_tokens <= high and e.embeddings.shape == (e.n_tokens, 64), (shape, e.nx, e.ny)
            assert np.isfinite(e.embeddings).all()
        other = enc.encode(rng.integers(0, 256, (128, 160, 3), dtype=np.uint8))
        # Random weights, but not degenerate: another image gives other embeddings, of a spread like text's.
        assert np.abs(other.embeddings - aligned.embeddings).mean() > 0.1
        assert 0.3 < aligned.embeddings.std() < 3.0
        with pytest.raises(ValueError, match="uint8 RGB"):
            enc.encode(np.zeros((4, 4), dtype=np.uint8))


def test_an_image_at_a_size_the_reference_would_give_is_encoded_at_that_size(ws, backbone):
    """mtmd copies an image whose sides are whole tokens and whose area is within the limits, unresized
    (img_tool::resize): the runtime can resize as the reference's processor does and hand mtmd the result.
    (mtmd's own resize differs from transformers' smart_resize: banker's rounding, tiny sides; docs/mmproj.md.)"""
    low, high = token_limits(ws.mmproj("untied_f32", "f32"))
    with encoder(ws.mmproj("untied_f32", "f32"), backbone) as enc:
        for ny, nx in ((4, 4), (2, 8), (1, 16), (16, 16), (3, 7), (20, 12)):
            assert low <= nx * ny <= high
            e = enc.encode(np.zeros((ny * 32, nx * 32, 3), dtype=np.uint8))
            assert (e.nx, e.ny) == (nx, ny)


def _patchify(image: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, int, int]:
    """(C, H, W) -> transformers' flattened patches (Qwen2VLImageProcessorPil.patchify, transformers 5.24)."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    x = image.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, *x.shape[5:]))
    return np.ascontiguousarray(x.reshape(gh * gw, c * temporal * patch * patch)), gh, gw


@pytest.fixture(scope="module")
def reference_embeddings(ws):
    """transformers' vision tower on one 160 x 128 image, normalized as the release's processor does."""
    release = ws.release("untied_f32")
    config = json.loads((release / V.PREPROCESSOR_CONFIG).read_text())
    image = np.random.default_rng(2).integers(0, 256, (128, 160, 3), dtype=np.uint8)
    x = (image.astype(np.float32) / 255 - np.float32(config["image_mean"])) / np.float32(config["image_std"])
    pixels, gh, gw = _patchify(x.transpose(2, 0, 1), config["patch_size"], config["merge_size"], config["temporal_patch_size"])
    model = Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels), torch.tensor([[1, gh, gw]]))
    return image, out.pooler_output[0].numpy()


@pytest.mark.parametrize("file_type", list(MMPROJ_TYPES))
def test_the_tower_in_llama_cpp_is_the_release_tower(ws, backbone, reference_embeddings, file_type):
    image, expected = reference_embeddings
    with encoder(ws.mmproj("untied_f32", file_type), backbone) as enc:
        got = enc.encode(image)
    assert got.embeddings.shape == expected.shape == (20, 64)
    worst = float(np.abs(got.embeddings - expected).max())
    # the tower's device is the backbone's (mtmd's use_gpu), which the head reports
    tolerance = F16_TILES_TOLERANCE if f16_tiles(ws.model("untied_f32", "f32").head.device) else TOLERANCE
    assert worst <= tolerance[file_type], worst


def test_mtmd_refuses_an_mmproj_of_another_width(ws):
    f = open_validated(ws.gguf("k256", "f32"))  # hidden size 256; the mmproj's embeddings are 64 wide
    b = Backbone(f.file, max_prompt_tokens=64, n_threads=2, n_gpu_layers=offload_default())
    try:
        with pytest.raises(ModelFileError, match="mismatch between text model"):
            VisionEncoder(ws.mmproj("untied_f32", "f32"), b.model, n_threads=2, use_gpu=offloaded())
    finally:
        b.close()
        f.close()


def test_prompt_positions_are_mtmds_mrope_layout():
    # 7 text tokens, a 3 x 2 image, 2 text tokens: the image from t = 7, the text after it at 7 + max(3, 2).
    positions = prompt_positions(15, [(7, 3, 2)])
    image = positions[:, 7:13]
    assert image[0].tolist() == [7] * 6  # t: the image's first position
    assert image[1].tolist() == [7, 7, 7, 8, 8, 8]  # h: the row
    assert image[2].tolist() == [7, 8, 9, 7, 8, 9]  # w: the column
    assert positions[3].tolist() == [0] * 15
    for section in range(3):  # text: t = h = w, one a token
        assert positions[section, :7].tolist() == list(range(7))
        assert positions[section, 13:].tolist() == [10, 11]
    assert prompt_positions(3, start=5)[:3].tolist() == [[5, 6, 7]] * 3
