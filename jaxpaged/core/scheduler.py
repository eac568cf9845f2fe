"""Continuous batching with chunked prefill: which sequences run in the next step, and how many
of their tokens.

Every step has a token budget, `max_num_batched_tokens`. Running sequences come first, in
admission order: one token for each that decodes, and the next chunk (as much as the budget
leaves) for each whose prompt is still being computed. Waiting sequences are then admitted in
arrival order while `max_num_seqs`, the budget and the free blocks allow; the prompt of the last
one admitted may be cut to the budget and finished in later steps (chunked prefill). So a long
prompt never stalls the running sequences: prefill chunks and decodes share each step.

A step that decodes caps its prompt tokens so that decodes keep a steady pace (vLLM's
`long_prefill_token_threshold` and `max_num_partial_prefills`, applied only while something
decodes): each prompt computes at most `long_prefill_token_threshold` tokens in it and at most
`max_num_partial_prefills` prompts compute. Inter-token latency then stays near the cost of a
decode step plus that many prompt tokens however long the queued prompts are. When the runner
pads a step's tokens to a bucket (`padded_tokens`; the packed layout), the capped prompt chunks
may also take the padding that the decodes and the threshold leave, since a step costs its padded
size: 31 decodes and a threshold of 128 pad to 192 tokens, so the prompt computes 161. A step
with no decodes uses the whole budget, so an idle engine starts a prompt as fast as before. A
prompt that wants prompt log-probabilities is computed in one piece, and is not capped.

A decoding sequence with speculative proposals (`seq.spec_token_ids`, set by the engine's
proposer before the step; `jaxpaged.spec_decode`) computes them after its last token, as far as
the budget and free blocks allow (proposals are dropped before anything is preempted for them);
`update_from_output` appends the tokens the runner accepted and gives back the rest's slots.

Multi-step decoding (`num_scheduler_steps` k > 1, vLLM's v0 name): when nothing waits, every
running sequence decodes, and each may take k more tokens with its draws made on the device
(`host_needs.MULTI_STEP`: plain greedy, no proposals), one step runs k decode steps in a
row (`SchedulerOutput.num_steps`), each feeding its greedy draws to the next, with slots booked
for all k tokens up front (vLLM's lookahead slots). The host schedules, dispatches and books
once per k tokens. `update_from_output` appends the k tokens in order and checks each, as a
verified speculative row's, dropping those after one that ends its sequence (stop strings,
checked by the engine, drop theirs there).

The scheduling policy (`scheduling_policy`) is the waiting queue's class
(`jaxpaged.core.request_queue`): it orders the waiting sequences and picks whom to preempt.
Under "fcfs", when a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted by recompute: its blocks are freed and it goes back to
the front of the waiting queue, keeping its generated tokens. Under "priority" (vLLM's), the
queue is ordered by a request's `priority` (lower first), then arrival; a waiting sequence that
finds no seat or no blocks preempts running ones of lower priority (latest arrival first among
equals), and a running sequence that needs a block preempts the lowest-priority one. Nothing
new is admitted in a step that preempts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Protocol

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request_queue import make_request_queue
from jaxpaged.config import SchedulerConfig
from jaxpaged.core.host_needs import MULTI_STEP, free_of
from jaxpaged.core.sequence import Sequence, SequenceStatus, completion_seed


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes; the model runner turns it into device arrays."""

    seqs: list[Sequence]  # in batch-row order
    num_scheduled_tokens: list[int]  # new tokens per row: a decode's 1, or a prompt chunk
    preempted: list[Sequence]  # sent back to waiting while building this step
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst)
    # Per row, the speculative tokens it verifies after its last token (`jaxpaged.spec_decode`;
    # counted in its `num_scheduled_tokens`), [] for most rows.
    spec_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    # Sequences finished since the last step that ran, and those preempted in steps that ran
    # nothing (their rows leave the runner's input batch; `preempted` holds this step's).
    finished_seq_ids: list[int] = dataclasses.field(default_factory=list)
    # Decode steps run in a row (multi-step decoding): each row computes one token in each, the
    # later ones the greedy draws of the one before; its slots are booked for all of them.
    num_steps: int = 1

    def completes(self, row: int) -> bool:
        """Whether row `row` computes up to its last token, so the step samples for it (a
        prompt chunk that leaves tokens for later steps does not)."""
        seq, spec = self.seqs[row], self.spec_tokens(row)
        return seq.num_computed_tokens + self.num_scheduled_tokens[row] - len(spec) \
            == seq.num_tokens

    def spec_tokens(self, row: int) -> list[int]:
        return self.spec_token_ids[row] if self.spec_token_ids else []


