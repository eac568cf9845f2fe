"""What users call: `LLM`, the command line, batch runs and replay, beam search."""
