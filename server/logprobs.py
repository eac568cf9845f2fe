"""Log-probabilities in OpenAI's two response formats, from the engine's `{id: Logprob}` dicts
(and the routed experts, jaxpaged's per-token extension).

Each engine entry holds the top-k tokens (ranks 1..k) and the sampled token, with their
log-probabilities under the model's distribution and their decoded text.
"""

from __future__ import annotations

from jaxpaged.outputs import CompletionOutput, Logprob
from jaxpaged.server import protocol as api


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                        text_offset: int, first_token_text: str | None = None
                        ) -> api.CompletionLogProbs:
    """The legacy `/v1/completions` format: parallel lists of tokens, their log-probabilities,
    their top alternatives (`{text: logprob}`, the sampled token included) and character
    offsets from `text_offset`. A None entry (an echoed prompt's first token) has no
    log-probability and is shown as `first_token_text`."""
    out = api.CompletionLogProbs()
    for token_id, entry in zip(token_ids, logprobs):
        if entry is None:
            token, logprob, top = first_token_text or "", None, None
        else:
            token, logprob = entry[token_id].decoded_token, entry[token_id].logprob
            top = {lp.decoded_token: lp.logprob for lp in entry.values()}
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int) -> list[api.ChatLogprob]:
    """The `/v1/chat/completions` format: per token its text, log-probability and UTF-8 bytes,
    and the `num_top` most likely tokens in rank order."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append(api.ChatLogprob(
            **_top_logprob(entry[token_id]),
            top_logprobs=[api.TopLogprob(**_top_logprob(lp)) for lp in top]))
    return content


def _top_logprob(lp: Logprob) -> dict:
    return {"token": lp.decoded_token, "logprob": lp.logprob,
            "bytes": list(lp.decoded_token.encode("utf-8"))}


def routed_experts(c: CompletionOutput) -> list | None:
    """A choice's `routed_experts` (jaxpaged's extension field): `c.routed_experts` as nested
    lists [token][MoE layer][k], or None where the request did not ask."""
    return None if c.routed_experts is None else c.routed_experts.tolist()
