"""Reading models from disk: GGUF files, Hugging Face folders, and writing GGUF."""
