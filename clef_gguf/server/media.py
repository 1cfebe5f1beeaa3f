"""Images in a request body, in the forms clients send them, turned into the runtime's `images`.

* Workers AI and the clef-* clients: a top-level `images` list (data URLs, {content_type, base64});
  the runtime reads it as it is (runtime/images.py), as it reads llama-server's image_url parts.
* typesafe-sdk: `assets`, {placeholder: {"type": "image", "part": "asset-N"}}, the images in the parts
  of a multipart/form-data body whose part `request` is the JSON (typesafe-sdk 0.7.5 sends nothing
  else for images, zstd-compressed past 1 KiB: the body is decoded before it is split), or
  {"type": "image", "format": "png", "data_base64": ...} in a JSON body. Each part must be claimed by
  exactly one asset, as TypeSafe's API requires.

The reference places a request's images before the state, whatever the text says; TypeSafe places
an asset where its placeholder is. clef-gguf follows the reference: the assets' images go before the
state, in the order of the `assets` object, after any `images`, and the placeholder text stays where
it is in the state (the model reads it as text, as it reads any reference to an image).
"""

from __future__ import annotations

import re
from typing import Any

from ..runtime import images as runtime_images
from ..runtime.failures import Failure, Invalid, Location

REQUEST_PART = "request"
ASSET_FORMATS = ("png", "jpg", "jpeg", "webp")  # TypeSafe's `format`; the bytes decide the actual format
_NAME = re.compile(rb'(?:^|;)\s*name="([^"]*)"', re.IGNORECASE)


def is_multipart(content_type: str | None) -> bool:
    return bool(content_type) and content_type.split(";")[0].strip().lower() == "multipart/form-data"


def _boundary(content_type: str) -> bytes:
    match = re.search(r'boundary="?([^";]+)"?', content_type, re.IGNORECASE)
    if not match:
        raise Invalid(["body"], "a multipart/form-data body needs a boundary in its Content-Type")
    return match.group(1).encode("latin-1")


def split_multipart(body: bytes, content_type: str) -> dict[str, bytes]:
    """The parts of a multipart/form-data body (RFC 7578) by name; 422 for a body that is not one."""
    delimiter = b"--" + _boundary(content_type)
    chunks = body.split(delimiter)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise Invalid(["body"], "the multipart body is not closed by its boundary, or has no parts")
    parts: dict[str, bytes] = {}
    for chunk in chunks[1:-1]:
        if not chunk.startswith(b"\r\n") or not chunk.endswith(b"\r\n"):
            raise Invalid(["body"], "a multipart part is not delimited by CRLF")
        head, sep, data = chunk[2:-2].partition(b"\r\n\r\n")
        if not sep:
            raise Invalid(["body"], "a multipart part has no blank line after its headers")
        disposition = next(
            (line.partition(b":")[2] for line in head.split(b"\r\n") if line.lower().startswith(b"content-disposition:")), b""
        )
        name = _NAME.search(disposition)
        if name is None:
            raise Invalid(["body"], "a multipart part has no Content-Disposition name")
        key = name.group(1).decode("utf-8", "replace")
        if key in parts:
            raise Invalid(["body", key], "two multipart parts have this name")
        parts[key] = data
    return parts


def request_of_multipart(parts: dict[str, bytes], parse: Any) -> Any:
    """The JSON request of a multipart body (its part `request`), parsed by `parse` (body.parse)."""
    if REQUEST_PART not in parts:
        raise Invalid(["body", REQUEST_PART], f"a multipart request needs a part named {REQUEST_PART!r} holding the JSON")
    return parse(parts.pop(REQUEST_PART))


def take_assets(value: Any, parts: dict[str, bytes]) -> tuple[Any, list[Location]]:
    """The request with TypeSafe's `assets` turned into `images`, and where each image came from (for 422s)."""
    if not isinstance(value, dict):
        if parts:
            raise Invalid(["body"], "the request must be a JSON object")
        return value, []
    given = value.get("images")
    if given is not None and not isinstance(given, list):  # (refused here too: assets below would replace it)
        raise Invalid(["body", "images"], "must be a list of images")
    origins: list[Location] = [["body", "images", i] for i in range(len(given))] if isinstance(given, list) else []
    if "assets" not in value:
        if parts:
            raise Invalid(["body", next(iter(parts))], "a multipart part that no asset claims (assets: {key: {part: ...}})")
        return value, origins
    assets = value["assets"]
    if not isinstance(assets, dict) or not assets:
        raise Invalid(["body", "assets"], "must be an object of one or more assets")
    images: list[Any] = list(given) if isinstance(given, list) else []
    claimed: set[str] = set()
    for key, asset in assets.items():
        loc: Location = ["body", "assets", key]
        if not isinstance(asset, dict):
            raise Invalid(loc, "an asset is an object: {type: image, part} or {type: image, format, data_base64}")
        if asset.get("type") != "image":
            raise Invalid([*loc, "type"], "only image assets are supported")
        part = asset.get("part")
        if part is not None:
            if not isinstance(part, str) or part not in parts:
                raise Invalid([*loc, "part"], f"no multipart part is named {part!r}")
            if part in claimed:
                raise Invalid([*loc, "part"], "another asset claims this part: each part belongs to exactly one asset")
            claimed.add(part)
            images.append(parts[part])
        elif isinstance(asset.get("data_base64"), str):
            if str(asset.get("format", "")).lower() not in ASSET_FORMATS:
                raise Invalid([*loc, "format"], f"data_base64 needs a format, one of {', '.join(ASSET_FORMATS)}")
            images.append(asset["data_base64"])
        else:
            raise Invalid(loc, "an image asset needs a multipart part or data_base64")
        origins.append(loc)
    unclaimed = [name for name in parts if name not in claimed]
    if unclaimed:
        raise Invalid(["body", unclaimed[0]], "a multipart part that no asset claims")
    rest = {k: v for k, v in value.items() if k != "assets"}
    return {**rest, "images": images}, origins


def chat_part_origins(value: Any) -> list[Location]:
    """Where the image parts of a chat-message state are, in the order the runtime appends them to `images`
    (runtime/images.py request_images: after the top-level images and the assets)."""
    messages, wrapped = runtime_images.chat_messages(value.get("state") if isinstance(value, dict) else None)
    base: Location = ["body", "state", "messages"] if wrapped else ["body", "state"]
    return [
        [*base, i, "content", j, "image_url"]
        for i, message in enumerate(messages)
        if runtime_images.has_image_parts(message)
        for j, part in enumerate(message["content"])
        if runtime_images.is_image_part(part)
    ]


def relocate(error: Failure | Invalid, origins: list[Location]) -> Failure | Invalid:
    """A 422 about images.N named where that image was in the body (an asset's key, say)."""
    if isinstance(error, Invalid):
        loc = error.loc
        if len(loc) >= 3 and loc[:2] == ["body", "images"] and isinstance(loc[2], int) and loc[2] < len(origins):
            return Invalid([*origins[loc[2]], *loc[3:]], error.msg, error.type)
        if loc == ["body", "images"] and origins and all(o[:2] == ["body", "assets"] for o in origins):
            return Invalid(["body", "assets"], error.msg, error.type)  # about the images as a whole: all are assets
    return error
