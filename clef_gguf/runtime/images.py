"""A request's images, read and sized as the reference's processor does.

Cloudflare's reference hands `images` to the release's processor (Qwen3VLProcessor with
Qwen2VLImageProcessor): each image is converted to RGB (transparency composited onto white),
resized with PIL's bicubic filter to `smart_resize`'s size (whole tokens, pixels within the
release's limits, the aspect ratio kept), then normalized and cut into patches. clef-gguf does
the first two here and hands libmtmd an image it copies unresized (llama/mtmd.py), because
mtmd's own resize is not smart_resize (docs/mmproj.md: other token grids for some sizes, another
bicubic). mtmd then normalizes with the mmproj's mean and std and runs the tower.

An image reaches the runtime as Workers AI sends it, a data URL (`data:image/png;base64,...`) or
{"content_type": ..., "base64": ...}, or as bare base64 (clef-compactor's "inline base64"), raw
bytes, or (Python API) a PIL image. The format is read from the bytes (a multipart part's content
type is not read: typesafe-sdk labels WebP application/octet-stream); a media type a data URL or
an object declares must be one of the formats read. Remote URLs are
not fetched: a decision never waits on the network. Every refusal is a RequestError naming the
image (`images.N`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import RequestError
from ..format import vision as V
from ..format.hparams import VisionDescription

# Workers AI's documented limits for Clef (its `images` field): 4 images, each at most 4 MiB and 16 megapixels,
# 8 MiB of image files in all; PNG, JPEG or WebP. A larger image is refused before it is decoded.
MAX_IMAGES = 4
MAX_IMAGE_BYTES = 4 << 20  # one image's file (base64 decoded)
MAX_TOTAL_IMAGE_BYTES = 8 << 20
MAX_IMAGE_PIXELS = 16_000_000
MAX_ASPECT_RATIO = 200  # smart_resize's own bound
# The formats read, by PIL's name, with the media types a data URL may declare for them.
FORMATS = {"PNG": ("image/png",), "JPEG": ("image/jpeg", "image/jpg"), "WEBP": ("image/webp",)}
MEDIA_TYPES = {media: name for name, types in FORMATS.items() for media in types}
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)


@dataclass(frozen=True)
class ImageLimits:
    """The processor settings that decide an image's token grid (from the mmproj: llama/mtmd.py)."""

    factor: int  # pixels per token side: patch size x merge size
    min_pixels: int
    max_pixels: int


def image_limits(d: VisionDescription) -> ImageLimits:
    """The image limits of a validated mmproj: its pixel limits (`clef-gguf convert` writes the release's), or
    what llama.cpp applies to a file without them (llama.cpp's converter writes none)."""
    per_token = V.pixels_per_token(d.shape.patch_size)
    low, high = V.CLIP_DEFAULT_IMAGE_TOKENS
    return ImageLimits(
        d.shape.patch_size * V.MERGE_SIZE,
        d.min_pixels if d.min_pixels is not None else low * per_token,
        d.max_pixels if d.max_pixels is not None else high * per_token,
    )


@dataclass(frozen=True)
class PreparedImage:
    """An image at the size the tower sees it: (ny * factor, nx * factor, 3) uint8 RGB."""

    pixels: np.ndarray = field(compare=False)  # (the digest compares them)
    nx: int  # image tokens per row
    ny: int  # rows
    digest: bytes  # of the pixels and their shape: the state cache's key for this image

    @property
    def n_tokens(self) -> int:
        return self.nx * self.ny


