"""Finding and importing models: the model store, GGUF files, tokenizers."""
