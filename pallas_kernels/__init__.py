"""Paged-attention kernels, their pure-jnp references, and the attention backends.

This package imports only jax and numpy (and compiles one C++ file, `csrc/`, on first use of
the CPU kernel). The model calls attention through a backend object (`backends`), so kernels
replace one another without touching model code.
"""

from jaxpaged.pallas_kernels.backends import (ATTENTION_BACKENDS, DATA_AXIS, KV_CACHE_SPEC,
                                              MODEL_AXIS, AttentionBackend, AttentionMetadata,
                                              AttentionSpec, StepLimits, make_attention_backend)
from jaxpaged.pallas_kernels.cpu_attention import paged_attention_cpu
from jaxpaged.pallas_kernels.plan import KernelPlan
from jaxpaged.pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from jaxpaged.pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                            ragged_paged_attention_reference)
from jaxpaged.pallas_kernels.reference import (PAD_SLOT_ID, copy_blocks,
                                              paged_attention_xla_packed, write_kv)

__all__ = ["ATTENTION_BACKENDS", "DATA_AXIS", "KV_CACHE_SPEC", "MODEL_AXIS", "PAD_SLOT_ID", "AttentionBackend", "AttentionMetadata",
           "AttentionSpec", "KernelPlan", "StepLimits", "copy_blocks", "make_attention_backend",
           "paged_attention", "paged_attention_cpu", "paged_attention_reference",
           "paged_attention_xla_packed", "ragged_paged_attention",
           "ragged_paged_attention_reference", "write_kv"]
