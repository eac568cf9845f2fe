"""tunix's rollout contract backed by jaxpaged: `JaxpagedRollout`, a `BaseRollout`.

tunix (google-tunix, the `tunix` extra) trains with RL (GRPO, PPO) in JAX and samples its
rollouts through a `BaseRollout`: `generate` from a `RolloutConfig`, `get_per_token_logps` of
completions, `update_params` between training steps, `pad_id`, `eos_id`, `model`. This class
implements them on an `LLM`, the way tunix's own vLLM rollout does on vLLM
(`tunix/rl/rollout/vllm_rollout.py`, 0.1.7): generation through the paged engine, log-
probabilities by `LLM.completion_logprobs`, new weights by `LLM.update_params`.

tunix pins `safetensors<0.8` and brings a large stack (grain, tensorflow-datasets, ...), so it
lives in its own virtualenv: `make test-tunix` builds `.venv-tunix` and runs its tests.

Limits: `update_params` takes jaxpaged's parameter tree (`LLM.get_params()`'s structure, the
tree `LLM.dense_forward` trains), not a tunix model's: tunix's `RLCluster.sync_weights` passes
its actor's `nnx.state`, which needs a name mapping first (for a Hugging Face-named tree,
`LLM.load_weights`). `model()` is jaxpaged's module, whose forward is `dense_forward(input_ids,
attention_mask)`, not tunix's `model(tokens, positions, cache, attention_mask)`; it cannot be
tunix's actor. LoRA parameters are not supported.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from jaxpaged.entrypoints.llm import LLM
from jaxpaged.sampling_params import SamplingParams


class JaxpagedRollout(base_rollout.BaseRollout):
    """A tunix rollout worker on a jaxpaged `LLM`.

    Args:
      llm: the engine; or None, and `LLM(**llm_kwargs)` is built.
      logprobs_mode: the `SamplingParams.logprobs_mode` of `generate`'s logprobs: "processed"
        (the distribution each token was drawn from, tunix's vLLM default
        `processed_logprobs`) or "raw".
    """

    def __init__(self, llm: LLM | None = None, logprobs_mode: str = "processed",
                 **llm_kwargs):
        self.llm = llm if llm is not None else LLM(**llm_kwargs)
        self.logprobs_mode = logprobs_mode
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs) -> base_rollout.RolloutOutput:
        """One completion per prompt, batched through the engine.

        The prompts are tokenized (with the tokenizer's special tokens) and cut to their last
        `max_prompt_length` tokens; sampling follows `temperature`, `top_p`, `top_k` (None or
        -1: off), `seed` (an int or a jax scalar; completion i uses seed + i), `eos_tokens`
        (stop tokens, besides the model's EOS) and `max_tokens_to_generate`. `logprobs` is
        filled when `return_logprobs` is set.

        Returns:
          `RolloutOutput`: text, tokens (i32 arrays, EOS included when reached),
          `left_padded_prompt_tokens` i32[B, max_prompt_length] (padded with `pad_id()`),
          logprobs (f32 arrays, or None), logits None (not kept).
        """
        cfg = rollout_config
        prompt_ids = [self.tokenizer(p).input_ids[-cfg.max_prompt_length:] for p in prompts]
        seed = None if cfg.seed is None else int(np.asarray(cfg.seed).ravel()[0])
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            [SamplingParams(max_tokens=cfg.max_tokens_to_generate, temperature=cfg.temperature,
                            top_p=1.0 if cfg.top_p is None else cfg.top_p,
                            top_k=0 if cfg.top_k in (None, -1) else cfg.top_k,
                            seed=None if seed is None else seed + i,
                            stop_token_ids=list(cfg.eos_tokens or []),
                            logprobs=0 if cfg.return_logprobs else None,
                            logprobs_mode=self.logprobs_mode)
             for i in range(len(prompts))], use_tqdm=False)
        padded = np.full((len(prompts), cfg.max_prompt_length), self.pad_id(), np.int32)
        for row, ids in zip(padded, prompt_ids):
            row[len(row) - len(ids):] = ids
        completions = [o.outputs[0] for o in outputs]
        logprobs = None
        if cfg.return_logprobs:
            logprobs = [np.array([entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)],
                                 np.float32) for c in completions]
        return base_rollout.RolloutOutput(
            text=[c.text for c in completions], logits=None,
            tokens=[np.asarray(c.token_ids, np.int32) for c in completions],
            left_padded_prompt_tokens=padded, logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array
                            ) -> jax.Array:
        """The model's log-probability of each completion token (temperature 1, as tunix's
        `compute_per_token_logps`), teacher-forced through the paged engine.

        Args:
          prompt_tokens: i32[B, P] left-padded with `pad_id()`.
          completion_tokens: i32[B, C]; each row's completion ends at its first `eos_id()`
            (included) or at its padding (tunix's `make_completion_mask`).

        Returns:
          f32[B, C], 0 past each completion's end.
        """
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        pad, eos = self.pad_id(), self.eos_id()
        rows_p, rows_c = [], []
        for p, c in zip(prompts, completions):
            rows_p.append(p[np.argmax(p != pad):].tolist() if (p != pad).any() else [])
            end = len(c)
            if (c == eos).any():
                end = int(np.argmax(c == eos)) + 1
            elif pad != eos and (c == pad).any():
                end = int(np.argmax(c == pad))
            rows_c.append(c[:end].tolist())
        scored = self.llm.completion_logprobs(rows_p, rows_c)
        out = np.zeros(completions.shape, np.float32)
        for row, values in zip(out, scored):
            row[:len(values)] = values
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Serves with `params` from the next step (`LLM.update_params`): the engine's parameter
        tree (`LLM.get_params()`'s structure), or a module of its family, whose `nnx.Param`s
        are taken. `filter_types` is accepted for tunix's signature; the tree must hold every
        parameter anyway."""
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        self.llm.update_params(params)

    def pad_id(self) -> int:
        """The tokenizer's pad token id, else its EOS id."""
        pad = self.tokenizer.pad_token_id
        return self.eos_id() if pad is None else int(pad)

    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def model(self) -> nnx.Module:
        """The served model: the family's module with the engine's current parameters (its
        `dense_forward` is the differentiable forward)."""
        engine = self.llm.llm_engine
        return nnx.merge(engine.runner.graphdef, engine.get_params())
