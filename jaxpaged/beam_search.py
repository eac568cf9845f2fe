"""Beam search over the paged engine, with beams sharing KV blocks.

Follows transformers' `GenerationMixin._beam_search` (v5, `early_stopping=False`) step for step, so
the best sequence and its score match `generate(num_beams=W, do_sample=False)`: each step keeps
the top `K = (1 + #eos) * W` continuations of all beams by accumulated log-probability; the top W
of them that end (EOS, or `max_tokens` reached) enter the finished pool scored
`sum_logprobs / generated_len ** length_penalty`; the best W that do not end become the next
beams. Search stops when no running beam can beat the worst of W finished ones.

Memory sharing (PagedAttention section 4.4): a beam that several continuations extend is forked,
so they share its blocks by reference count (copy-on-write on the partly filled block); a beam no
continuation extends is freed at once.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxpaged.sequence import Sequence


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
class _Beam:
    seq: Sequence
    score: float  # accumulated log-probability


def beam_search(engine, prompt_token_ids: list[int], params: BeamSearchParams,
                on_step=None) -> BeamSearchOutput:
    """Runs one prompt's beam search on an idle `LLMEngine`; returns the W best sequences.

    `on_step(engine)` is called after each step (tests use it to watch block usage).
    """
    W, P = params.beam_width, len(prompt_token_ids)
    eos = set() if params.ignore_eos else engine.eos_token_ids
    K = max(2, 1 + len(eos)) * W
    if K > MAX_LOGPROBS:
        raise ValueError(f"beam_width={W} needs {K} candidates per beam, more than {MAX_LOGPROBS}")
    sp = SamplingParams(temperature=0, logprobs=K, max_tokens=params.max_tokens, ignore_eos=True)
    scheduler, runner = engine.scheduler, engine.runner
    root = Sequence("beam-search", 0, prompt_token_ids, sp, seed=0)
    scheduler.add(root)
    beams = [_Beam(root, 0.0)]
    finished: list[tuple[float, float, list[int]]] = []  # (score, cum_logprob, tokens)
    improvable = True
    try:
        while beams:
            out = scheduler.schedule()
            sampled, _ = runner.execute(out)
            scheduler.update_from_output(out)
            row_of = {id(s): r for r, s in enumerate(out.seqs)}
            if not sampled[0]:  # a chunk of a prompt longer than the step's token budget
                continue
            generated = beams[0].seq.num_output_tokens + 1  # length after this step
            candidates = []  # (accumulated logprob, beam index, token, ends)
            for b, beam in enumerate(beams):
                for token, lp in sampled[row_of[id(beam.seq)]][0].top:
                    candidates.append((beam.score + lp, b, token))
            candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
            candidates = [(acc, b, t, t in eos or generated == params.max_tokens)
                          for acc, b, t in candidates[:K]]
            if improvable:
                for acc, b, t, ends in candidates[:W]:
                    if ends:
                        tokens = beams[b].seq.token_ids + [t]
                        finished.append((acc / generated ** params.length_penalty, acc, tokens))
                finished = sorted(finished, key=lambda f: -f[0])[:W]
            beams = _next_beams(scheduler, beams, [c for c in candidates if not c[3]][:W])
            if on_step is not None:
                on_step(engine)
            if beams and len(finished) == W:
                improvable = beams[0].score / generated ** params.length_penalty > finished[-1][0]
            if not improvable or all(c[3] for c in candidates):
                break
    finally:
        for beam in beams:
            scheduler.finish(beam.seq, "abort")
    tokenizer = engine.tokenizer
    return BeamSearchOutput([
        BeamSearchSequence(tokens, cum, score,
                           tokenizer.decode(tokens[P:], skip_special_tokens=True))
        for score, cum, tokens in finished])


def _next_beams(scheduler, beams: list[_Beam], chosen) -> list[_Beam]:
    """Extends the chosen (acc, beam, token) continuations: a beam's first continuation reuses
    its sequence, later ones fork it (sharing blocks); beams nobody extends are freed."""
    extended: set[int] = set()  # beams whose own sequence is already taken
    next_beams = []
    for acc, b, token, _ in chosen:  # fork first: children copy the beam as it was
        seq = beams[b].seq
        if b in extended:
            seq = seq.fork(index=0, seed=0)
            scheduler.fork(beams[b].seq, seq)
        extended.add(b)
        next_beams.append((seq, acc, token))
    for b, beam in enumerate(beams):
        if b not in extended:
            scheduler.finish(beam.seq, "abort")
    for seq, _, token in next_beams:
        seq.token_ids.append(token)
    return [_Beam(seq, acc) for seq, acc, _ in next_beams]