class Sampled(Protocol):
    """A token the runner sampled for a row (`sampler.SampledToken`)."""

    token_id: int
    logprob: float  # the model's log-probability of it


@dataclasses.dataclass
class StepUpdate:
    """What `Scheduler.update_from_output` did with a step."""

    num_prompt_tokens: int  # prompt tokens booked (recomputes included)
    # (row, [(sequence, its new token)]) for each row that sampled: the row's sequence and the
    # children it forked into (n > 1), in that order
    appended: list[tuple[int, list[tuple[Sequence, Sampled]]]]


def _is_decode(seq: Sequence) -> bool:
    """Whether `seq`'s next step computes one generated token (not a prompt or a recompute)."""
    return seq.num_tokens - seq.num_computed_tokens == 1 and seq.num_output_tokens > 0


class Scheduler:
    """Args:
      config: the batching limits and the prefill cap.
      block_manager: the KV pool's blocks.
      padded_tokens: the number of tokens a step of n tokens is padded to (the runner's
        `buckets.bucket` on the packed layout), or None when steps are not padded that way.
      eos_token_ids: the tokens that end a sequence (unless its `ignore_eos`).
      recompute_at: a length past which a sequence's earlier K/V no longer hold (longrope's
        switch), or None: a running sequence that reaches it is computed again from its start,
        as a preemption by recompute (transformers' Phi-3 drops its cache there too).
      admit: whether a waiting sequence may join the running ones now (LoRA slots), or None.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 padded_tokens: Callable[[int], int] | None = None,
                 eos_token_ids: Collection[int] = frozenset(),
                 recompute_at: int | None = None,
                 admit: Callable[[Sequence, list[Sequence]], bool] | None = None):
        self.config = config
        self.admit = admit
        self.recompute_at = recompute_at
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.padded_tokens = padded_tokens
        self.waiting = make_request_queue(config.scheduling_policy)
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        # Speculative decoding's totals: rows that verified proposals, tokens proposed, accepted.
        self.num_spec_drafts = self.num_spec_draft_tokens = self.num_spec_accepted_tokens = 0
        # Prompts the step being built may still compute while something decodes (None: no cap).
        self._prefills_left: int | None = None
        # Padding of the step being built that capped prompt chunks may still take.
        self._padding_left = 0
        self._finished_seq_ids: list[int] = []  # since the last `schedule`

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def _preempt_for_admission(self, out: SchedulerOutput) -> None:
        """While the first waiting sequence finds no seat or not enough free blocks for its
        prompt and the policy lets it preempt a running one (`admission_victim`), preempts
        that one (it is admitted in a later step: nothing new joins a step that preempts)."""
        while self.waiting and self.running:
            head, victim = self.waiting.peek(), self.waiting.admission_victim(self.running)
            if victim is None:
                return
            seats = sum(1 + s.num_forks for s in self.running)
            if (seats + 1 + head.num_forks <= self.config.max_num_seqs
                    and self.block_manager.num_blocks_needed(head.num_tokens)
                    <= self.block_manager.num_free_blocks):
                return
            self._preempt(victim)
            out.preempted.append(victim)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput | None:
        """The next step's batch, or None when nothing is waiting or running."""
        out = SchedulerOutput([], [], [], finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        num_decodes = sum(map(_is_decode, self.running))
        self._prefills_left = self.config.max_num_partial_prefills if num_decodes else None
        self._padding_left = 0
        threshold = self.config.long_prefill_token_threshold
        if num_decodes and threshold and self.padded_tokens is not None:
            capped = min(num_decodes + threshold * self.config.max_num_partial_prefills,
                         self.config.max_num_batched_tokens)
            self._padding_left = min(self.padded_tokens(capped),
                                     self.config.max_num_batched_tokens) - capped
        if self._schedule_multi_step(out):
            return out
        self._preempt_for_admission(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if not out.seqs:  # the runner never sees this step: the next one carries its leavers
            self._finished_seq_ids = out.finished_seq_ids + [s.seq_id for s in out.preempted]
        return out if out.seqs or out.preempted else None

    def _schedule_multi_step(self, out: SchedulerOutput) -> bool:
        """Schedules `num_scheduler_steps` decode steps of every running sequence, if nothing
        waits, each decodes, may (`host_needs.MULTI_STEP`), has room for that many tokens before
        `max_model_len`, and the free blocks hold all their slots; else changes nothing. (One
        that reaches `max_tokens` or a stop sooner drops its later draws.)"""
        k, running = self.config.num_scheduler_steps, self.running
        if (k == 1 or self.waiting or not running
                or len(running) > self.config.max_num_batched_tokens):
            return False
        for seq in running:  # a sequence that reaches max_tokens sooner drops its later draws
            if (not _is_decode(seq) or seq.spec_token_ids
                    or self.config.max_model_len - seq.num_tokens < k
                    or self._passes_recompute_length(seq) or not free_of(seq, MULTI_STEP)):
                return False
        bm = self.block_manager
        plans = [bm.append_plan(seq, k) for seq in running]
        if sum(missing + len(shared) for missing, shared in plans) > bm.num_free_blocks:
            return False
        for seq in running:  # each fits: the sum above bounds what they take together
            out.blocks_to_copy += bm.append_slots(seq, k)
        out.seqs, out.num_scheduled_tokens = list(running), [1] * len(running)
        out.spec_token_ids, out.num_steps = [[] for _ in running], k
        return True

    def _prefill_tokens(self, seq: Sequence, remaining: int, budget: int) -> int:
        """Prompt tokens `seq` computes this step (0: none), within the step's budget and,
        while something decodes, the prefill cap; counts it as one of the step's prefills."""
        q = min(remaining, budget)
        if self._prefills_left is None or seq.params.prompt_logprobs is not None:
            return q
        if self._prefills_left == 0:
            return 0
        self._prefills_left -= 1
        threshold = self.config.long_prefill_token_threshold
        if not threshold:
            return q
        q = min(q, threshold + self._padding_left)
        self._padding_left -= max(0, q - threshold)
        return q

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Adds each running sequence's next token (or prompt chunk); returns the budget left."""
        # Decodes not yet scheduled: each keeps one token of the budget and one free block
        # from the proposals of the sequences before it.
        decodes_left = sum(map(_is_decode, self.running))
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.length_capped:
                continue  # preempted earlier in this loop, or its last token is not known yet
            decoding = _is_decode(seq)
            decodes_left -= decoding
            if self.recompute_at is not None and self._passes_recompute_length(seq):
                self._preempt(seq)
                out.preempted.append(seq)
                continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            q = 1 if decoding else self._prefill_tokens(seq, remaining, budget)
            if q == 0:  # a prompt chunk held back by the prefill cap
                continue
            # Proposals (`jaxpaged.spec_decode`) ride along as far as the budget and the free
            # blocks allow once the later decodes have theirs; cut to fit, never a preemption.
            spec = []
            if seq.spec_token_ids:
                if decoding:
                    spec = seq.spec_token_ids[:max(0, budget - 1 - decodes_left)]
                seq.spec_token_ids = []
            while spec and not self._spec_fits(seq, len(spec), decodes_left):
                spec = spec[:-1]
            q += len(spec)
            while (copies := self.block_manager.try_append_slots(seq, q)) is None:
                victim = self.waiting.block_victim(self.running, out.seqs)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.blocks_to_copy += copies
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(q)
                out.spec_token_ids.append(spec)
                budget -= q
        return budget

    def _spec_fits(self, seq: Sequence, num_spec: int, decodes_left: int) -> bool:
        """Whether `seq`'s token and `num_spec` proposals fit in the free blocks with one block
        still free for each of the `decodes_left` decodes after it."""
        bm = self.block_manager
        if not bm.can_append(seq, 1 + num_spec):
            return False
        needed = max(0, bm.num_blocks_needed(seq.num_computed_tokens + 1 + num_spec)
                     - len(seq.block_table))
        return bm.num_free_blocks - needed >= decodes_left

    def _passes_recompute_length(self, seq: Sequence) -> bool:
        """Whether `seq` is about to decode its first token past `recompute_at`: its K/V in the
        pool were all computed at lengths up to it. (A recompute computes every token at the
        sequence's full length, and a prompt longer than it is computed so from the start.)"""
        return (self.recompute_at is not None and _is_decode(seq)
                and seq.num_tokens == self.recompute_at + 1)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admits waiting sequences in order while sequences, tokens and blocks allow."""
        # A parent holds seats for the children it forks once its prompt is computed.
        num_seats = sum(1 + s.num_forks for s in self.running)
        while (self.waiting and budget > 0 and self._prefills_left != 0
               and num_seats + 1 + self.waiting.peek().num_forks <= self.config.max_num_seqs):
            seq = self.waiting.peek()
            # Prompt log-probabilities are computed in one piece, never chunked (and never from
            # the prefix cache); a sequence preempted after its first token has them already,
            # and is chunked as any other (its prompt and output together may exceed any step's
            # budget).
            if (seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0
                    and seq.num_tokens > budget):
                break
            if self.admit is not None and not self.admit(seq, self.running):
                break
            # Sets num_computed_tokens past a cached prefix.
            if self.block_manager.allocate(seq) is None:
                break
            remaining = seq.num_tokens - seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.pop())
            num_seats += 1 + seq.num_forks
            q = self._prefill_tokens(seq, remaining, budget)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(q)
            out.spec_token_ids.append([])
            budget -= q

    def update_from_output(self, out: SchedulerOutput, sampled: list[list[Sampled]],
                           skip_request_ids: Collection[str] = frozenset()) -> StepUpdate:
        """Books a step that ran; the one place a sequence's progress is written.

        Each row's scheduled tokens are now computed (`num_computed_tokens`), and its blocks
        that became full join the prefix cache. A row that sampled (`sampled[row]`, one token
        per completion) forks into its other completions first (n > 1, after the prompt), then
        each gets its token appended and is finished when the token ends it: EOS (unless
        `ignore_eos`) or one of `stop_token_ids` once `min_tokens` are out, `max_tokens`, or
        `max_model_len`, or a structured output's grammar completed (its matcher advances on
        each token here); stop strings need the text, so the engine checks those. Rows of
        `skip_request_ids` (requests a fault in the step was traced to, whose K/V cannot be
        trusted) are left as they were.
        """
        num_prompt_tokens, appended = 0, []
        specs = out.spec_token_ids
        for row, (seq, q) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            if skip_request_ids and seq.request_id in skip_request_ids:
                continue
            if out.num_steps > 1:
                appended.append((row, self._append_steps(seq, sampled[row])))
                continue
            spec = specs[row] if specs else None
            if spec:
                appended.append((row, self._append_verified(seq, spec, sampled[row])))
                continue
            num_prompt_tokens += max(0, min(seq.num_computed_tokens + q, seq.num_prompt_tokens)
                                     - seq.num_computed_tokens)
            seq.num_computed_tokens += q
            self.block_manager.cache_full_blocks(seq)
            tokens = sampled[row]
            if not tokens:  # a prompt chunk with more to come
                continue
            if len(tokens) == 1 and not seq.num_forks:  # one completion: most rows
                self._append(seq, tokens[0])
                appended.append((row, [(seq, tokens[0])]))
                continue
            # Fork before anything is appended or finished: children copy the parent as it was.
            targets = [seq] + [self._fork_completion(seq, j) for j in range(1, len(sampled[row]))]
            seq.num_forks = 0
            for target, token in zip(targets, sampled[row]):
                self._append(target, token)
            appended.append((row, list(zip(targets, sampled[row]))))
        return StepUpdate(num_prompt_tokens, appended)

    def _append_verified(self, seq: Sequence, spec: list[int], tokens: list[Sampled]
                         ) -> list[tuple[Sequence, Sampled]]:
        """Books a decode row that verified proposals `spec`: `tokens` are the accepted ones and
        the target's draw after them (`ModelRunner.execute`). Each is appended and checked as a
        sampled token, up to one that ends the sequence; the slots past its tokens are given
        back. Returns (seq, token) for each token appended."""
        accepted = len(tokens) - 1
        seq.spec_num_drafts += 1
        seq.spec_num_draft_tokens += len(spec)
        seq.spec_num_accepted_tokens += accepted
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += len(spec)
        self.num_spec_accepted_tokens += accepted
        # Its last token and the accepted proposals were computed: each token's predecessor.
        return self._append_steps(seq, tokens)

    def _append_steps(self, seq: Sequence, tokens: list[Sampled]
                      ) -> list[tuple[Sequence, Sampled]]:
        """Books a row whose step computed the predecessor of each of `tokens` (a multi-step
        decode, or verified proposals and the draw after them): each token is appended and
        checked, up to one that ends the sequence, and the slots past its tokens are given
        back. Returns (seq, token) for each appended."""
        appended = []
        for token in tokens:
            seq.num_computed_tokens += 1
            # Blocks filled join the prefix cache before a stop frees them, as a single step's.
            self.block_manager.cache_full_blocks(seq)
            self._append(seq, token)
            appended.append((seq, token))
            if seq.is_finished:
                return appended
        self.block_manager.trim(seq)
        self.block_manager.cache_full_blocks(seq)
        return appended

    def _append(self, seq: Sequence, token: Sampled) -> None:
        """Appends a sampled token to `seq` (its logprob, its grammar) and finishes `seq` if the
        token ends it."""
        seq.token_ids.append(token.token_id)
        seq.cumulative_logprob += token.logprob
        if seq.matcher is not None:
            seq.matcher.consume_token(token.token_id)
        self._check_stop(seq)

    def _fork_completion(self, parent: Sequence, j: int) -> Sequence:
        """The j-th completion of `parent`'s request, sharing its blocks; seeded `seed + j`."""
        child = parent.fork(index=j, seed=completion_seed(parent.seed, j))
        self.fork(parent, child)
        return child

    def _check_stop(self, seq: Sequence) -> None:
        """Finishes `seq` if its newest token ends it (token ids and lengths only)."""
        p, token_id = seq.params, seq.token_ids[-1]
        num_output_tokens = seq.num_output_tokens
        may_stop = num_output_tokens >= p.min_tokens
        if may_stop and not p.ignore_eos and token_id in self.eos_token_ids:
            self.finish(seq, "stop")
        elif may_stop and token_id in p.stop_token_ids:
            self.finish(seq, "stop", stop_reason=token_id)
        elif seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete
            self.finish(seq, "stop")
        elif (num_output_tokens == p.max_tokens
              or len(seq.token_ids) >= self.config.max_model_len):
            self.finish(seq, "length")

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.add_preempted(seq)
        self.num_preemptions += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Adds `child` beside its running `parent`, sharing its blocks."""
        self.block_manager.fork(parent, child)
        self.running.append(child)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | None = None) -> None:
        """Marks `seq` finished and frees its blocks (it may be running or waiting)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._finished_seq_ids.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
