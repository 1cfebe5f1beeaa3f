"""The error table (clef_gguf/errors.py: one row per kind of error a client meets) is the one place an HTTP status is
written, and its rows render as the server always answered, with the headers the server adds (server/problems.py).

The guard (test_no_status_outside_the_table) reads every .py under clef_gguf/ with `ast`, importing nothing. An int
constant from 100 to 599 is an HTTP status, refused outside the table module, where it is:
  1. an argument of a call to ApiError, Failure, Problem, HTTPException or a *Response: ApiError(413, ...);
  2. the value of a keyword argument, or the default of a parameter, whose name holds "status": status_code=413;
  3. an operand beside a status-like expression of a comparison, an `or`/`and`, or a conditional expression, alone
     or in a tuple, list or set literal: status == 503, status in (401, 403), status or 500,
     422 if invalid else problem.status;
  4. assigned to a status-like target: status = 500;
  5. a key of a dict whose keys are all such ints (a status map: {401: "authentication_error"}), or the value of a
     key holding "status" ({"status": 422});
  6. the index of a status-like container: STATUS_LINE[413].
A status-like expression is a name, an attribute or a string subscript holding "status" (status, e.status_code,
message["status"]), or a tuple holding one. Other numbers (a 256-byte buffer, a timeout, a llama.cpp return code
compared with 0) are no statuses. Rule 3 does not apply to the modules that read statuses another server answered,
as a client (CLIENTS: Hugging Face's in check/remote.py; this server's in clef_gguf/testing/, as tests read them).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from clef_gguf import errors
from clef_gguf.check.validate import open_validated
from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.errors import (
    HEAD_TOO_LARGE,
    NO_SUCH_MODEL,
    ROWS,
    UNAUTHORIZED,
    URL_TOO_LONG,
    AdapterUnavailableError,
    ClefError,
    ComputeError,
    IncompleteModelError,
    ModelOutputError,
    Problem,
    PromptTooLongError,
    RequestError,
    RequestTooLargeError,
)
from clef_gguf.runtime.catalog import Catalog
from clef_gguf.runtime.failures import Failure, Invalid, error_object, from_request_error, internal, problem_of
from clef_gguf.runtime.prompt import Request
from clef_gguf.server.observe import REQUEST_ID_HEADER, X_REQUEST_ID
from clef_gguf.server.problems import (
    ROW_HEADERS,
    ApiError,
    headers_of,
    overloaded,
    render_problem,
    starlette_problem,
)
from clef_gguf.settings import AdapterSet

PACKAGE = Path(__file__).resolve().parent.parent / "clef_gguf"
TABLE = "errors.py"
CLIENTS = ("check/remote.py", "testing/")
CALLEES = {"ApiError", "Failure", "Problem", "HTTPException"}
WORKERS_AI_PATH = "/client/v4/accounts/abc/ai/run/@cf/cloudflare/clef"


def _is_status(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and 100 <= node.value <= 599


def _statuses(node: ast.AST | None) -> list[ast.AST]:
    """The node if it is a status, or the statuses a tuple, list or set literal holds."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e for e in node.elts if _is_status(e)]
    return [node] if node is not None and _is_status(node) else []


