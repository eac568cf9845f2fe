"""The engine: requests in, one scheduled and executed step at a time, outputs out."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import jax
import jinja2
import jax.numpy as jnp
import numpy as np
from transformers import AutoTokenizer, GenerationConfig

from jaxpaged.block_manager import BlockManager
from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.detokenizer import IncrementalDetokenizer
from jaxpaged.model_runner import ModelRunner, num_kv_blocks
from jaxpaged.models import LlamaConfig, load_llama
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.pallas_kernels import resolve_attention_backend
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler import Scheduler
from jaxpaged.sequence import Sequence, completion_seed


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]

    params: SamplingParams
    metrics: RequestMetrics
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished and not s.num_forks for s in self.seqs)

    def output(self) -> RequestOutput:
        """The request's state; with best_of > n, finished outputs keep the n most likely."""
        pairs = sorted(zip(self.seqs, self.detokenizers), key=lambda sd: sd[0].index)
        finished = self.finished
        if finished and len(pairs) > self.params.n:
            pairs = sorted(pairs, key=lambda sd: -sd[0].cumulative_logprob)[:self.params.n]
        completions = []
        for index, (s, d) in enumerate(pairs):
            text = d.text if s.is_finished else d.text[:len(d.text) - _held_back(d.text, s)]
            completions.append(CompletionOutput(
                index if finished else s.index, text, s.output_token_ids, s.cumulative_logprob,
                s.logprobs, s.finish_reason, s.stop_reason))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished, self.prompt_logprobs, self.metrics,
                             self.seqs[0].num_cached_tokens or 0)


def _held_back(text: str, seq: Sequence) -> int:
    """Length of the longest suffix of `text` that could still begin a stop string."""
    longest = 0
    for stop in seq.params.stop:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def resolve_dtype(dtype: str) -> jnp.dtype:
    """"auto" is float32 on CPU and bfloat16 on accelerators; else a jnp dtype name."""
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto', 'float32', "
                         "'bfloat16' or 'float16'")
    return jnp.dtype(dtype)


