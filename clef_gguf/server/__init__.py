"""`clef-gguf serve`: a Jev-compatible System One server (FastAPI on uvicorn) over one loaded ClefModel.

Routes: POST /v1/systemone, GET /v1/models, GET /health, and Workers AI's
POST [/client/v4]/accounts/{account_id}/ai/run/@cf/cloudflare/clef[-flash] (workers_ai.py), the same
answers in Cloudflare's envelope. The model is loaded by the caller (launch.py, for `clef-gguf serve`)
before the port is bound, so a file that loading rejects never gets a listening server.
`clef-gguf serve --ray` serves the same app from a Ray Serve ingress (ray_serve.py, imported only then).
"""

from __future__ import annotations

from ..settings import BYTES_PER_TOKEN, HttpLimits, ServeSettings, body_limit
from .app import create_app
from .run import serve, uvicorn_config

__all__ = ["BYTES_PER_TOKEN", "HttpLimits", "ServeSettings", "body_limit", "create_app", "serve", "uvicorn_config"]
