"""Checking a Clef GGUF before anything loads it: validate, its report, deep checks, remote prefixes."""
