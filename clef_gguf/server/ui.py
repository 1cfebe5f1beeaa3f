"""The page at `/` (issue 56): static files that ask a model, show each option's probability and the request as code.

The files are plain HTML, CSS and JavaScript in ui/ beside this module, shipped in the wheel, read once when the app is
built. They hold no data and need no key: the page calls the API from the browser, with the key the user gives it
(kept in the tab's sessionStorage). `serve --no-ui` leaves these routes out: `/` is then the API's 404."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from .problems import response_headers

UI_DIR = Path(__file__).with_name("ui")
# The page's routes: `/` and its files, each a fixed path (no path parameter: nothing else under /ui/ is served).
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
    "/ui/icon.svg": ("icon.svg", "image/svg+xml"),
}
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


def mount_ui(app: FastAPI, folder: Path = UI_DIR) -> None:
    """Add the page's routes to `app`, without a key (the files hold nothing a key guards), outside the API's schema."""
    for route, (name, media_type) in FILES.items():
        page = StaticFile((folder / name).read_bytes(), media_type)
        app.add_api_route(route, page.get, methods=["GET", "HEAD"], include_in_schema=False)
