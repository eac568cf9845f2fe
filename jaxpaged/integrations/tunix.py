"""tunix's rollout contract backed by jaxpaged: `JaxpagedRollout`, a `BaseRollout`.

tunix (google-tunix, the `tunix` extra) trains with RL (GRPO, PPO) in JAX and samples its
rollouts through a `BaseRollout`: `generate` from a `RolloutConfig`, `get_per_token_logps` of
completions, `update_params` between training steps, `pad_id`, `eos_id`, `model`. This class
implements them on an `LLM`, the way tunix's own vLLM rollout does on vLLM
(`tunix/rl/rollout/vllm_rollout.py`, 0.1.7): generation through the paged engine, log-
probabilities by `LLM.completion_logprobs`, new weights by `LLM.update_params` or, for a LoRA
actor, `LLM.update_lora`.

tunix's `RLCluster` builds it as `rollout_engine(rollout_actor=, tokenizer=, mesh=,
rollout_config=)` (give the class, or a `functools.partial` of it that names the model
folder); `RLCluster.sync_weights` then sends the actor's `nnx.Param`s, or its `nnx.LoRAParam`s
when qwix put adapters on it, named as tunix's models name them (`jaxpaged.integrations.
tunix_params` maps them on the device, under tunix's transfer guards).

tunix pins `safetensors<0.8` and brings a large stack (grain, tensorflow-datasets, ...), so it
lives in its own virtualenv: `make test-tunix` builds `.venv-tunix` and runs its tests.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from jaxpaged.entrypoints.llm import LLM
from jaxpaged.integrations.tunix_params import TunixParams, tunix_paths
from jaxpaged.lora.request import LoRARequest
from jaxpaged.models.loader import flat_params
from jaxpaged.sampling_params import SamplingParams

LORA_NAME = "tunix-actor"  # the adapter a LoRA actor's weights are served as

class JaxpagedRollout(base_rollout.BaseRollout):
    """A tunix rollout worker on a jaxpaged `LLM`.

    Args:
      llm: the engine; or None, and one is built from `model` (a Hugging Face folder), else
        `rollout_config.rollout_vllm_model_version` (the field tunix's vLLM rollout reads),
        with `tensor_parallel_size` the size of `mesh`'s "tp" axis (1 without a mesh),
        `max_model_len` the config's `max_prompt_length + max_tokens_to_generate + 1`, and
        `**llm_kwargs` (any `LLM` option, overriding those).
      rollout_actor: tunix's actor model (what `RLCluster` passes). Its weights are served
        from the start; with qwix adapters (`nnx.LoRAParam`s) on it, its base weights are
        served and its adapter as LoRA `LORA_NAME` (the engine built with `enable_lora`).
      tokenizer, mesh, rollout_config: as `RLCluster` passes them (the tokenizer is the
        engine's own, read from the model folder; tunix's is not used).
      pad_id: the id that left-pads prompts (`pad_id()`), which tunix's trainer masks out of
        prompts: it must not occur inside them (SmolLM2's pad token `<|im_end|>` does occur
        in chat prompts). Default: the tokenizer's pad id, else its EOS id.
      lora_alpha: qwix's `LoraProvider(alpha=)` of a LoRA actor (the scale is alpha / rank);
        default: `rollout_config.rollout_sglang_jax_lora_scaling` times the rank.
      logprobs_mode: the `SamplingParams.logprobs_mode` of `generate`'s logprobs: "processed"
        (the distribution each token was drawn from, tunix's vLLM default
        `processed_logprobs`) or "raw".

    Raises:
      ValueError: no engine and no model folder; a LoRA actor without `lora_alpha`; an actor
        whose parameters the engine cannot map (named).
    """

    def __init__(self, llm: LLM | None = None, *, rollout_actor: nnx.Module | None = None,
                 tokenizer: Any = None, mesh: jax.sharding.Mesh | None = None,
                 rollout_config: base_rollout.RolloutConfig | None = None,
                 model: str | None = None, pad_id: int | None = None,
                 lora_alpha: float | None = None, logprobs_mode: str = "processed",
                 **llm_kwargs):
        del tokenizer  # the engine tokenizes with the model folder's tokenizer
        lora = {} if rollout_actor is None else tunix_paths(
            nnx.state(rollout_actor, nnx.LoRAParam))
        self.lora_rank = next((x.shape[-1] for p, x in lora.items() if p.endswith("_lora_a")),
                              None)
        if self.lora_rank is not None and lora_alpha is None:
            scaling = getattr(rollout_config, "rollout_sglang_jax_lora_scaling", None)
            if scaling is None:
                raise ValueError("lora_alpha: the actor has LoRA parameters; give qwix's "
                                 "LoraProvider alpha (JaxpagedRollout(..., lora_alpha=...))")
            lora_alpha = scaling * self.lora_rank
        self.lora_alpha = lora_alpha
        if llm is None:
            llm = LLM(**_engine_kwargs(model, mesh, rollout_config, self.lora_rank,
                                       llm_kwargs))
        self.llm = llm
        self.logprobs_mode = logprobs_mode
        self.tokenizer = self.llm.get_tokenizer()
        self._pad_id = pad_id
        self._tunix_params = None  # TunixParams, built at the first tunix-named sync
        self.lora_request = None
        if rollout_actor is not None:
            self.update_params(nnx.state(rollout_actor, nnx.All(nnx.Param,
                                                                nnx.Not(nnx.LoRAParam))))
            if lora:
                self.update_params(nnx.state(rollout_actor, nnx.LoRAParam), (nnx.LoRAParam,))

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
             for i in range(len(prompts))], use_tqdm=False, lora_request=self.lora_request)
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
        scored = self.llm.completion_logprobs(rows_p, rows_c, lora_request=self.lora_request)
        out = np.zeros(completions.shape, np.float32)
        for row, values in zip(out, scored):
            row[:len(values)] = values
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Serves `params` from the next step, which may be:

        - a tunix model's `nnx.Param` state (what `RLCluster.sync_weights` sends; tunix's
          Llama 3, Qwen 2, Qwen 3 or Gemma 3 names), mapped on the device
          (`tunix_params.TunixParams`, jitted once) into `LLM.update_params`;
        - its `nnx.LoRAParam` state (`filter_types` holding `nnx.LoRAParam`, or every leaf a
          qwix `_lora_a`/`_lora_b`), which becomes adapter `LORA_NAME` by `LLM.update_lora`
          (laid out on the device) and is used by every request from then on;
        - the engine's own tree (`LLM.get_params()`'s structure), or a module of its family.

        Nothing goes through the host: this runs under tunix's transfer guards.

        Raises:
          ValueError: parameters the engine cannot map, or LoRA parameters for an engine
            built without adapters (named).
        """
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        named = tunix_paths(params)
        if (filter_types is not None and nnx.LoRAParam in filter_types) or (
                named and all(p.endswith(("_lora_a", "_lora_b")) for p in named)):
            self._update_lora(params)
            return
        if set(flat_params(params)) == set(flat_params(self.llm.get_params())):
            self.llm.update_params(params)  # the engine's own tree
            return
        if self._tunix_params is None:
            self._tunix_params = TunixParams(self.llm.llm_engine)
        self.llm.update_params(self._tunix_params(params))

    def _update_lora(self, params) -> None:
        if self.lora_rank is None:
            raise ValueError("update_params: LoRA parameters, but the rollout was built "
                             "without a LoRA actor (its engine serves no adapters)")
        self.llm.update_lora(LORA_NAME, params,
                             {"r": self.lora_rank, "lora_alpha": self.lora_alpha})
        self.lora_request = LoRARequest(LORA_NAME, 1)

    def pad_id(self) -> int:
        """The id that pads prompts: the one given, else the tokenizer's pad id, else its EOS
        id."""
        if self._pad_id is not None:
            return int(self._pad_id)
        pad = self.tokenizer.pad_token_id
        return self.eos_id() if pad is None else int(pad)

    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def model(self) -> None:
        """None, as tunix's vLLM rollout: the engine's module is not tunix's, so it shares no
        weights with the actor (tunix's `is_sharing_weights` check). `llm.get_params()` gives
        the served weights."""
        return None


def _engine_kwargs(model: str | None, mesh, rollout_config, lora_rank: int | None,
                   llm_kwargs: dict) -> dict:
    """`LLM` options for a rollout built by tunix's `RLCluster` (see `JaxpagedRollout`)."""
    model = model or llm_kwargs.pop("model", None) or getattr(
        rollout_config, "rollout_vllm_model_version", "")
    if not model:
        raise ValueError("model: JaxpagedRollout needs the actor's Hugging Face folder, as "
                         "functools.partial(JaxpagedRollout, model=...) or "
                         "rollout_config.rollout_vllm_model_version")
    kwargs = {"model": model}
    tp = getattr(rollout_config, "tensor_parallel_size", -1)
    if (tp is None or tp < 1) and mesh is not None:
        tp = dict(mesh.shape).get("tp", 1)
    kwargs["tensor_parallel_size"] = tp if tp and tp > 0 else 1
    if rollout_config is not None:
        # A longest prompt and completion, and the position after them.
        kwargs["max_model_len"] = (rollout_config.max_prompt_length
                                   + rollout_config.max_tokens_to_generate + 1)
    if lora_rank is not None:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank)
    return {**kwargs, **llm_kwargs}