class LLMEngine:
    """Holds the tokenizer, scheduler, block manager and model runner of one model.

    Raises:
      ValueError: a config value is out of range, or the pool cannot hold one sequence of
        `max_model_len` tokens.
    """

    def __init__(self, model_dir: Path, *, dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 cache_config: CacheConfig = CacheConfig(), attention_backend: str = "auto",
                 seed: int = 0, precompile: bool | str = False):
        if precompile not in (True, False, "auto"):
            raise ValueError(f"precompile must be True, False or 'auto', got {precompile!r}")
        self.attention_backend = resolve_attention_backend(attention_backend)
        self.model_config = LlamaConfig.from_pretrained(model_dir)
        self.dtype = resolve_dtype(dtype)
        self.scheduler_config = SchedulerConfig(
            max_model_len=max_model_len or self.model_config.max_position_embeddings,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self.cache_config = cache_config
        num_blocks = num_kv_blocks(self.model_config, cache_config, self.dtype)
        if num_blocks * cache_config.block_size < self.scheduler_config.max_model_len:
            raise ValueError(
                f"the KV pool holds {num_blocks} blocks of {cache_config.block_size} tokens, "
                f"fewer than max_model_len={self.scheduler_config.max_model_len}: raise "
                "num_kv_blocks / kv_cache_memory_bytes or lower max_model_len")

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_ids = self._eos_token_ids(model_dir)
        self.block_manager = BlockManager(num_blocks, cache_config.block_size,
                                          cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        model = load_llama(model_dir, self.model_config, self.dtype, self.attention_backend)
        self.runner = ModelRunner(model, cache_config, num_blocks, self.dtype,
                                  self.eos_token_ids, self.scheduler_config.max_num_seqs,
                                  self.scheduler_config.max_model_len)
        if precompile is True or (precompile == "auto" and self.runner.packed):
            sc = self.scheduler_config
            self.runner.precompile(self.runner.bucket_shapes(
                sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len))
        self.requests: dict[str, _Request] = {}
        self._seed_rng = np.random.default_rng(seed)  # seeds of requests that give none
        self._request_ids = itertools.count()
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputes included)
        self.num_generation_tokens = 0  # tokens sampled

    def _eos_token_ids(self, model_dir: Path) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if (model_dir / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests ---------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or as `{"prompt_token_ids": [...]}`.

        Raises:
          ValueError: the prompt is empty, of the wrong type, has out-of-vocabulary ids, or
            leaves no room for output under `max_model_len`.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids {bad[:8]} are not ids in [0, {vocab})")
            ids = [int(t) for t in ids]
        else:
            raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids', "
                             f"got {type(prompt).__name__}: {prompt!r:.80}")
        if not ids:
            raise ValueError(f"prompt {prompt!r:.80} has no tokens")
        max_len = self.scheduler_config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room for output "
                             f"under max_model_len={max_len}")
        return text, ids

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> tuple[str, list[int]]:
        """(text, token ids) of a conversation rendered with the model's chat template.

        The template adds the special tokens, so the text is tokenized without adding more.

        Raises:
          ValueError: the conversation is empty or the template rejects it (for example
            `continue_final_message` with `add_generation_prompt`, or a role it does not know).
        """
        if not messages:
            raise ValueError("messages is empty: give at least one message")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    def add_request(self, prompt: str | dict, params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queues a prompt; returns its request id. Validates before queueing anything."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {params!r:.80}")
        bad_ids = params.token_ids_out_of_vocab(self.model_config.vocab_size)
        if bad_ids:
            raise ValueError(f"token ids {bad_ids[:8]} in stop_token_ids / logit_bias / "
                             f"allowed_token_ids are not below vocab_size="
                             f"{self.model_config.vocab_size}")
        text, ids = self.tokenize_prompt(prompt)
        budget = self.scheduler_config.max_num_batched_tokens
        if params.prompt_logprobs is not None and len(ids) > budget:
            raise ValueError(f"prompt_logprobs needs the whole prompt in one step: the prompt "
                             f"has {len(ids)} tokens, max_num_batched_tokens={budget}")
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**63))
        # One sequence is prefilled; it forks into the n completions right after (block sharing).
        seq = Sequence(request_id, 0, ids, params, seed)
        seq.num_forks = (params.best_of or params.n) - 1
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self.requests[request_id] = _Request(request_id, text, ids, [seq], [detok], params,
                                             RequestMetrics(arrival_time=time.time()))
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Drops a request and frees its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of the requests it advanced.

        Finished requests are returned once with `finished=True` and then forgotten.
        """
        out = self.scheduler.schedule()
        if out is None or not out.seqs:
            return []
        now = time.time()
        for seq in out.seqs:
            m = self.requests[seq.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        sampled, prompt_lps = self.runner.execute(out)
        now = time.time()
        touched = {}
        for row, (seq, q, row_samples) in enumerate(zip(out.seqs, out.num_scheduled_tokens,
                                                        sampled)):
            self.num_prompt_tokens += max(0, min(seq.num_computed_tokens + q,
                                                 seq.num_prompt_tokens) - seq.num_computed_tokens)
            seq.num_computed_tokens += q
            self.block_manager.cache_full_blocks(seq)
            self.num_generation_tokens += len(row_samples)
            request = self.requests[seq.request_id]
            if row in prompt_lps and request.prompt_logprobs is None:
                request.prompt_logprobs = self._prompt_logprob_dicts(request, prompt_lps[row])
            if not row_samples:  # a prompt chunk with more to come: nothing sampled yet
                continue
            request.metrics.first_token_time = request.metrics.first_token_time or now
            # Fork before anything is appended or finished: children copy the parent as it was.
            targets = [seq] + [self._fork(request, seq, j) for j in range(1, len(row_samples))]
            seq.num_forks = 0
            for target, token in zip(targets, row_samples):
                self._append_token(target, token, request.detokenizers[target.index])
            touched[seq.request_id] = request
        outputs = []
        for request_id, request in touched.items():
            if request.finished:
                request.metrics.finished_time = time.time()
            outputs.append(request.output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _prompt_logprob_dicts(self, request: _Request, rows: list) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {id: Logprob} per token."""
        return [None] + [self._logprob_entry(token_id, lp, rank, top) for token_id, (lp, rank, top)
                         in zip(request.prompt_token_ids[1:], rows)]

    def _logprob_entry(self, token_id: int, logprob: float, rank: int,
                       top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """{id: Logprob} for the top-k tokens (ranks 1..k) and the chosen token."""
        entry = {t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(top)}
        entry[token_id] = Logprob(logprob, rank)
        for t, lp in entry.items():
            lp.decoded_token = self.tokenizer.decode([t])
        return entry

    def _fork(self, request: _Request, parent: Sequence, j: int) -> Sequence:
        """The j-th completion, sharing the parent's prompt blocks; seeded `seed + j`."""
        child = parent.fork(index=j, seed=completion_seed(parent.seed, j))
        self.scheduler.fork(parent, child)
        request.seqs.append(child)
        request.detokenizers.append(IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, parent.params.skip_special_tokens))
        return child

    def _append_token(self, seq: Sequence, sampled, detok: IncrementalDetokenizer) -> None:
        """Appends a sampled token: ids, log-probabilities, text, then the stop checks."""
        token_id, p = sampled.token_id, seq.params
        seq.token_ids.append(token_id)
        seq.cumulative_logprob += sampled.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(token_id, sampled.logprob, sampled.rank,
                                                    sampled.top))
        delta = detok.add_token(token_id)
        may_stop = seq.num_output_tokens >= p.min_tokens
        stop = self._find_stop_string(detok, len(delta), p) if may_stop and p.stop else None
        if stop is not None:
            self.scheduler.finish(seq, "stop", stop_reason=stop)
        elif may_stop and not p.ignore_eos and token_id in self.eos_token_ids:
            self.scheduler.finish(seq, "stop")
        elif may_stop and token_id in p.stop_token_ids:
            self.scheduler.finish(seq, "stop", stop_reason=token_id)
        elif (seq.num_output_tokens == p.max_tokens
              or seq.num_tokens >= self.scheduler_config.max_model_len):
            self.scheduler.finish(seq, "length")

    @staticmethod
    def _find_stop_string(detok: IncrementalDetokenizer, num_new_chars: int,
                          p: SamplingParams) -> str | None:
        """The earliest stop string in the text that the newest characters complete; truncates
        the text there (keeping the string if `include_stop_str_in_output`)."""
        text = detok.text
        found = None
        for stop in p.stop:
            i = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if i >= 0 and (found is None or i < found[0]):
                found = (i, stop)
        if found is None:
            return None
        i, stop = found
        detok.text = text[:i + len(stop)] if p.include_stop_str_in_output else text[:i]
        return stop

    def stats(self) -> dict[str, int]:
        """Block and queue counts: num_total_blocks, num_free_blocks, num_used_blocks,
        num_shared_blocks, num_cow_copies, num_running, num_waiting (sequences),
        num_running_requests, num_waiting_requests (requests with a running sequence / with
        all sequences waiting), and the running totals num_preemptions, num_prompt_tokens,
        num_generation_tokens, num_prefix_cache_queries / num_prefix_cache_hits (full prompt
        blocks looked up in / found in the prefix cache); num_compilations (shapes the model step
        is compiled for)."""
        bm, scheduler = self.block_manager, self.scheduler
        running_requests = {s.request_id for s in scheduler.running}
        waiting_requests = {s.request_id for s in scheduler.waiting} - running_requests
        return {
            "num_total_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
            "num_shared_blocks": bm.num_shared_blocks,
            "num_cow_copies": bm.num_cow_copies,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_running_requests": len(running_requests),
            "num_waiting_requests": len(waiting_requests),
            "num_preemptions": scheduler.num_preemptions,
            "num_prefix_cache_queries": bm.num_cache_queries,
            "num_prefix_cache_hits": bm.num_cache_hits,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_compilations": self.runner.num_compilations,
        }
