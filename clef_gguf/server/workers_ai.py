"""Cloudflare Workers AI's REST shape for Clef, over the same model and the same answers.

clef-evals, clef-compactor and clef-router speak only this shape:
`POST {base}/accounts/{account_id}/ai/run/@cf/cloudflare/{clef|clef-flash}` (base usually ends in
`/client/v4`), with a System One request body, answered as
`{"result": <System One body>, "success": true, "errors": [], "messages": []}`. An error keeps its
HTTP status and headers (Retry-After included) and becomes `success: false` with
`errors: [{code, message}]`, which is what those clients read.
"""

from __future__ import annotations

import re
from typing import Any

from .problems import ApiError, Invalid

# Both names mean the loaded model: a client picks one, a server holds one file.
MODEL_IDS = ("@cf/cloudflare/clef", "@cf/cloudflare/clef-flash")
PREFIXES = ("", "/client/v4")  # the REST root clients default to is https://api.cloudflare.com/client/v4
ROUTE = "/accounts/{account_id}/ai/run/{model_id:path}"
_PATH = re.compile(r"^(?:/client/v4)?/accounts/[^/]+/ai/run/")

# Workers AI's own internal codes where one fits (developers.cloudflare.com/workers-ai/platform/errors);
# any other error carries its HTTP status as the code.
NO_SUCH_MODEL = 5007
_CODES = {"no_such_model": NO_SUCH_MODEL, "prompt_too_long": 3006, "request_too_large": 3006}


def is_workers_ai_path(path: str) -> bool:
    """Whether a request path is on this shape's routes (so its errors get the envelope)."""
    return bool(_PATH.match(path))


def check_model(model_id: str) -> None:
    if model_id not in MODEL_IDS:
        raise ApiError(400, "no_such_model", f"No such model {model_id}: this server runs {' or '.join(MODEL_IDS)}")


def success(result: bytes) -> bytes:
    """The envelope around an already rendered System One body: its bytes are kept as they are."""
    return b'{"result":' + result + b',"success":true,"errors":[],"messages":[]}'


def failure(problem: ApiError | Invalid) -> dict[str, Any]:
    if isinstance(problem, Invalid):
        where = ".".join(str(part) for part in problem.loc)  # ["body", "questions", "q", "criteria", 1] -> body.questions...
        errors = [{"code": 422, "message": f"{where}: {problem.msg}"}]
    else:
        errors = [{"code": _CODES.get(problem.error_type, problem.status), "message": problem.message}]
    return {"result": None, "success": False, "errors": errors, "messages": []}
