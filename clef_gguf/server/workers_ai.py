"""Cloudflare Workers AI's REST shape for Clef, over the same model and the same answers.

clef-evals, clef-compactor and clef-router speak only this shape:
`POST {base}/accounts/{account_id}/ai/run/@cf/cloudflare/{clef|clef-flash}` (base usually ends in
`/client/v4`), with a System One request body, answered as
`{"result": <System One body>, "success": true, "errors": [], "messages": []}`. Its errors'
envelope is rendered where every error is (problems.py).
"""

from __future__ import annotations

from ..errors import NO_SUCH_MODEL
from .problems import ApiError

# Both names mean the loaded model: a client picks one, a server holds one file.
MODEL_IDS = ("@cf/cloudflare/clef", "@cf/cloudflare/clef-flash")
PREFIXES = ("", "/client/v4")  # the REST root clients default to is https://api.cloudflare.com/client/v4
ROUTE = "/accounts/{account_id}/ai/run/{model_id:path}"


def check_model(model_id: str) -> None:
    if model_id not in MODEL_IDS:
        raise ApiError(NO_SUCH_MODEL, f"No such model {model_id}: this server runs {' or '.join(MODEL_IDS)}")


def success(result: bytes) -> bytes:
    """The envelope around an already rendered System One body: its bytes are kept as they are."""
    return b'{"result":' + result + b',"success":true,"errors":[],"messages":[]}'
