"""Beam search over the paged engine, with beams sharing KV blocks.

Follows transformers' `GenerationMixin._beam_search` (v5, `early_stopping=False`) step for step, so
the best sequence and its score match `generate(num_beams=W, do_sample=False)`: each step keeps
the top `K = (1 + #eos) * W` continuations of all beams by accumulated log-probability; the top W
of them that end (EOS, or `max_tokens` reached) enter the finished pool scored
`sum_logprobs / generated_len ** length_penalty`; the best W that do not end become the next
beams. Search stops when no running beam can beat the worst of W finished ones.

Built on the engine's public API, as vLLM builds beam search on `generate`: each round adds one
request per beam (its tokens as the prompt, one greedy token with the top K log-probabilities)
for every prompt still searching, steps the engine until they finish, and extends the beams from
their candidates. The beams of all prompts run in the same steps. Beams share their common
prefix through prefix caching: a round's requests find the full blocks of the tokens before it in
the cache (shared by reference count), and compute only the partly filled last block again.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0  # exponent of the generated length dividing the score
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"BeamSearchParams.beam_width must be an int in "
                             f"[1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an int >= 1, "
                             f"got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != \
                self.length_penalty:
            raise ValueError(f"BeamSearchParams.length_penalty must be a number, "
                             f"got {self.length_penalty!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and generated ids
    cum_logprob: float  # sum of the generated tokens' log-probabilities
    score: float  # cum_logprob / generated_len ** length_penalty
    text: str | None = None  # the generated text


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclasses.dataclass
class _Search:
    """One prompt's search: its running beams (tokens, accumulated log-probability) and the
    finished pool of (score, cum_logprob, tokens), best first."""

    beams: list[tuple[list[int], float]]
    finished: list[tuple[float, float, list[int]]] = dataclasses.field(default_factory=list)
    improvable: bool = True


def beam_search(engine, prompts: list[list[int]], params: BeamSearchParams,
                on_step=None, lora_request=None) -> list[BeamSearchOutput]:
    """Runs beam search for each prompt (token ids) on an `LLMEngine`, all prompts' beams
    batched in the same steps; returns the W best sequences of each.

    `on_step(engine)` is called after each engine step (tests use it to watch block usage);
    `lora_request`: the adapter every beam runs under (`LLMEngine.add_request`).

    Raises:
      ValueError: a beam width whose K = (1 + number of EOS ids) * W candidates exceed the
        log-probabilities a request may ask for; what `add_request` raises for a beam.
    """
    W = params.beam_width
    eos = set() if params.ignore_eos else engine.eos_token_ids
    K = max(2, 1 + len(eos)) * W
    if K > MAX_LOGPROBS:
        raise ValueError(f"beam_width={W} needs {K} candidates per beam, more than {MAX_LOGPROBS}")
    sp = SamplingParams(temperature=0, logprobs=K, max_tokens=1, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    searches = [_Search([(list(ids), 0.0)]) for ids in prompts]
    generated = 0  # tokens generated so far (the same for every beam)
    while any(s.beams for s in searches):
        generated += 1
        candidates = _run_round(engine, searches, sp, on_step, lora_request)
        for search, cands in zip(searches, candidates):
            if search.beams:
                _extend(search, cands, generated, K, eos, params)
    tokenizer = engine.tokenizer
    return [BeamSearchOutput([
        BeamSearchSequence(tokens, cum, score,
                           tokenizer.decode(tokens[len(ids):], skip_special_tokens=True))
        for score, cum, tokens in search.finished]) for ids, search in zip(prompts, searches)]


def _run_round(engine, searches: list[_Search], sp: SamplingParams, on_step, lora_request
               ) -> list[list[tuple[float, int, int]]]:
    """One request per running beam through the engine; each search's candidates
    (accumulated log-probability, beam, token) from its beams' top-K next tokens."""
    beam_of: dict[str, tuple[int, int]] = {}
    try:
        for i, search in enumerate(searches):
            for b, (tokens, _) in enumerate(search.beams):
                beam_of[engine.add_request({"prompt_token_ids": tokens}, sp,
                                           lora_request=lora_request)] = (i, b)
        candidates = [[] for _ in searches]
        pending = set(beam_of)
        while pending:
            for output in engine.step():
                if output.request_id not in pending:
                    continue
                if output.error is not None:
                    raise RuntimeError(f"a beam failed: {output.error}")
                pending.discard(output.request_id)
                i, b = beam_of[output.request_id]
                acc = searches[i].beams[b][1]
                top = output.outputs[0].logprobs[0]
                candidates[i] += [(acc + lp.logprob, b, t) for t, lp in top.items()]
            if on_step is not None:
                on_step(engine)
    finally:  # an interrupted round must not leave requests holding blocks
        for request_id in beam_of:
            engine.abort_request(request_id)
    return candidates


def _extend(search: _Search, candidates: list[tuple[float, int, int]], generated: int, K: int,
            eos: set[int], params: BeamSearchParams) -> None:
    """transformers' step: the top K continuations; those of the top W that end join the
    finished pool, the best W that do not are the next beams; stops when no running beam can
    beat the worst of W finished ones."""
    W = params.beam_width
    candidates = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[:K]
    candidates = [(acc, b, t, t in eos or generated == params.max_tokens)
                  for acc, b, t in candidates]
    if search.improvable:
        for acc, b, t, ends in candidates[:W]:
            if ends:
                tokens = search.beams[b][0] + [t]
                search.finished.append((acc / generated ** params.length_penalty, acc, tokens))
        search.finished = sorted(search.finished, key=lambda f: -f[0])[:W]
    search.beams = [(search.beams[b][0] + [t], acc)
                    for acc, b, t, ends in candidates if not ends][:W]
    if search.beams and len(search.finished) == W:
        search.improvable = (search.beams[0][1] / generated ** params.length_penalty
                             > search.finished[-1][0])
    if not search.improvable or all(c[3] for c in candidates):
        search.beams = []
