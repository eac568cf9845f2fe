"""Every environment variable jaxpaged reads, in one place (vLLM's `envs.py`).

No other module of jaxpaged, `models/` or `server/` reads `os.environ` (a test greps for it);
`pallas_kernels/` gets what it needs from `jaxpaged.platforms` as arguments. Each variable is
a function, so it is read when asked, not when jaxpaged is imported:

| variable | default | meaning |
|---|---|---|
| `JAXPAGED_HOME` | `~/.cache/jaxpaged` | models, compiled kernels and the compile cache |
| `JAXPAGED_COMPILATION_CACHE_DIR` | unset | the compile cache's folder ("0"/"off": none) |
| `JAXPAGED_CPU_KERNEL` | `1` | `0`: never build or use the C++ CPU kernels |
| `JAXPAGED_FEW_ROW_KERNEL` | `1` | `0`: steps of a few tokens on XLA's dot, not the kernel |
| `CXX` | unset | the C++ compiler for the CPU kernels (else `c++`, then `g++`) |
| `JAX_PLATFORMS` | unset | jax's own; the CLI sets jax to CPU when unset and no GPU |
| `XLA_FLAGS` | `""` | XLA's own; read for the compile cache's key and run manifests |
"""

from __future__ import annotations

import os
from pathlib import Path

COMPILATION_CACHE_DIR_VAR = "JAXPAGED_COMPILATION_CACHE_DIR"


def _flag(name: str, default: bool) -> bool:
    """A 0/1 variable: anything but "0" is on; unset is `default`."""
    value = os.environ.get(name)
    return default if value is None else value.strip() != "0"


def jaxpaged_home() -> Path:
    """`$JAXPAGED_HOME` (default `~/.cache/jaxpaged`), user-expanded."""
    return Path(os.environ.get("JAXPAGED_HOME", "~/.cache/jaxpaged")).expanduser()


def compilation_cache_dir() -> str | None:
    """`$JAXPAGED_COMPILATION_CACHE_DIR`, or None when unset (then `$JAXPAGED_HOME/compile-cache`;
    see `jaxpaged.worker.compilation_cache.resolve_cache_dir`)."""
    return os.environ.get(COMPILATION_CACHE_DIR_VAR)


def cpu_kernel_enabled() -> bool:
    """`$JAXPAGED_CPU_KERNEL` (default 1): 0 reports the C++ CPU kernels unavailable."""
    return _flag("JAXPAGED_CPU_KERNEL", True)


def few_row_kernel_enabled() -> bool:
    """`$JAXPAGED_FEW_ROW_KERNEL` (default 1): 0 keeps steps of a few tokens on XLA's dot."""
    return _flag("JAXPAGED_FEW_ROW_KERNEL", True)


def cxx() -> str | None:
    """`$CXX`, the C++ compiler for the CPU kernels; None when unset or empty."""
    return os.environ.get("CXX") or None


def jax_platforms() -> str | None:
    """`$JAX_PLATFORMS` (jax's own), None when unset."""
    return os.environ.get("JAX_PLATFORMS")


def xla_flags() -> str:
    """`$XLA_FLAGS` (XLA's own), "" when unset."""
    return os.environ.get("XLA_FLAGS", "")


def add_xla_flag(flag: str) -> None:
    """Appends `flag` to `$XLA_FLAGS` (once). XLA reads it when jax's backend starts: a call
    after that changes nothing in this process."""
    if flag not in xla_flags().split():
        os.environ["XLA_FLAGS"] = f"{xla_flags()} {flag}".strip()
