"""The CPU platform: float32 by default, the C++ kernels, and batch-invariant mode.

Batch invariance (`LLM(batch_invariant=True)`): what makes a request's numbers depend on its
batch on CPU. XLA:CPU computes a row of a matmul one way for a few rows and another way from
some row count on, and which products it runs, and how, is decided inside the compiled step
(a dot fused with its neighbours by YNNPACK, a dot of a slice of a weight), not by the model's
parameter shapes alone. So every step is padded to at least `BATCH_INVARIANT_MIN_TOKENS`
tokens, or fewer where the model's own compiled step is found row-invariant from fewer
(`probe_min_step_tokens`). The C++ attention kernel's sums depend on how a step splits the
keys (its online-softmax tiles follow the cached blocks and then the step's new tokens, and it
scores a key by one of two loops depending on how many queries share a tile): in its invariant
order (`paged_attention_cpu(invariant=True)`) the tiles are aligned on positions, cached and
new keys gathered into one tile, and every score goes one way. The xla backend writes each
step's keys to the pool first and reads every key from there in position order. Norms, RoPE
and the sampler's per-row reductions need nothing.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

import numpy as np

from jaxpaged import envs
from jaxpaged.pallas_kernels import cpu_attention
from jaxpaged.pallas_kernels.plan import KernelPlan
from jaxpaged.platforms.interface import (CPU_ATTENTION, FEW_ROW_MATMUL, INT8_MATMUL,
                                          LORA_MATMUL, MOE_EXPERTS, Platform)

BATCH_INVARIANT_MIN_TOKENS = 64
# Step sizes (token buckets) below `BATCH_INVARIANT_MIN_TOKENS` a batch-invariant step may be
# padded to instead, where the model's step gives each token the same bits at that size
# (`probe_min_step_tokens`). Without XLA's YNNPACK fusions (`YNN_FUSIONS_OFF`), XLA:CPU's dot is
# row-invariant from 8 rows on SmolLM2's and Qwen2 0.5B's shapes.
CHEAPER_MIN_TOKENS = (16, 24, 32, 48)
YNN_FUSIONS_OFF = "--xla_cpu_experimental_ynn_fusion_type="
BATCH_INVARIANT_BACKENDS = ("cpu", "xla")


def configure_kernels() -> None:
    """Tells the C++ kernels where to build (`$JAXPAGED_HOME/kernels`), with which compiler
    (`$CXX`) and whether they may (`$JAXPAGED_CPU_KERNEL`)."""
    cpu_attention.configure(envs.jaxpaged_home() / "kernels", envs.cxx(),
                            envs.cpu_kernel_enabled())


def turn_ynn_fusions_off() -> None:
    """Adds `YNN_FUSIONS_OFF` to `XLA_FLAGS` while jax's backend has not started (XLA reads its
    flags then; a process that started it keeps its flags): batch-invariant steps can then be
    padded less, as `probe_min_step_tokens` finds."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        envs.add_xla_flag(YNN_FUSIONS_OFF)


