"""jaxpaged: LLM inference in JAX with PagedAttention and continuous batching."""
