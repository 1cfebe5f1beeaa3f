"""`python -m clef_gguf.cli`, as the `clef-gguf` console script."""

from . import main

main()
