"""Adapters that let other JAX libraries drive an `LLM` (each an optional extra)."""
