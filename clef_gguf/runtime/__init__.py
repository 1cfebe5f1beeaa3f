"""Running Clef decisions: backbone on llama.cpp, prompt, head, answers."""
