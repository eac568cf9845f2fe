"""Request processing: a prompt and its sampling params checked and turned into a `Request`
whose first `Sequence` the scheduler can take (vLLM v1's `Processor`).

Everything a request is refused for is found here, before anything is queued: a bad prompt,
ids past the vocabulary, more completions than can run at once, prompt logprobs over a prompt
that does not fit one step, a request id in use, a bad priority, an invalid constraint.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time

import numpy as np

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.sequence import Sequence
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.input_processor import InputProcessor
from jaxpaged.engine.request import Request, new_stop_state
from jaxpaged.core.request_queue import REQUEST_QUEUES
from jaxpaged.errors import InvalidRequestError
from jaxpaged.outputs import RequestMetrics
from jaxpaged.reasoning import get_reasoning_parser
from jaxpaged.sample.structured_outputs import GrammarCompiler, ReasoningGate
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestProcessor:
    """Tokenizes, validates and admits requests for one engine.

    Args:
      tokenizer: the model's Hugging Face tokenizer.
      vocab_size: the model's vocabulary size (ids are in [0, vocab_size)).
      scheduler_config: the limits a request must fit (`max_model_len`, `max_num_seqs`,
        `max_num_batched_tokens`, the scheduling policy).
      reasoning_parser: a name of `jaxpaged.reasoning.REASONING_PARSERS` or None: with one,
        structured outputs constrain only the answer after the reasoning (`ReasoningGate`).
      seed: seeds the per-request seeds of requests that give none.
    """

    def __init__(self, tokenizer, vocab_size: int, scheduler_config: SchedulerConfig,
                 reasoning_parser: str | None = None, seed: int = 0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.scheduler_config = scheduler_config
        self.input_processor = InputProcessor(tokenizer, vocab_size,
                                              scheduler_config.max_model_len)
        self.reasoning = get_reasoning_parser(reasoning_parser)
        self.think_token_ids = (None if self.reasoning is None
                                else self.reasoning.think_token_ids(tokenizer))
        if self.reasoning is not None and self.think_token_ids is None:
            logger.warning("reasoning_parser %r: <think> or </think> is several tokens of this "
                           "tokenizer, so structured outputs cannot wait for the reasoning to "
                           "end; the server refuses them", reasoning_parser)
        self._seed_rng = np.random.default_rng(seed)
        self._request_ids = itertools.count()
        self._arrivals = itertools.count()  # arrival order, for the priority policy

    @functools.cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles and caches `structured_outputs` constraints for this model's tokenizer
        (thread-safe: the server compiles on its preprocessing threads)."""
        return GrammarCompiler(self.tokenizer, self.vocab_size)

    def check_seats(self, params: SamplingParams) -> None:
        """Raises `InvalidRequestError` if the request's completions cannot all run at once.

        A prompt forks into its `best_of` (or `n`) completions right after its prefill, and the
        scheduler admits it only once `max_num_seqs` has a seat for each: a request with more
        would wait at the head of the queue forever, and every request behind it too. (Its
        tokens always fit the KV pool: each sequence stops at `max_model_len`, and the pool holds
        at least that much, checked when the engine is built; forks that run out of blocks are
        preempted and recomputed.)
        """
        seats, limit = params.best_of or params.n, self.scheduler_config.max_num_seqs
        if seats > limit:
            field = "best_of" if params.best_of is not None else "n"
            raise InvalidRequestError(field, f"{field}={seats} completions cannot run at once: "
                                      f"this engine runs at most max_num_seqs={limit} sequences")

    def check_priority(self, priority) -> None:
        """Raises `InvalidRequestError` for a priority that is not an int, or not 0 under a
        policy that does not read it."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority", f"priority must be an int, got {priority!r}")
        policy = self.scheduler_config.scheduling_policy
        if priority != 0 and not REQUEST_QUEUES[policy].reads_priority:
            raise InvalidRequestError("priority", f"priority {priority} needs a scheduling policy "
                                      f"that reads it, such as 'priority' (this engine is "
                                      f"{policy!r})")

    def make_request(self, prompt: str | dict, params: SamplingParams, request_id: str | None,
                     priority: int, requests_in_use) -> Request:
        """A new `Request` of one sequence (it forks into its n completions after its
        prefill), validated as `LLMEngine.add_request` documents; `requests_in_use` holds the
        ids already taken."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {params!r:.80}")
        params.check_vocab(self.vocab_size)
        self.check_seats(params)
        text, ids = self.input_processor.tokenize_prompt(prompt)
        budget = self.scheduler_config.max_num_batched_tokens
        if params.prompt_logprobs is not None and len(ids) > budget:
            raise InvalidRequestError(
                "prompt_logprobs", f"prompt_logprobs needs the whole prompt in one step: the "
                f"prompt has {len(ids)} tokens, max_num_batched_tokens={budget}")
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in requests_in_use:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**63))
        seq = Sequence(request_id, 0, ids, params, seed)
        seq.priority, seq.arrival = priority, next(self._arrivals)
        if params.structured_outputs is not None:
            seq.matcher = self.grammar_compiler.matcher(params.structured_outputs)
            if self.think_token_ids is not None:
                seq.matcher = ReasoningGate.for_prompt(
                    seq.matcher, ids, self.think_token_ids,
                    starts_inside=self.reasoning.starts_inside)
        seq.num_forks = (params.best_of or params.n) - 1
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return Request(request_id, text, ids, [seq], [detok], [new_stop_state(params)], params,
                       RequestMetrics(arrival_time=time.time()))

    def scoring_prompt(self, prompt_token_ids, completion_token_ids) -> tuple[list[int], int]:
        """(token ids, index of the first scored one) of a completion to score after a prompt
        (`LLM.completion_logprobs`), validated.

        Raises:
          InvalidRequestError (a ValueError): an empty prompt, token ids outside the
            vocabulary, or prompt and completion together not under `max_model_len`.
        """
        vocab = self.vocab_size
        rows = {}
        for field, ids in (("prompt_token_ids", prompt_token_ids),
                           ("completion_token_ids", completion_token_ids)):
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__len__"):
                raise InvalidRequestError(field, f"{field} must be a list of token ids, got "
                                          f"{type(ids).__name__}: {ids!r:.80}")
            ids = rows[field] = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(field, f"{field} {bad[:8]} are not ids in [0, {vocab})")
        prompt_token_ids, completion_token_ids = rows.values()
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("prompt_token_ids", "prompt_token_ids is empty: the first "
                                      "completion token needs a token before it")
        start = len(prompt_token_ids)
        ids = list(prompt_token_ids) + list(completion_token_ids)
        limit = self.scheduler_config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                "completion_token_ids", f"{start} prompt and {len(ids) - start} completion "
                f"tokens: together they must be fewer than max_model_len={limit}")
        return [int(t) for t in ids], start
