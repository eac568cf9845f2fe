"""Paged attention on CPU through a C++ XLA FFI custom call (the "cpu" attention backend).

`csrc/paged_attention_cpu.cc` reads each sequence's cached blocks in place in the pool (listed in
one flat block list), where the pure-jnp `paged_attention_xla_packed` first gathers every
token's pages into a new buffer; the new tokens' K/V come in as arguments, so all layers' are
written in one scatter after the forward pass. It takes the packed step as every backend does
(`query_start_loc`). It is compiled with the system C++
compiler on first use (a few seconds), cached in the folder `configure` names
(`$JAXPAGED_HOME/kernels/`, set by `jaxpaged.platforms`) keyed by source, jaxlib version, CPU
and compiler command, and registered with `jax.ffi`. Where no compiler is found, or before
`configure`, `available()` is False and the "auto" backend falls back to "xla".

It also takes Gemma 2's logit soft cap and Mistral's (and Gemma 2's local layers') sliding
window, with the semantics of Hugging Face transformers; see `paged_attention_cpu`.
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

from jaxpaged.pallas_kernels.reference import QuantizedKVCache

logger = logging.getLogger(__name__)

# Every C++ kernel, compiled into one library: the paged attention here, the weight-only int8,
# the W8A8 and the GGUF Q8_0 block matmuls (`quantized_matmul`), the float32 few-row matmul
# (`few_row_matmul`), the LoRA adapters' products by slot (`lora_matmul`) and the
# Mixture-of-Experts experts by expert (`moe_experts`).
_SOURCES = (Path(__file__).parent / "csrc" / "paged_attention_cpu.cc",
            Path(__file__).parent / "csrc" / "int8_matmul_cpu.cc",
            Path(__file__).parent / "csrc" / "f32_matmul_cpu.cc",
            Path(__file__).parent / "csrc" / "lora_matmul_cpu.cc",
            Path(__file__).parent / "csrc" / "w8a8_matmul_cpu.cc",
            Path(__file__).parent / "csrc" / "q8_0_matmul_cpu.cc",
            Path(__file__).parent / "csrc" / "moe_experts_cpu.cc")
# Headers the sources include (part of the build's key, not compiled on their own).
_HEADERS = (Path(__file__).parent / "csrc" / "cpu_tasks.h",)
_TARGET = "jaxpaged_paged_attention"
_QUANTIZED_TARGET = "jaxpaged_paged_attention_quantized"
INT8_MATMUL_TARGET = "jaxpaged_int8_matmul"
W8A8_MATMUL_TARGET = "jaxpaged_w8a8_matmul"
W8A8_MATMUL_F32_TARGET = "jaxpaged_w8a8_matmul_f32"
Q8_0_MATMUL_TARGET = "jaxpaged_q8_0_matmul"
F32_MATMUL_KN_TARGET = "jaxpaged_f32_matmul_kn"
F32_MATMUL_NK_TARGET = "jaxpaged_f32_matmul_nk"
LORA_MATMUL_TARGET = "jaxpaged_lora_matmul"
MOE_EXPERTS_F32_TARGET = "jaxpaged_moe_experts_f32"
MOE_EXPERTS_I8_TARGET = "jaxpaged_moe_experts_i8"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
          "-pthread"]


# Where the library is built, which compiler and whether the kernels may be used at all:
# set by `configure` (kernels read no environment; `jaxpaged.platforms` passes it in).
_settings: dict = {"build_dir": None, "compiler": None, "enabled": True}
_library: dict = {}  # "lib": the loaded kernels, once `available()`


def configure(build_dir: str | os.PathLike, compiler: str | None = None,
              enabled: bool = True) -> None:
    """Where `available()` builds and caches the kernels' library (`build_dir`), with which
    C++ compiler (None: `c++`, else `g++` on the PATH), and whether it may (`enabled` False:
    `available()` is False without building). Call before the first `available()`: its
    answer is kept."""
    _settings.update(build_dir=Path(build_dir), compiler=compiler, enabled=enabled)


def _cpu_id() -> str:
    """The CPU's model and feature flags (`-march=native` code is only valid on such a CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted}))


