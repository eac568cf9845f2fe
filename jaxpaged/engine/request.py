"""A request inside the engine, and the `RequestOutput` it reports each step.

What an output holds follows `SamplingParams.output_kind`. With DELTA each completion carries
only the token ids, logprobs and text that are new since the request's previous output, so the
host work of a step per request is bounded by the tokens it added, however long the output
grows; CUMULATIVE copies the whole output each time, and FINAL_ONLY reports once, at the end.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.core.sequence import Sequence
from jaxpaged.engine.stop_strings import StopStringState
from jaxpaged.worker.routed_experts import routes_of


@dataclasses.dataclass
class Request:
    """One request in the engine: its completions (one sequence each), their detokenizers and
    stop-string states, and what `output()` reports of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    stop_states: list[StopStringState | None]  # per completion, when the request has stops

    params: SamplingParams
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    error: str | None = None  # the step fault that failed the request
    # DELTA: (output tokens, text characters) of each completion (by `Sequence.index`) already
    # reported, and whether the prompt's part (prompt_logprobs) was.
    sent: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    sent_prompt: bool = False
    sent_routes: dict[int, int] = dataclasses.field(default_factory=dict)  # rows, by index

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:  # most requests (n = 1): no generator
            seq = self.seqs[0]
            return seq.is_finished and not seq.num_forks
        return all(s.is_finished and not s.num_forks for s in self.seqs)

    def output(self) -> RequestOutput | None:
        """The request's output for this step, as `params.output_kind` asks: None for
        FINAL_ONLY while unfinished. With best_of > n, a finished output keeps the n most
        likely completions (not allowed with DELTA). A DELTA output advances what was sent."""
        kind = self.params.output_kind
        finished = self.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        triples = list(zip(self.seqs, self.detokenizers, self.stop_states))
        if len(triples) > 1:
            triples.sort(key=lambda sdh: sdh[0].index)
        if finished and len(triples) > self.params.n:
            triples = sorted(triples, key=lambda sdh: -sdh[0].cumulative_logprob)[:self.params.n]
        completions = []
        for index, (s, d, stop_state) in enumerate(triples):
            # Text that may still become a stop string is held back until it is decided.
            held = 0 if s.is_finished or stop_state is None else stop_state.num_held_back
            end = len(d.text) - held
            routes = routes_of(s)
            if kind is RequestOutputKind.DELTA:
                if routes is not None:
                    rows = self.sent_routes.get(s.index, 0)
                    self.sent_routes[s.index] = len(routes)
                    routes = routes[rows:]
                tokens, chars = self.sent.get(s.index, (0, 0))
                first = s.num_prompt_tokens + tokens
                token_ids, text = s.token_ids[first:], d.text[chars:end]
                logprobs = None if s.logprobs is None else s.logprobs[tokens:]
                self.sent[s.index] = (s.num_output_tokens, max(chars, end))
            else:  # copies: an earlier output must not change as the request goes on
                token_ids, text = s.output_token_ids, d.text[:end]
                logprobs = None if s.logprobs is None else s.logprobs[:]
            completions.append(CompletionOutput(
                index if finished else s.index, text, token_ids, s.cumulative_logprob,
                logprobs, s.finish_reason, s.stop_reason, routes))
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self.sent_prompt else prompt_logprobs
            self.sent_prompt = self.sent_prompt or prompt_logprobs is not None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished, prompt_logprobs, self.metrics,
                             self.seqs[0].num_cached_tokens or 0, self.error)


def new_stop_state(params: SamplingParams) -> StopStringState | None:
    """A completion's start in its request's stop-string automaton (None without stops)."""
    return None if params.stop_strings is None else StopStringState(params.stop_strings)
