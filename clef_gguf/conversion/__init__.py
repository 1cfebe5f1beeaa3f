"""Making Clef GGUF files: the release reader, the vocabulary, the writer, convert, graft, quantize."""
