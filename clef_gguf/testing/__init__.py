"""Tiny random Clef releases, request corpora and Cloudflare's reference as an oracle (needs the [test] extra)."""