def _status_like(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return "status" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "status" in node.attr.lower()
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and "status" in key.value.lower()
    if isinstance(node, ast.Tuple | ast.List):
        return any(_status_like(e) for e in node.elts)
    return False


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _beside_status(operands: list[ast.AST]) -> list[ast.AST]:
    return [s for o in operands for s in _statuses(o)] if any(_status_like(o) for o in operands) else []


def _dict_statuses(node: ast.Dict) -> list[ast.AST]:
    keys = [k for k in node.keys if k is not None]
    found = list(keys) if keys and all(_is_status(k) for k in keys) else []
    for key, value in zip(node.keys, node.values, strict=True):
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and "status" in key.value.lower():
            found += _statuses(value)
    return found


def _found_in(node: ast.AST, client: bool) -> list[tuple[ast.AST, str]]:
    """The statuses `node` itself writes (rules 1 to 6), each with its rule."""
    found: list[tuple[ast.AST, str]] = []
    if isinstance(node, ast.Call):
        if _callee(node) in CALLEES or _callee(node).endswith("Response"):
            arguments = [*node.args, *(k.value for k in node.keywords)]
            found += [(s, f"an argument of {_callee(node)}") for a in arguments for s in _statuses(a)]
        found += [(s, f"{k.arg}=") for k in node.keywords if k.arg and "status" in k.arg.lower() for s in _statuses(k.value)]
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        a = node.args
        pairs = [
            *zip(a.args[len(a.args) - len(a.defaults) :], a.defaults, strict=True),
            *zip(a.kwonlyargs, a.kw_defaults, strict=True),
        ]
        found += [(s, f"the default of {arg.arg}") for arg, d in pairs if "status" in arg.arg.lower() for s in _statuses(d)]
    elif isinstance(node, ast.Compare) and not client:
        found += [(s, "compared with a status") for s in _beside_status([node.left, *node.comparators])]
    elif isinstance(node, ast.BoolOp):
        found += [(s, "or/and with a status") for s in _beside_status(node.values)]
    elif isinstance(node, ast.IfExp):
        found += [(s, "a conditional with a status") for s in _beside_status([node.body, node.orelse])]
    elif isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        found += [(s, "assigned to a status") for s in (_statuses(node.value) if any(map(_status_like, targets)) else [])]
    elif isinstance(node, ast.Dict):
        found += [(s, "in a status map") for s in _dict_statuses(node)]
    elif isinstance(node, ast.Subscript) and _status_like(node.value):
        found += [(s, "an index of a status map") for s in _statuses(node.slice)]
    return found


def status_literals(root: Path) -> list[str]:
    """'path:line: value (rule)' for each HTTP status written under `root` outside the table module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative == TABLE:
            continue
        client = relative.startswith(CLIENTS)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found += [(relative, s.lineno, s.value, why) for s, why in _found_in(node, client)]  # type: ignore[attr-defined]
    return [f"{path}:{line}: {value} ({why})" for path, line, value, why in sorted(set(found))]


def test_no_status_outside_the_table() -> None:
    found = status_literals(PACKAGE)
    assert not found, "HTTP statuses outside errors.py (name a row of the table instead):\n" + "\n".join(found)


# Lines of the code before the table (server/body.py, app.py, problems.py, metrics.py, observe.py, protocol.py,
# runtime/problems.py), each a status the guard must find, and numbers it must leave alone.
OLD_CODE = """
_STATUS_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}
LARGE_BODY = 64 * 1024
_HEAD_START_BYTES = 256


def too_large(limit):
    return ApiError(413, "request_too_large", f"the request body is larger than {limit} bytes")


def answered(status, chunk, count, message):
    if status == 503:
        refused()
    status = status or 500
    code = 422 if isinstance(problem, Invalid) else problem.status
    status, headers = (422, {}) if isinstance(problem, Invalid) else (problem.status, dict(problem.headers))
    head = [STATUS_LINE[431]]
    if message["status"] in (401, 403):
        status = 408
    response = Response(b"", status_code=415)
    if count == 404 or len(chunk) > 256 or status != 0:
        return {"status": 422, "count": 500}


def error_object(problem, status: int = 500):
    return status