def _build() -> Path:
    """Compiles the kernels (once per source, jaxlib and CPU) and returns the shared library.

    Raises:
      RuntimeError: no C++ compiler, or it failed (its output is in the message).
    """
    if _settings["build_dir"] is None:
        raise RuntimeError("no build folder: cpu_attention.configure was not called")
    compiler = _settings["compiler"] or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    sources = [path.read_bytes() for path in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256(b"\0".join([*sources, jaxlib.__version__.encode(), _cpu_id().encode(),
                                     " ".join([compiler, *_FLAGS]).encode()])).hexdigest()[:16]
    lib = _settings["build_dir"] / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, then rename: atomic
        out = Path(tmp) / lib.name
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(out, lib)
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered (builds them on the first call).

    False without building where `configure(..., enabled=False)` said so
    (`JAXPAGED_CPU_KERNEL=0`).
    """
    if not _settings["enabled"]:
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
    except (OSError, RuntimeError) as e:
        logger.warning("CPU attention kernel unavailable, using the jnp path: %s", e)
        return False
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxpagedPagedAttention),
                                platform="cpu")
    jax.ffi.register_ffi_target(_QUANTIZED_TARGET,
                                jax.ffi.pycapsule(lib.JaxpagedPagedAttentionQuantized),
                                platform="cpu")
    jax.ffi.register_ffi_target(INT8_MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxpagedInt8Matmul),
                                platform="cpu")
    jax.ffi.register_ffi_target(F32_MATMUL_KN_TARGET,
                                jax.ffi.pycapsule(lib.JaxpagedF32MatmulKN), platform="cpu")
    jax.ffi.register_ffi_target(F32_MATMUL_NK_TARGET,
                                jax.ffi.pycapsule(lib.JaxpagedF32MatmulNK), platform="cpu")
    jax.ffi.register_ffi_target(LORA_MATMUL_TARGET,
                                jax.ffi.pycapsule(lib.JaxpagedLoraMatmul), platform="cpu")
    jax.ffi.register_ffi_target(W8A8_MATMUL_TARGET,
                                jax.ffi.pycapsule(lib.JaxpagedW8A8Matmul), platform="cpu")
    jax.ffi.register_ffi_target(W8A8_MATMUL_F32_TARGET,
                                jax.ffi.pycapsule(lib.JaxpagedW8A8MatmulF32), platform="cpu")
    jax.ffi.register_ffi_target(Q8_0_MATMUL_TARGET,
                                jax.ffi.pycapsule(lib.JaxpagedQ8_0Matmul), platform="cpu")
    for target, symbol in ((MOE_EXPERTS_F32_TARGET, lib.JaxpagedMoeExpertsF32),
                           (MOE_EXPERTS_I8_TARGET, lib.JaxpagedMoeExpertsI8)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    _library["lib"] = lib
    return True


def w8a8_isa() -> str | None:
    """The path the W8A8 kernel takes on this CPU ("avx512-vnni" or "portable", checked at run
    time), or None where the kernels are not built."""
    if not available():
        return None
    fn = _library["lib"].JaxpagedW8A8Isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def _check_call(sliding_window: int | None, soft_cap: float | None) -> None:
    """`paged_attention_cpu`'s refusals: a window < 1, a cap <= 0, no kernel built."""
    if sliding_window is not None and not 1 <= sliding_window < 2 ** 31:
        raise ValueError(f"sliding_window must be a number of tokens >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if not available():
        raise RuntimeError("the CPU attention kernel is not available (see the log)")


def paged_attention_cpu(q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv_cache: jax.Array,
                        layer: jax.Array, query_start_loc: jax.Array, query_lens: jax.Array,
                        context_blocks: jax.Array, context_rows: jax.Array,
                        context_lens: jax.Array, *, scale: float,
                        sliding_window: int | None = None,
                        soft_cap: float | None = None, invariant: bool = False
                        ) -> jax.Array:
    """Causal paged attention of packed sequences, read in place from the pool by the C++ kernel.

    Sequence b's new tokens are `q[query_start_loc[b] : query_start_loc[b] + query_lens[b]]`
    (vLLM's packed layout); each attends to its sequence's cached tokens, listed as blocks in the
    flat block list (`backends.CpuBackend`), and to its own new tokens up to itself.
    Positions count from the sequence's first cached token: its cached tokens are at 0..c-1
    (c = the sum of its `context_lens` entries) and its new tokens at c, c + 1, ...

    `sliding_window` and `soft_cap` follow Mistral and Gemma 2 as implemented in Hugging Face
    transformers (and `ragged_paged_attention_reference`): with a window of W tokens the query at
    position p attends only to keys at positions p - W < j <= p, its last W positions itself
    included; the kernel skips the cached blocks before a query chunk's window rather than
    masking them. With a soft cap, each score s = (q . k) * scale becomes
    soft_cap * tanh(s / soft_cap) before the softmax. With neither, the kernel runs the same
    code as without them.

    Args:
      q: f32[T, N, H] queries (not pre-scaled).
      k_new, v_new: f32[T, K, H] the new tokens' keys and values.
      kv_cache: f32[L, 2, K, P, S, H] the whole pool, or an 8-bit `QuantizedKVCache` of that
        layout (decoded as each block is read), read at `layer` (i32[]). Passing the whole
        pool, not a slice, lets XLA hand the custom call its buffer without a copy.
      query_start_loc: i32[B + 1] first token of each sequence (non-decreasing, <= T).
      query_lens: i32[B] new tokens per sequence (0 for a padding sequence).
      context_blocks, context_rows, context_lens: i32[NB] the sequences' cached blocks (rows
        non-decreasing; padding entries last, with row B and 0 tokens).
      scale: softmax scale.
      sliding_window: None (no window) or the window in tokens, >= 1, the query's own position
        included (transformers' `config.sliding_window`).
      soft_cap: None (no cap) or the attention logit soft cap, > 0 (Gemma 2's
        `attn_logit_softcapping`, 50.0).
      invariant: batch-invariant order of operations: every query's keys in tiles aligned at
        positions 0, 16, 32, ... (cached and new keys gathered into one tile where a tile holds
        both) and every score through the transposed tile, so a token's output is bitwise the
        same however its sequence is split into cached and new tokens and whatever shares the
        call (`LLM(batch_invariant=True)`); slower (each tile is copied).

    Returns:
      (out, kv_cache): out f32[T, N, H], equal to `paged_attention_xla_packed` on the same tokens
      up to float rounding, 0 for tokens of no sequence; and the pool, unchanged, aliased to
      the input buffer. Threading the pool through each layer's call makes the calls one chain
      of uses of its buffer, so XLA can order them before the step's K/V write without
      copying the pool.

    Raises:
      ValueError: `sliding_window` < 1 or `soft_cap` <= 0.
      RuntimeError: `available()` is False. Inconsistent indices (a block outside the pool,
        `query_start_loc` past T) fail the call with a `JaxRuntimeError`.
    """
    _check_call(sliding_window, soft_cap)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    index = (i32(layer), i32(query_start_loc), i32(query_lens), i32(context_blocks),
             i32(context_rows), i32(context_lens))
    attrs = dict(scale=np.float32(scale), sliding_window=np.int32(sliding_window or 0),
                 soft_cap=np.float32(soft_cap or 0.0), invariant=np.int32(invariant))
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if isinstance(kv_cache, QuantizedKVCache):
        call = jax.ffi.ffi_call(
            _QUANTIZED_TARGET, (out, jax.ShapeDtypeStruct(kv_cache.codes.shape, kv_cache.dtype),
                                jax.ShapeDtypeStruct(kv_cache.scales.shape, jnp.float32)),
            input_output_aliases={3: 1, 4: 2})
        out, codes, scales = call(f32(q), f32(k_new), f32(v_new), kv_cache.codes,
                                  kv_cache.scales, *index, **attrs,
                                  fp8=np.int32(kv_cache.dtype == jnp.uint8))
        return out, QuantizedKVCache(codes, scales)
    call = jax.ffi.ffi_call(_TARGET, (out, jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)),
                            input_output_aliases={3: 1})
    return call(f32(q), f32(k_new), f32(v_new), kv_cache, *index, **attrs)