def probe_min_step_tokens(run, num_seqs: int = 4) -> int:
    """The fewest tokens of `CHEAPER_MIN_TOKENS` (else `BATCH_INVARIANT_MIN_TOKENS`) from which
    the model's own compiled step gives a batch the same bits as a step of
    `BATCH_INVARIANT_MIN_TOKENS`: for each candidate m, largest first, `num_seqs` prefills of
    m / num_seqs tokens (their first m tokens in all) are run in a step of m tokens and again
    in one of `BATCH_INVARIANT_MIN_TOKENS`, and each sequence's logits compared. Every
    projection, norm, fusion and the LM head the engine runs are in it, at the shapes XLA
    really compiles (a probe of the weights' shapes alone misses dots XLA fuses or slices).

    Args:
      run: `run(T, lengths) -> f32[len(lengths), V]`: a step of T tokens holding fresh
        sequences of `lengths` tokens (the same tokens for the same lengths), each
        sequence's logits at its last token.
      num_seqs: sequences in each step (each candidate is a multiple of it).

    Returns:
      The step-size floor, in tokens.
    """
    floor = BATCH_INVARIANT_MIN_TOKENS
    for m in sorted(CHEAPER_MIN_TOKENS, reverse=True):
        lengths = [m // num_seqs] * num_seqs
        lengths[-1] += m - sum(lengths)
        if not np.array_equal(np.asarray(run(m, lengths)),
                              np.asarray(run(BATCH_INVARIANT_MIN_TOKENS, lengths))):
            break
        floor = m
    return floor


def _run_prefills(runner, T: int, lengths: list[int]) -> np.ndarray:
    """`probe_min_step_tokens`'s `run` on `runner` (a `ModelRunner`): the sequences'
    tokens (fixed pseudo-random ids) in a step padded to T tokens, each in blocks of its own
    from block 0 on, written to the pool (free at start) and read by nothing after."""
    S, vocab_size = runner.limits.block_size, runner.config.vocab_size
    tables = np.zeros((len(lengths), runner.limits.max_blocks_per_seq), np.int32)
    first_block = 0
    for i, n in enumerate(lengths):
        num_blocks = -(-n // S)
        tables[i, :num_blocks] = np.arange(first_block, first_block + num_blocks)
        first_block += num_blocks
    total = sum(lengths)
    ids = (np.arange(total) * 7919 + 11) % vocab_size
    batch = runner.inputs.model_input(T, tables, np.zeros((len(lengths),), np.int32),
                                      np.asarray(lengths, np.int32), ids)
    return np.asarray(runner.run_model(batch))[:len(lengths)]


class CpuPlatform(Platform):
    name = "cpu"
    jax_backend = "cpu"

    # XLA:CPU computes a row of a dot the same way at every row count from
    # `BATCH_INVARIANT_MIN_TOKENS` rows on: with at least that many slots, a step of T tokens
    # has min(T, slots) logits rows computed one way whatever `max_num_seqs` is.
    batch_invariant_min_seq_slots = BATCH_INVARIANT_MIN_TOKENS

    def __init__(self):
        configure_kernels()

    @property
    def default_attention_backend(self) -> str:
        """The C++ kernel where it builds, else the pure-jnp "xla" backend."""
        return "cpu" if cpu_attention.available() else "xla"

    def kernels(self) -> frozenset[str]:
        if not cpu_attention.available():
            return frozenset()
        return frozenset({CPU_ATTENTION, FEW_ROW_MATMUL, INT8_MATMUL, LORA_MATMUL, MOE_EXPERTS})

    def kernel_plan(self, dtype, tensor_parallel: bool, batch_invariant: bool,
                    attention_backend: str = "auto") -> KernelPlan:
        """The C++ kernels where they are built, on one device (`tensor_parallel` False):
        the few-row matmul with float32 weights, not batch-invariant (a row must be computed
        one way whatever the step's size), not turned off (`$JAXPAGED_FEW_ROW_KERNEL=0`); the
        LoRA kernel likewise (float32, not batch-invariant); the MoE kernel with float32
        activations, batch-invariant or not (it computes each token's pairs one way whatever
        the step holds; the jnp paths differ by step size); the quantized matmul. The
        attention backend as the base platform resolves it (see `Platform.kernel_plan`)."""
        kernels = self.kernels() if not tensor_parallel else frozenset()
        f32 = dtype == np.float32
        return KernelPlan(
            attention=self._attention_name(attention_backend, batch_invariant),
            few_row_matmul=(f32 and not batch_invariant and envs.few_row_kernel_enabled()
                            and FEW_ROW_MATMUL in kernels),
            quantized_matmul=INT8_MATMUL in kernels,
            moe_experts=f32 and MOE_EXPERTS in kernels,
            lora_matmul=f32 and not batch_invariant and LORA_MATMUL in kernels)

    def batch_invariant_backend(self, attention_backend: str) -> str:
        """"cpu" (the C++ kernel in its invariant order) or "xla"; "auto" resolved.

        Raises:
          ValueError: another backend asked for.
        """
        if attention_backend not in ("auto", *BATCH_INVARIANT_BACKENDS):
            raise ValueError(f"batch_invariant=True runs on the 'cpu' or 'xla' attention "
                             f"backend, not {attention_backend!r}")
        return self.attention_backend(attention_backend)

    def batch_invariant_min_step_tokens(self, runner, attention_backend: str) -> int:
        """`probe_min_step_tokens` on `runner`'s model for the C++ kernel (whose attention is
        row by row); `BATCH_INVARIANT_MIN_TOKENS` for the xla backend (its attention batches
        a step's tokens in its dots)."""
        limits = runner.limits
        if (attention_backend != "cpu" or limits.num_blocks < BATCH_INVARIANT_MIN_TOKENS
                or limits.max_blocks_per_seq * limits.block_size < BATCH_INVARIANT_MIN_TOKENS):
            return BATCH_INVARIANT_MIN_TOKENS  # no room for the probe's sequences
        return probe_min_step_tokens(functools.partial(_run_prefills, runner),
                                     min(4, limits.max_seq_slots))

    def machine_id(self) -> str:
        """The host CPU's model and feature flags, hashed (XLA's CPU code is native to them)."""
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            wanted = sorted({ln for ln in lines
                             if ln.split(":")[0].strip() in ("model name", "flags")})
            text = "\n".join(wanted)
        except OSError:
            text = platform.processor() or platform.machine()
        return hashlib.sha256(text.encode()).hexdigest()[:12]
