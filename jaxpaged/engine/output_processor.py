"""Output processing: the host side of a step's sampled tokens (vLLM v1's `OutputProcessor`):
log-probability dicts, incremental detokenization, stop strings, the completions a prompt forked
into, and the request's metrics. What a request reports is then `Request.output()`."""

from __future__ import annotations

from jaxpaged.core.sequence import Sequence
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.request import Request, new_stop_state
from jaxpaged.engine.stop_strings import StopStringState
from jaxpaged.outputs import Logprob
from jaxpaged.sampling_params import SamplingParams


class OutputProcessor:
    """Turns sampled tokens into a request's text, logprobs and finish state.

    Args:
      tokenizer: the model's tokenizer (decodes tokens and log-probability entries).
      finish: `Scheduler.finish(seq, reason, stop_reason=...)`, which ends a sequence that a
        stop string completes and frees its blocks.
    """

    def __init__(self, tokenizer, finish):
        self.tokenizer = tokenizer
        self.finish = finish
        self.num_generation_tokens = 0  # tokens sampled, over the engine's life
        self._token_texts: dict[int, str] = {}

    def advance(self, request: Request, appended: list, now: float) -> None:
        """The host side of a row's new tokens, which the scheduler has appended (and finished
        where a token id or a length ends them): registers the completions the row forked
        into, then for each token its log-probabilities, its text and the stop strings. A row
        that verified speculative tokens appends several tokens to one sequence; those after a
        stop string are taken back.

        Args:
          appended: (sequence, sampled token) pairs of the row, in order.
          now: the step's end, in seconds since the epoch (the first token's time).
        """
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        first = appended[0][0]
        if (len(appended) == 1 and first.logprobs is None
                and request.stop_states[first.index] is None):
            # One token, no logprobs, no stop strings (most rows): its text only.
            request.detokenizers[first.index].add_token(appended[0][1].token_id)
            self.num_generation_tokens += 1
            self._book_metrics(request, first)
            return
        for seq, _ in appended[1:]:  # completions forked from the first (n > 1)
            if seq is not first:
                request.seqs.append(seq)
                request.detokenizers.append(IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, seq.params.skip_special_tokens))
                request.stop_states.append(new_stop_state(seq.params))
        for i, (seq, token) in enumerate(appended):
            self._add_text(seq, token, request.detokenizers[seq.index],
                           request.stop_states[seq.index])
            self.num_generation_tokens += 1
            if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
                later = [t for s, t in appended[i + 1:] if s is seq]
                if later:  # a stop string ended it before its last speculative token
                    del seq.token_ids[-len(later):]
                    seq.cumulative_logprob -= sum(t.logprob for t in later)
                    break
        self._book_metrics(request, first)

    @staticmethod
    def _book_metrics(request: Request, first: Sequence) -> None:
        m = request.metrics
        m.num_generation_tokens = max(m.num_generation_tokens, first.num_output_tokens)
        if first.spec_num_drafts:
            m.spec_num_drafts = sum(s.spec_num_drafts for s in request.seqs)
            m.spec_num_draft_tokens = sum(s.spec_num_draft_tokens for s in request.seqs)
            m.spec_num_accepted_tokens = sum(s.spec_num_accepted_tokens for s in request.seqs)

    def prompt_logprob_dicts(self, request: Request, rows: list) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {id: Logprob} per token."""
        return [None] + [self.logprob_entry(token_id, lp, rank, top) for token_id, (lp, rank, top)
                         in zip(request.prompt_token_ids[1:], rows)]

    def logprob_entry(self, token_id: int, logprob: float, rank: int,
                      top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """{id: Logprob} for the top-k tokens (ranks 1..k) and the chosen token."""
        entry = {t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(top)}
        entry[token_id] = Logprob(logprob, rank)
        for t, lp in entry.items():
            lp.decoded_token = self._token_text(t)
        return entry

    def _token_text(self, token_id: int) -> str:
        """One token's text, decoded once per engine (top log-probabilities name many)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _add_text(self, seq: Sequence, sampled, detok: IncrementalDetokenizer,
                  stop_state: StopStringState | None) -> None:
        """A new token's log-probabilities and text; finishes `seq` at a stop string (which
        takes precedence over an EOS, stop token or length that ends it at the same token)."""
        token_id, p = sampled.token_id, seq.params
        if seq.logprobs is not None:
            seq.logprobs.append(self.logprob_entry(token_id, sampled.logprob, sampled.rank,
                                                   sampled.top))
        delta = detok.add_token(token_id)
        found = None if stop_state is None else stop_state.feed(delta, len(detok.text))
        if not found or seq.num_output_tokens < p.min_tokens:
            return
        stop = self._cut_at_stop_string(detok, found, p)
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            self.finish(seq, "stop", stop_reason=stop)

    @staticmethod
    def _cut_at_stop_string(detok: IncrementalDetokenizer, found: tuple[int, int],
                            p: SamplingParams) -> str:
        """Truncates the text at the stop string `found` = (start, length) that the newest
        characters complete (keeping it if `include_stop_str_in_output`); returns it."""
        start, length = found
        stop = detok.text[start:start + length]
        detok.text = detok.text[:start + (length if p.include_stop_str_in_output else 0)]
        return stop