"""
OLD_FOUND = [
    "old.py:2: 401 (in a status map)",
    "old.py:2: 404 (in a status map)",
    "old.py:2: 413 (in a status map)",
    "old.py:2: 503 (in a status map)",
    "old.py:8: 413 (an argument of ApiError)",
    "old.py:12: 503 (compared with a status)",
    "old.py:14: 500 (or/and with a status)",
    "old.py:15: 422 (a conditional with a status)",
    "old.py:16: 422 (a conditional with a status)",
    "old.py:17: 431 (an index of a status map)",
    "old.py:18: 401 (compared with a status)",
    "old.py:18: 403 (compared with a status)",
    "old.py:19: 408 (assigned to a status)",
    "old.py:20: 415 (an argument of Response)",
    "old.py:20: 415 (status_code=)",
    "old.py:22: 422 (in a status map)",
    "old.py:25: 500 (the default of status)",
]


def test_the_guard_finds_the_old_inline_statuses(tmp_path: Path) -> None:
    (tmp_path / "old.py").write_text(OLD_CODE)
    (tmp_path / "errors.py").write_text(OLD_CODE)  # the table's own statuses are its to write
    (tmp_path / "check").mkdir()
    (tmp_path / "check" / "remote.py").write_text("def read(status):\n    return status in (206, 416)\n")  # a client's
    assert status_literals(tmp_path) == OLD_FOUND


def test_the_guard_finds_an_inline_status_in_a_copy_of_the_package(tmp_path: Path) -> None:
    """One raise written the old way into a copy of today's clef_gguf/ is the one finding."""
    copy = tmp_path / "clef_gguf"
    for path in PACKAGE.rglob("*.py"):
        (copy / path.relative_to(PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
        (copy / path.relative_to(PACKAGE)).write_text(path.read_text())
    workers_ai = copy / "server" / "workers_ai.py"
    source = workers_ai.read_text()
    assert "ApiError(NO_SUCH_MODEL, " in source
    workers_ai.write_text(source.replace("ApiError(NO_SUCH_MODEL, ", 'ApiError(400, "no_such_model", '))
    assert [f.split(":")[0] + f.split(":", 2)[2] for f in status_literals(copy)] == [
        "server/workers_ai.py 400 (an argument of ApiError)"
    ]


def test_every_row_is_named_once_and_is_an_error() -> None:
    names = [row.name for row in ROWS]
    assert len(set(names)) == len(names)
    in_module = {name: value for name, value in vars(errors).items() if isinstance(value, Problem)}
    assert in_module == {row.name: row for row in ROWS}, "each row is bound to its own name, and listed in ROWS"
    for row in ROWS:
        assert 400 <= row.status <= 599 and row.error_type
        assert row.workers_ai_code == row.status or 1000 <= row.workers_ai_code <= 9999


def _rendered(path: str, problem: Failure | Invalid) -> tuple[int, dict[str, str], object]:
    status, headers, body = render_problem(path, problem)
    assert headers.pop(REQUEST_ID_HEADER) == headers.pop(X_REQUEST_ID)
    return status, headers, json.loads(body)


def _envelope(code: int, message: str) -> dict[str, object]:
    return {"result": None, "success": False, "errors": [{"code": code, "message": message}], "messages": []}


# What the server answered before the table, byte for byte less the request id: TypeSafe's shape, Workers AI's.
@pytest.mark.parametrize(
    ("problem", "status", "headers", "error_type", "code"),
    [
        (overloaded("full", close=True), 503, {"Retry-After": "1", "Connection": "close"}, "overloaded_error", 503),
        (ApiError(NO_SUCH_MODEL, "full"), 400, {}, "no_such_model", 5007),
        (ApiError(UNAUTHORIZED, "full"), 401, {"WWW-Authenticate": "Bearer"}, "authentication_error", 401),
        (ApiError(URL_TOO_LONG, "full"), 414, {}, "request_too_large", 3006),
        (ApiError(HEAD_TOO_LARGE, "full"), 431, {}, "request_too_large", 3006),
        (from_request_error(PromptTooLongError(9, 8), None), 413, {}, "prompt_too_long", 3006),
    ],
)
def test_rows_render_as_before(problem: Failure, status: int, headers: dict[str, str], error_type: str, code: int) -> None:
    message = problem.message
    assert _rendered("/v1/systemone", problem) == (status, headers, {"detail": {"error_type": error_type, "message": message}})
    assert _rendered(WORKERS_AI_PATH, problem) == (status, headers, _envelope(code, message))


def test_invalid_and_internal_render_as_before() -> None:
    invalid = Invalid(["body", "questions"], "is required", "missing")
    detail = [{"loc": ["body", "questions"], "msg": "is required", "type": "missing"}]
    assert _rendered("/v1/systemone", invalid) == (422, {}, {"detail": detail})
    assert _rendered(WORKERS_AI_PATH, invalid) == (422, {}, _envelope(422, "body.questions: is required"))
    assert error_object(invalid) == {"status": 422, "detail": detail}
    message = "internal error: ValueError: x"
    assert error_object(internal(ValueError("x"))) == {"status": 500, "detail": {"error_type": "api_error", "message": message}}


def test_starlette_statuses_keep_their_own_headers() -> None:
    """Starlette's 404 and 405 (and any status it raised) map as app.py's _STATUS_TYPES did, with its headers only."""
    rows = map(starlette_problem, (401, 404, 405, 413, 418, 503))
    assert [(p.status, p.error_type, headers_of(ApiError(p, ""))) for p in rows] == [
        (401, "authentication_error", {}),
        (404, "not_found_error", {}),
        (405, "invalid_request_error", {}),
        (413, "request_too_large", {}),
        (418, "invalid_request_error", {}),
        (503, "overloaded_error", {}),
    ]
    allowed = ApiError(starlette_problem(405), "Method Not Allowed", {"Allow": "POST"})
    assert _rendered("/v1/systemone", allowed)[:2] == (405, {"Allow": "POST"})


def _classes(base: type) -> list[type]:
    return [base, *(c for sub in base.__subclasses__() for c in _classes(sub))]


def test_every_error_class_names_a_row_and_headers_are_the_servers() -> None:
    """Each error class declares its row (errors.py); the server's headers are declared for rows of the table."""
    assert {c.__name__: c.problem in ROWS for c in _classes(ClefError)} == {c.__name__: True for c in _classes(ClefError)}
    assert set(ROW_HEADERS) <= set(ROWS)


@pytest.mark.parametrize(
    "error",
    [
        PromptTooLongError(9, 8),
        RequestTooLargeError("the line is 9 bytes, over the limit of 8"),
        RequestError("is required", "questions.q.type"),
        AdapterUnavailableError("/srv/tunes/a.adapter.gguf changed while the request waited"),
        IncompleteModelError("/srv/tunes/a.adapter.gguf: not an adapter"),
        ModelOutputError("the scores are NaN"),
        ComputeError("llama_decode failed"),
        ValueError("a bug"),
    ],
)
def test_a_dataset_line_holds_what_the_server_answers(error: Exception) -> None:
    """`clef-gguf decide`'s error object (runtime/failures.error_object) is the status and body the server renders,
    from the one table, with no HTTP in the runtime."""
    problem = problem_of(error, {"questions": {"q": {}}})
    status, _, body = render_problem("/v1/systemone", problem)
    assert error_object(problem) == {"status": status, **json.loads(body)}
    assert "/srv/" not in body.decode()


@pytest.mark.parametrize("sent", [{"model": "x"}, {"model": "clef-flash", "lora": "x"}])
def test_a_model_that_cannot_be_used_is_a_422_at_the_field_that_named_it(sent: dict[str, str]) -> None:
    """Refused at intake (the body as sent) or once decided (the parsed request's Request.named_by): one answer."""
    error = IncompleteModelError("/srv/tunes/x.adapter.gguf: not an adapter")
    parsed = Request(sent["model"], "s", (), lora=sent.get("lora"))
    field = "lora" if "lora" in sent else "model"
    expected = {"detail": [{"loc": ["body", field], "msg": "x.adapter.gguf: not an adapter", "type": "value_error"}]}
    assert problem_of(error, sent).body() == problem_of(error, None, parsed.named_by).body() == expected


@pytest.fixture(scope="module")
def demo_file():
    validated = open_validated(DEMO_MODEL)
    yield validated
    validated.close()


def _catalog(validated, adapter_set: AdapterSet) -> Catalog:
    return Catalog(validated.file, validated.description, validated.file.identity(), adapter_set)


@pytest.mark.parametrize("field", ["lora", "model"])
@pytest.mark.parametrize("name", ["nope", "", "../x", "/srv/tunes/a.adapter.gguf"])
def test_an_unknown_name_is_a_422_at_the_field_that_named_it(demo_file, tmp_path, field: str, name: str) -> None:
    """A name no adapter served answers to (unknown, empty, path-like): a 422 at the field the request sent it in."""
    catalog = _catalog(demo_file, AdapterSet(adapter_dir=tmp_path))
    try:
        with pytest.raises(RequestError) as caught:
            catalog.resolve(name, field)
    finally:
        catalog.close()
    assert caught.value.field == field and caught.value.reason.startswith("no model ")
    body = {"model": "clef-flash", "lora": name} if field == "lora" else {"model": name}
    assert problem_of(caught.value, body).body()["detail"][0]["loc"] == ["body", field]


def test_a_lora_is_never_answered_by_another_model(demo_file) -> None:
    """Without adapters a `model` of any name is the base's (a client's own name), but a `lora` names a fine-tune: one
    the model does not have is a 422 at `lora`, as a server serving adapters refuses it; the base's names are the base."""
    catalog = _catalog(demo_file, AdapterSet())
    try:
        assert catalog.resolve("my-own-name", "model").entry is catalog.base
        for name in ("clef-flash", "jev-latest", demo_file.description.name):
            assert catalog.resolve(name, "lora").entry is catalog.base
        for name in ("triage", "", "../x"):
            with pytest.raises(RequestError, match="is loaded without adapters") as caught:
                catalog.resolve(name, "lora")
            assert caught.value.field == "lora"
    finally:
        catalog.close()


class _Replica:
    """A Scheduler (server/decision.py) whose decisions fail as a Ray replica's do: its typed error raised as itself
    (the ingress's ReplicaScheduler hands it on so: test_adapter_refusals' a_workers_typed_error_crosses_ray_as_itself)."""

    def __init__(self, error: Exception) -> None:
        self.error, self.pending = error, 0

    async def decide(self, request: object) -> object:
        raise self.error

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "error",
    [
        errors.SourceUnavailableError("the adapter 'acme/big' cannot be fetched now: 4 adapters are being fetched"),
        errors.AdapterUnavailableError("the adapter file of 'a' changed while the request waited"),
        errors.TemporarilyUnavailableError("no room for the adapter's copy"),
        errors.AdapterTooLargeError("acme/big is 9 bytes, over this server's --adapter-max-size of 8 bytes", "model"),
        errors.ComputeError("llama_decode failed"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_replicas_typed_error_is_answered_by_its_row(error):
    """Whatever typed error a decision raises where it is decided (a Ray replica: its relay from the ingress, its
    adapter's file), the client gets its row's status and type, a 503 with Retry-After: never the catch-all's 500 for
    a row that is not INTERNAL."""
    from fastapi.testclient import TestClient

    from clef_gguf.runtime.model import open_encoder
    from clef_gguf.server import create_app
    from clef_gguf.settings import ModelSpec

    encoder = open_encoder(ModelSpec.of(DEMO_MODEL))
    try:
        app = create_app(encoder, scheduler=_Replica(error), owns_model=False)
        with TestClient(app, base_url="http://127.0.0.1") as client:
            response = client.post("/v1/systemone", json=json.loads(DEMO_REQUEST.read_text()))
    finally:
        encoder.close()
    row = error.problem
    assert response.status_code == row.status, response.text
    assert (response.headers.get("Retry-After") is not None) == (row.status == 503), response.headers
