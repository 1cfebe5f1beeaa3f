"""Files shipped with the package: a tiny demo model (random weights) and a request."""

from pathlib import Path

DATA = Path(__file__).parent
DEMO_MODEL = DATA / "demo.gguf"
DEMO_REQUEST = DATA / "demo_request.json"
DEMO_CONTEXT = 4096  # the demo request takes a few hundred tokens: a small context keeps `clef-gguf demo` light
