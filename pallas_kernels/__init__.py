"""Paged-attention kernels, their pure-jnp references, and the backend dispatch.

This package imports only jax and numpy (and compiles one C++ file, `csrc/`, on first use of
the CPU kernel). The model calls attention through `dispatch.attention`,
so kernels replace the XLA path without touching model code.
"""

from jaxpaged.pallas_kernels.cpu_attention import paged_attention_cpu
from jaxpaged.pallas_kernels.dispatch import (ATTENTION_BACKENDS, attention,
                                              resolve_attention_backend)
from jaxpaged.pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from jaxpaged.pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                            ragged_paged_attention_reference)
from jaxpaged.pallas_kernels.reference import (PAD_SLOT_ID, copy_blocks, paged_attention_xla,
                                              paged_attention_xla_flat, write_kv)

__all__ = ["ATTENTION_BACKENDS", "PAD_SLOT_ID", "attention", "copy_blocks", "paged_attention",
           "paged_attention_reference", "paged_attention_xla", "paged_attention_xla_flat",
           "ragged_paged_attention", "ragged_paged_attention_reference",
           "resolve_attention_backend", "write_kv"]
