"""Which requests the server answers at all: those sent to one of its own names (Host), from no page or its own (Origin).

A server on loopback is reachable by every page its user's browser opens. Two things a browser does would let those
pages use it:

  * DNS rebinding: a page of attacker.example points its own name at 127.0.0.1, and then reads the answers (and
    /v1/models) as its own. Its requests say `Host: attacker.example`: only the names the server expects are answered
    (loopback names, IP addresses, the host it was bound to, and ServeSettings.allowed_hosts: a reverse proxy's).
  * Cross-origin "simple" requests: any page may POST text/plain, a form or multipart to 127.0.0.1 without asking the
    server first. A browser says where such a request comes from (`Origin`): one that is not the server's own is
    refused, unless ServeSettings.allowed_origins names it. The routes that read a body also want JSON (or
    typesafe-sdk's multipart: body.check_media_type), a type a browser sends across origins only after a preflight
    that this server never grants.

Clients that are not browsers (curl, httpx, the SDKs) send no Origin and the Host of the URL they were given: an IP
address or a name the operator names. Every refusal is a row of the error table, rendered as every answer is
(problems.render_problem), with the headers every answer carries (ANSWER_HEADERS).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import BAD_HTTP, FOREIGN_HOST, FOREIGN_ORIGIN
from ..runtime.failures import Failure
from .problems import ApiError, render_problem

# Every answer, JSON or not: a browser takes it as the type it says it is, and keeps no copy of it (answers and
# listings are the user's). The page's own files revalidate instead (ui.py sets its own Cache-Control).
ANSWER_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
_DEFAULT_PORTS = {"http": 80, "https": 443}


def raw_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """`headers` as ASGI's (lower-case names, latin-1 bytes), ANSWER_HEADERS added where absent."""
    given = {name.lower(): value for name, value in headers.items()}
    every = {**{name.lower(): value for name, value in ANSWER_HEADERS.items()}, **given}
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in every.items()]


async def send_problem(scope: Scope, send: Send, problem: Failure) -> None:
    """Answer from ASGI middleware, outside FastAPI's handlers: the error's JSON, as render_problem renders it."""
    status, headers, body = render_problem(scope["path"], problem)
    raw = raw_headers({**headers, "content-type": "application/json", "content-length": str(len(body))})
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def split_host(authority: str) -> tuple[str, int | None]:
    """A Host header's (or an origin's) name, lower case, without a final dot, and its port (None: none given).
    An IPv6 address keeps no brackets."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        name, _, rest = authority[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port = authority.rpartition(":") if authority.count(":") == 1 else (authority, "", "")
    return name.rstrip("."), int(port) if port.isdigit() else None


def is_authority(text: str) -> bool:
    """Whether a Host header is one name or address, and a port where one is given (1 to 65535; RFC 9110's empty port
    too): what is otherwise would be matched as some name it is not."""
    text = text.strip()
    if text.startswith("["):
        name, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            return False
        port = rest[1:]
    else:
        name, _, port = text.partition(":")
        if ":" in port:  # an IPv6 address only in brackets
            return False
    return bool(name) and (not port or (port.isascii() and port.isdigit() and 0 < int(port) <= 65535))


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Names:
    """The names the server answers as: loopback's (localhost and its subdomains), any IP address (a page can only
    read answers from an address it was itself served from), the bound host, and `allowed`: exact names, `.NAME`
    for NAME's subdomains, or `*` for any name."""

    def __init__(self, bound: str, allowed: Iterable[str] = ()) -> None:
        allowed = tuple(allowed)
        self.any = "*" in allowed
        names = {split_host(bound)[0], *(split_host(a)[0] for a in allowed if not a.startswith("."))}
        self.exact = names | {"localhost"}
        self.suffixes = (".localhost", *(a.lower().rstrip(".") for a in allowed if a.startswith(".")))

    def __contains__(self, name: str) -> bool:
        return self.any or name in self.exact or name.endswith(self.suffixes) or _is_address(name)


def _same_authority(origin: str, host: str) -> bool:
    """Whether an Origin (scheme://name[:port]) names the same name and port as the Host header (a TLS proxy in front
    changes the scheme, not the name and port a browser sees)."""
    parts = urlsplit(origin)
    if parts.scheme not in _DEFAULT_PORTS or not parts.netloc:
        return False
    name, port = split_host(parts.netloc)
    own_name, own_port = split_host(host)
    default = _DEFAULT_PORTS[parts.scheme]
    return name == own_name and (port or default) == (own_port or default)


class OwnOrigin:
    """ASGI middleware: refuse a request whose Host is not one of `names` (FOREIGN_HOST) or whose Origin is another
    site's (FOREIGN_ORIGIN) before the app reads it; add ANSWER_HEADERS to every answer."""

    def __init__(self, app: ASGIApp, names: Names, origins: Iterable[str] = ()) -> None:
        self.app = app
        self.names = names
        self.origins = {o.lower().rstrip("/") for o in origins}

    def refusal(self, scope: Scope) -> Failure | None:
        headers = scope.get("headers") or []
        hosts = [value.decode("latin-1") for name, value in headers if name == b"host"]
        origins = [value for name, value in headers if name == b"origin"]
        if len(hosts) > 1:  # (RFC 9112, 3.2: each could be read as the one that counts, by a proxy or by us)
            return ApiError(BAD_HTTP, f"the request has {len(hosts)} Host headers: HTTP/1.1 allows one")
        host = hosts[0] if hosts else ""
        if hosts and not is_authority(host):
            return ApiError(BAD_HTTP, f"Host {host[:200]!r} is not a name or address with a port from 1 to 65535")
        if host and (name := split_host(host)[0]) not in self.names:
            message = f"this server does not answer as {name[:200]!r} (Host): start it with --allowed-host NAME to allow it"
            return ApiError(FOREIGN_HOST, message)
        if not origins or "*" in self.origins:
            return None
        text = b", ".join(origins).decode("latin-1").strip().lower().rstrip("/")
        if len(origins) == 1 and (text in self.origins or (host and _same_authority(text, host))):
            return None
        message = f"pages of {text[:200]!r} may not call this server (Origin): start it with --allowed-origin ORIGIN to let them"
        return ApiError(FOREIGN_ORIGIN, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.refusal(scope)
        if refused is not None:
            await send_problem(scope, send, refused)
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k.lower().encode(), v.encode()) for k, v in ANSWER_HEADERS.items() if k.lower().encode() not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, marked)
