"""A request inside the engine, and the `RequestOutput` it reports each step."""

from __future__ import annotations

import dataclasses

from jaxpaged.detokenizer import IncrementalDetokenizer
from jaxpaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import Sequence
from jaxpaged.stop_strings import StopStringState


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

    @property
    def finished(self) -> bool:
        return all(s.is_finished and not s.num_forks for s in self.seqs)

    def output(self) -> RequestOutput:
        """The request's state; with best_of > n, finished outputs keep the n most likely."""
        triples = sorted(zip(self.seqs, self.detokenizers, self.stop_states),
                         key=lambda sdh: sdh[0].index)
        finished = self.finished
        if finished and len(triples) > self.params.n:
            triples = sorted(triples, key=lambda sdh: -sdh[0].cumulative_logprob)[:self.params.n]
        completions = []
        for index, (s, d, stop_state) in enumerate(triples):
            # Text that may still become a stop string is held back until it is decided.
            held = 0 if s.is_finished or stop_state is None else stop_state.num_held_back
            text = d.text[:len(d.text) - held]
            completions.append(CompletionOutput(
                index if finished else s.index, text, s.output_token_ids, s.cumulative_logprob,
                s.logprobs, s.finish_reason, s.stop_reason))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished, self.prompt_logprobs, self.metrics,
                             self.seqs[0].num_cached_tokens or 0, self.error)


def new_stop_state(params: SamplingParams) -> StopStringState | None:
    """A completion's start in its request's stop-string automaton (None without stops)."""
    return None if params.stop_strings is None else StopStringState(params.stop_strings)
