"""The page at `/`: static files that ask a model, show each option's probability and the request as code.

The files are plain HTML, CSS and JavaScript modules in ui/ beside this module, shipped in the wheel, read once when the
app is built; the request's limits come from the runtime's own constants (/ui/limits.json). They hold no data and need
no key: the page calls the API from the browser, with the key the user gives it (kept in the tab's sessionStorage).
`serve --no-ui` leaves these routes out: `/` is then the API's 404."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from ..runtime.catalog import JEV_ALIAS
from ..runtime.images import MAX_IMAGE_BYTES, MAX_IMAGES
from ..runtime.images import MEDIA_TYPES as IMAGE_MEDIA_TYPES
from ..runtime.prompt import CHOICE_OPTIONS, MAX_QUESTIONS, SCORE_LEVELS
from ..runtime.sources import HF_SCHEME
from .observe import response_headers

UI_DIR = Path(__file__).with_name("ui")
# The page's script: ES modules (main.js imports the others), served as they are, no build step.
MODULES = ("main", "dom", "page", "server", "examples", "questions", "request", "images", "answers", "code", "sources")
# The page's routes: `/` and its files, each a fixed path (no path parameter: nothing else under /ui/ is served).
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    **{f"/ui/{name}.js": (f"{name}.js", "text/javascript; charset=utf-8") for name in MODULES},
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
    "/ui/icon.svg": ("icon.svg", "image/svg+xml"),
}
LIMITS_ROUTE = "/ui/limits.json"
# Only this server's own files and API: no other host, no inline script or style (the page sets styles through the
# CSSOM, which the policy allows), no plugins, no framing by another site, forms posting only here.
CONTENT_SECURITY_POLICY = "default-src 'self'; base-uri 'self'; form-action 'self'; frame-ancestors 'self'; object-src 'none'"
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",  # a browser takes each file as the type it is served as
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated: a server upgraded in place serves its own page
}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str

    async def get(self) -> Response:
        return Response(self.body, media_type=self.media_type, headers=response_headers(SECURITY_HEADERS))


def limits(sources: list[str] | None = None) -> dict[str, Any]:
    """What the page holds a request to, as the runtime does (runtime/prompt.py, runtime/images.py), the SDKs' alias
    that /v1/models lists beside the base, and `sources`: what an adapter name it may type begins with (source_names):
    read by the page, never copied into it."""
    return {
        "questions": MAX_QUESTIONS,
        "choice": list(CHOICE_OPTIONS),
        "score": list(SCORE_LEVELS),
        "images": MAX_IMAGES,
        "image_bytes": MAX_IMAGE_BYTES,
        "image_types": sorted(IMAGE_MEDIA_TYPES),
        "alias": JEV_ALIAS,
        "sources": sources or [],
    }


def source_names(model: Any) -> list[str]:
    """The Hub organisations (ORG) and repositories (ORG/REPO) the model's adapter sources fetch from, as the page
    shows them: the operator's --adapter-source less its scheme; a folder source's path is the server's own, not said."""
    sources = getattr(getattr(model, "catalog", None), "sources", None)
    return [] if sources is None else [s.label.removeprefix(HF_SCHEME) for s in sources.remote]


def mount_ui(app: FastAPI, folder: Path = UI_DIR, sources: list[str] | None = None) -> None:
    """Add the page's routes to `app`, without a key (the files hold nothing a key guards), outside the API's schema;
    `sources`: what the page says adapter names may be fetched from (source_names)."""
    for route, (name, media_type) in FILES.items():
        page = StaticFile((folder / name).read_bytes(), media_type)
        app.add_api_route(route, page.get, methods=["GET", "HEAD"], include_in_schema=False)
    numbers = StaticFile(json.dumps(limits(sources)).encode(), "application/json")
    app.add_api_route(LIMITS_ROUTE, numbers.get, methods=["GET", "HEAD"], include_in_schema=False)
