"""The Clef GGUF format as data: the contract table, the header reader, the hyperparameters, the prompt template."""