def smart_resize(height: int, width: int, limits: ImageLimits) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize: sides of whole tokens, the area within the limits, the ratio kept.

    Python's round() rounds halves to even, as the reference's does (mtmd's std::round does not)."""
    factor = limits.factor
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > limits.max_pixels:
        beta = math.sqrt(height * width / limits.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < limits.min_pixels:
        beta = math.sqrt(limits.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_bytes(value: Any, where: str) -> bytes:
    """The encoded file of an image given as a data URL, bare base64 or bytes."""
    if isinstance(value, dict) and isinstance(value.get("base64"), str):  # Workers AI's object form
        media = value.get("content_type")
        if not isinstance(media, str) or media.lower() not in MEDIA_TYPES:
            raise RequestError(f"content_type {media!r} is not an image type clef-gguf reads ({_formats()})", where)
        value = value["base64"]
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
    elif isinstance(value, str):
        text = value.strip()
        if re.match(r"(?i)(https?|ftp|file)://", text):
            raise RequestError(
                "remote image URLs are not fetched; send the image itself as a data URL (data:image/png;base64,...)", where
            )
        match = _DATA_URL.match(text)
        if match:
            media, params = match.group(1).lower(), match.group(2).lower()
            if media and media not in MEDIA_TYPES:
                raise RequestError(f"media type {media!r} is not an image type clef-gguf reads ({_formats()})", where)
            if ";base64" not in params:
                raise RequestError("a data URL of an image must be base64 (data:image/png;base64,...)", where)
            text = text[match.end() :]
        text = re.sub(r"\s+", "", text)  # base64 in lines (MIME's 76 columns): the line breaks count for nothing
        if len(text) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
            raise RequestError(f"the image is over the limit of {MAX_IMAGE_BYTES >> 20} MiB", where)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("is neither a data URL nor base64 of an image", where) from None
    else:
        raise RequestError('an image is a data URL (data:image/png;base64,...) or {"content_type": ..., "base64": ...}', where)
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestError(f"the image is {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES >> 20} MiB", where)
    if not data:
        raise RequestError("the image is empty", where)
    return data


def _formats() -> str:
    return ", ".join(FORMATS)


def open_image(value: Any, where: str) -> Image.Image:
    """A decoded image in RGB, read fully (a truncated or corrupt file is refused here, not in the tower)."""
    if isinstance(value, Image.Image):
        image = value
    else:
        data = image_bytes(value, where)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data), formats=list(FORMATS))
                if image.width * image.height > MAX_IMAGE_PIXELS:
                    raise RequestError(
                        f"the image is {image.width} x {image.height} pixels, over the limit of {MAX_IMAGE_PIXELS:,}", where
                    )
                image.load()
        except RequestError:
            raise
        except UnidentifiedImageError:
            raise RequestError(f"is not an image in a format clef-gguf reads ({_formats()})", where) from None
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise RequestError(f"the image could not be decoded: {e}", where) from None
    if min(image.size) < 1:
        raise RequestError("the image has no pixels", where)
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited onto white, then RGB."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def prepare(value: Any, limits: ImageLimits, where: str) -> PreparedImage:
    """One request image, decoded and resized to the token grid the reference's processor gives it."""
    image = open_image(value, where)
    width, height = image.size
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise RequestError(f"the image is {width} x {height} pixels: its aspect ratio is over {MAX_ASPECT_RATIO}", where)
    h, w = smart_resize(height, width, limits)
    if not limits.min_pixels <= h * w <= limits.max_pixels:
        # smart_resize keeps a side at one token at least, so an extreme ratio can end above max_pixels (or,
        # rounding, below min_pixels). mtmd resizes such an image again, to another grid than the reference's.
        raise RequestError(
            f"the image is {width} x {height} pixels: the reference's processor sizes it to {w} x {h}, outside this "
            f"vision tower's {limits.min_pixels} to {limits.max_pixels} pixels, and llama.cpp would resize it again; "
            "send it cropped closer to square",
            where,
        )
    # As transformers' PIL backend: a resize even to the same size (PIL returns a copy then).
    pixels = np.asarray(image.resize((w, h), resample=Image.Resampling.BICUBIC), dtype=np.uint8)
    digest = hashlib.sha256(np.array(pixels.shape, dtype=np.int64).tobytes() + pixels.tobytes()).digest()
    return PreparedImage(pixels, w // limits.factor, h // limits.factor, digest)


def prepare_all(values: list[Any], limits: ImageLimits | None) -> tuple[PreparedImage, ...]:
    """A request's images (request_images' list), each prepared; `limits` None: the model has no vision tower."""
    if not values:
        return ()
    if limits is None:
        raise RequestError(
            "this model was loaded without its vision tower; load it with its mmproj "
            "(clef_gguf.load(..., mmproj=...), --mmproj; `clef-gguf convert` writes it beside the model)",
            "images",
        )
    if len(values) > MAX_IMAGES:
        raise RequestError(f"{len(values)} images, but Clef takes at most {MAX_IMAGES} per request", "images")
    files = [v if isinstance(v, Image.Image) else image_bytes(v, f"images.{i}") for i, v in enumerate(values)]
    total = sum(len(f) for f in files if isinstance(f, bytes))
    if total > MAX_TOTAL_IMAGE_BYTES:
        raise RequestError(f"the images are {total} bytes in all, over the limit of {MAX_TOTAL_IMAGE_BYTES >> 20} MiB", "images")
    return tuple(prepare(f, limits, f"images.{i}") for i, f in enumerate(files))


def request_images(body: dict[str, Any], state: Any) -> tuple[list[Any], Any]:
    """A request's images and its state without them: `images`, then the image parts of a chat-message state.

    The image parts are llama-server's form ({"type": "image_url", "image_url": {"url": ...}} in a message's
    content list, the state a list of messages or {"messages": [...]}): as llama-server does, they are taken
    out of the messages and placed with the other images, before the state, where the reference puts images."""
    if body.get("videos"):
        raise RequestError("videos are not supported (images are)", "videos")
    given = body.get("images")
    if given is not None and not isinstance(given, list):
        raise RequestError("must be a list of images", "images")
    images = list(given or [])
    messages, wrapped = chat_messages(state)
    if not any(has_image_parts(m) for m in messages):
        return images, state
    kept = []
    for message in messages:
        if not has_image_parts(message):
            kept.append(message)
            continue
        content = []
        for part in message["content"]:
            if is_image_part(part):
                url = part["image_url"]
                images.append(url.get("url") if isinstance(url, dict) else url)
            else:
                content.append(part)
        kept.append({**message, "content": content})
    return images, ({**state, "messages": kept} if wrapped else kept)


def chat_messages(state: Any) -> tuple[list[Any], bool]:
    """A chat-message state's messages (the state a list, or {"messages": [...]}: wrapped), or none."""
    wrapped = isinstance(state, dict) and isinstance(state.get("messages"), list)
    messages = state["messages"] if wrapped else state
    return (messages if isinstance(messages, list) else []), wrapped


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url" and "image_url" in part


def has_image_parts(message: Any) -> bool:
    return isinstance(message, dict) and isinstance(message.get("content"), list) and any(map(is_image_part, message["content"]))
