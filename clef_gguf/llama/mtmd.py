"""llama.cpp's multimodal library (libmtmd, bound in llama_cpp.mtmd_cpp): a vision tower loaded from an mmproj,
and images encoded into embeddings for the backbone.

mtmd normalizes an image with the mmproj's mean and std, runs the tower on the CPU (or the GPU) and
returns one embedding per image token, in rows of `nx` tokens (a merged 2 x 2 group of patches
each). The runtime resizes images itself, as the reference's processor does (runtime/images.py):
mtmd copies an image whose sides are whole tokens and whose area is within its token limits
unresized. The runtime places the embeddings in the prompt itself, with M-RoPE positions
(backbone.prompt_positions).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import llama_cpp as L
import llama_cpp.mtmd_cpp as M
import numpy as np

from ..errors import ModelFileError
from . import log as llama_log


@dataclass(frozen=True)
class ImageEmbeddings:
    """One image as the backbone sees it: `nx * ny` embeddings, row by row."""

    embeddings: np.ndarray  # (n_tokens, width) float32
    nx: int  # image tokens per row
    ny: int  # rows

    @property
    def n_tokens(self) -> int:
        return self.nx * self.ny


class VisionEncoder:
    """An mmproj loaded by libmtmd for a text model. Not thread-safe: one encode at a time.

    `text_model` is any llama.cpp view of the Clef file's backbone (mtmd reads its hidden size,
    to refuse an mmproj of another width, and its rope type); it must outlive the encoder.
    `min_tokens` / `max_tokens` bound the image tokens of one image (mtmd's own defaults for
    Qwen-VL when None: 8 to 4096).
    """

    def __init__(
        self,
        mmproj: str | os.PathLike[str],
        text_model: L.llama_model_p,
        *,
        n_threads: int | None = None,
        use_gpu: bool = False,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
        warmup: bool = True,
    ) -> None:
        llama_log.init_backend()
        llama_log.route_mtmd(M)
        self.width = L.llama_model_n_embd_inp(text_model)
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads or os.cpu_count() or 1
        params.warmup = warmup  # one encode at load: a tower the backend cannot run fails here, not at the first image
        params.image_min_tokens = min_tokens or -1
        params.image_max_tokens = max_tokens or -1
        self.path = Path(mmproj)
        llama_log.clear_errors()
        self.ctx = M.mtmd_init_from_file(os.fsencode(self.path), text_model, params)
        if not self.ctx:
            raise ModelFileError(f"llama.cpp's mtmd could not load {self.path.name}: {llama_log.last_error('no reason given')}")
        if not M.mtmd_support_vision(self.ctx):
            self.close()
            raise ModelFileError(f"{self.path.name} has no vision encoder")

    def encode(self, rgb: np.ndarray) -> ImageEmbeddings:
        """Encode an image of (height, width, 3) uint8 RGB pixels."""
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or min(rgb.shape[:2]) < 1:
            raise ValueError(f"an image is (height, width, 3) uint8 RGB, not {rgb.shape} {rgb.dtype}")
        pixels = np.ascontiguousarray(rgb)
        ny, nx = pixels.shape[:2]
        bitmap = M.mtmd_bitmap_init(nx, ny, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        chunks = M.mtmd_input_chunks_init()
        try:
            # The media marker alone: mtmd brackets the image with <|vision_start|> and <|vision_end|> text chunks.
            marker = M.mtmd_default_marker()
            text = M.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
            bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
            status = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if status != 0:
                raise ValueError(f"mtmd could not prepare the image (status {status}): {llama_log.last_error('see stderr')}")
            for i in range(M.mtmd_input_chunks_size(chunks)):
                chunk = M.mtmd_input_chunks_get(chunks, i)
                if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    return self._encode_chunk(chunk)
            raise AssertionError("mtmd returned no image chunk for one image")
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    def _encode_chunk(self, chunk: M.mtmd_input_chunk_p) -> ImageEmbeddings:
        tokens = M.mtmd_input_chunk_get_tokens_image(chunk)
        n_tokens = M.mtmd_image_tokens_get_n_tokens(tokens)
        nx, ny = M.mtmd_image_tokens_get_nx(tokens), M.mtmd_image_tokens_get_ny(tokens)
        status = M.mtmd_encode_chunk(self.ctx, chunk)
        if status != 0:
            raise RuntimeError(f"mtmd could not encode the image (status {status}): {llama_log.last_error('see stderr')}")
        out = M.mtmd_get_output_embd(self.ctx)
        embeddings = np.ctypeslib.as_array(ctypes.cast(out, ctypes.POINTER(ctypes.c_float)), shape=(n_tokens, self.width))
        assert n_tokens == nx * ny, (n_tokens, nx, ny)
        return ImageEmbeddings(embeddings.copy(), nx, ny)  # mtmd reuses its buffer at the next encode

    def close(self) -> None:
        if getattr(self, "ctx", None):
            M.mtmd_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> VisionEncoder:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
