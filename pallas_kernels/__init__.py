"""Paged-attention kernels and their pure-jnp references.

This package imports only jax and numpy. The model calls attention through `paged_attention`
here, so kernels can replace the XLA path without touching model code.
"""

from .reference import PAD_SLOT_ID, paged_attention_xla, write_kv

paged_attention = paged_attention_xla

__all__ = ["PAD_SLOT_ID", "paged_attention", "paged_attention_xla", "write_kv"]
