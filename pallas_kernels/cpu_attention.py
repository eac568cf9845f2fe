"""Paged attention on CPU through a C++ XLA FFI custom call (the "cpu" attention backend).

`csrc/paged_attention_cpu.cc` reads each row's cached blocks in place in the pool, where the
pure-jnp `paged_attention_xla_flat` first gathers them into a new buffer and then runs thousands
of tiny dots. It is compiled with the system C++ compiler on first use (a few seconds), cached
under `$JAXPAGED_HOME/kernels/` keyed by source, jaxlib version and CPU, and registered with
`jax.ffi`. Where no compiler is found, `available()` is False and the "auto" backend falls back
to "xla".
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxpaged.pallas_kernels.reference import _MASK_VALUE, _new_token_mask

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cc"
_TARGET = "jaxpaged_paged_attention_context"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
          "-pthread"]


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXPAGED_HOME", "~/.cache/jaxpaged")).expanduser() / "kernels"


def _cpu_id() -> str:
    """The CPU's model and feature flags (`-march=native` code is only valid on such a CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted}))


def _build() -> Path:
    """Compiles the kernel (once per source, jaxlib and CPU) and returns the shared library.

    Raises:
      RuntimeError: no C++ compiler, or it failed (its output is in the message).
    """
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, jaxlib.__version__.encode(), _cpu_id().encode(),
                                     " ".join([compiler, *_FLAGS]).encode()])).hexdigest()[:16]
    lib = _cache_dir() / f"paged_attention_cpu-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, then rename: atomic
        out = Path(tmp) / lib.name
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(out, lib)
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (builds it on the first call).

    Set `JAXPAGED_CPU_KERNEL=0` to report False without building.
    """
    if os.environ.get("JAXPAGED_CPU_KERNEL", "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
    except (OSError, RuntimeError) as e:
        logger.warning("CPU attention kernel unavailable, using the jnp path: %s", e)
        return False
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxpagedPagedAttentionContext),
                                platform="cpu")
    return True


def paged_attention_cpu_context(q: jax.Array, kv_cache: jax.Array, layer: jax.Array,
                                context_blocks: jax.Array, context_rows: jax.Array,
                                context_lens: jax.Array, query_lens: jax.Array, *,
                                scale: float) -> tuple[jax.Array, jax.Array]:
    """Attention of each row's new queries over its cached tokens only (no new tokens, no mask).

    Args:
      q: f32[B, Q, N, H] queries (not pre-scaled).
      kv_cache: f32[L, 2, K, P, S, H] the whole pool; `layer` picks the layer read. Passing the
        whole pool (not a slice) lets XLA hand the custom call the buffer without a copy.
      layer: i32[] layer index.
      context_blocks, context_rows, context_lens: i32[NB] the flat block list of
        `paged_attention_xla_flat` (rows non-decreasing, padding entries last with row B).
      query_lens: i32[B] new tokens per row; slots past it are not computed.
      scale: softmax scale.

    Returns:
      (out f32[B, Q, N, H], lse f32[B, Q, N]): softmax-weighted values over the cached tokens and
      the log-sum-exp of the scaled scores; out = 0 and lse = -1e30 for a row without cached
      tokens and for padding slots.

    Raises:
      RuntimeError: `available()` is False.
    """
    if not available():
        raise RuntimeError("the CPU attention kernel is not available (see the log)")
    B, Q, N, H = q.shape
    call = jax.ffi.ffi_call(_TARGET, (jax.ShapeDtypeStruct((B, Q, N, H), jnp.float32),
                                      jax.ShapeDtypeStruct((B, Q, N), jnp.float32)))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return call(q.astype(jnp.float32), kv_cache, i32(layer), i32(context_blocks),
                i32(context_rows), i32(context_lens), i32(query_lens), scale=np.float32(scale))


def paged_attention_cpu(q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv_cache: jax.Array,
                        layer: jax.Array, context_blocks: jax.Array, context_rows: jax.Array,
                        context_lens: jax.Array, query_lens: jax.Array, *,
                        scale: float) -> jax.Array:
    """`paged_attention_xla_flat` with the cached context read by the C++ kernel.

    The kernel's context part and the new tokens' causal part (a few dense jnp dots) are merged
    through their log-sum-exps, flash-decoding's combine step.

    Args:
      q: f32[B, Q, N, H]; k_new, v_new: f32[B, Q, K, H] the new tokens.
      kv_cache: f32[L, 2, K, P, S, H] the pool, read at `layer` (i32[]).
      context_blocks, context_rows, context_lens, query_lens, scale: as in
        `paged_attention_xla_flat`.

    Returns:
      f32[B, Q, N, H], equal to `paged_attention_xla_flat` up to float rounding. Query slots past
      `query_lens[b]` hold finite garbage.
    """
    B, Q, N, H = q.shape
    K = k_new.shape[2]
    G = N // K
    out_ctx, lse_ctx = paged_attention_cpu_context(
        q, kv_cache, layer, context_blocks, context_rows, context_lens, query_lens, scale=scale)

    qg = q.reshape(B, Q, K, G, H)
    s_new = jnp.einsum("BQKGH,BJKH->BQKGJ", qg, k_new, preferred_element_type=jnp.float32)
    s_new = jnp.where(_new_token_mask(Q, query_lens)[:, :, None, None], s_new * scale,
                      _MASK_VALUE)
    m_new = s_new.max(-1)  # [B, Q, K, G]
    p_new = jnp.exp(s_new - m_new[..., None])
    out_new = jnp.einsum("BQKGJ,BJKH->BQKGH", p_new.astype(q.dtype), v_new,
                         preferred_element_type=jnp.float32)

    lse_ctx = lse_ctx.reshape(B, Q, K, G)
    m = jnp.maximum(lse_ctx, m_new)
    w_ctx, w_new = jnp.exp(lse_ctx - m), jnp.exp(m_new - m)  # out_ctx is already normalized
    denom = w_ctx + w_new * p_new.sum(-1)
    out = (out_ctx.reshape(B, Q, K, G, H) * w_ctx[..., None] + out_new * w_new[..., None])
    return (out / denom[..., None]).reshape(B, Q, N, H).astype(q.dtype)
