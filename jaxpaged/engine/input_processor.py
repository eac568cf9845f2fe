"""Prompts to token ids: tokenization, chat templates and the checks a prompt must pass.

`InputProcessor` reads no engine state (only the tokenizer and fixed limits), so the async engine
runs it on a thread pool of its own, off the thread that runs the steps: a 2 MB prompt then costs
only its own request's time. (Hugging Face's fast tokenizers release the GIL while encoding.)
"""

from __future__ import annotations

import jinja2
import numpy as np

from jaxpaged.errors import InvalidRequestError


class InputProcessor:
    """Tokenizes and checks prompts for a model of `vocab_size` tokens and `max_model_len`."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # transformers resets a tokenizer's saved truncation or padding on its first encode,
        # a write that must not race with other threads' encodes and decodes: do it now.
        tokenizer("warm-up")

    def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or as `{"prompt_token_ids": [...]}`.

        Raises:
          InvalidRequestError (param "prompt"): the prompt is empty, of the wrong type, leaves
            no room for output under `max_model_len`, or has ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty")
            text, ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            raise InvalidRequestError(
                "prompt", f"a prompt must be a str or a dict with 'prompt_token_ids', got "
                f"{type(prompt).__name__}: {prompt!r:.80}")
        if not ids:
            raise InvalidRequestError("prompt", f"prompt {prompt!r:.80} has no tokens")
        if len(ids) >= self.max_model_len:  # before the id check below: it costs O(len(ids))
            raise InvalidRequestError(
                "prompt", f"prompt has {len(ids)} tokens, which leaves no room for output under "
                f"max_model_len={self.max_model_len}")
        if not isinstance(prompt, str):
            vocab = self.vocab_size
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    "prompt", f"prompt_token_ids {bad[:8]} are not ids in [0, {vocab})")
            ids = [int(t) for t in ids]
        return text, ids

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """(text, token ids) of a conversation rendered with the model's chat template, with
        `template_kwargs` as extra template variables (`enable_thinking`, ...).

        The template adds the special tokens, so the text is tokenized without adding more.
        `tools` (OpenAI's `[{"type": "function", "function": {...}}]`) go to the template,
        which shows them to the model if it was written to (templates that ignore them do).

        Raises:
          InvalidRequestError (param "messages"): the conversation is empty or the template
            rejects it (for example `continue_final_message` with `add_generation_prompt`, or
            a role it does not know).
        """
        if not messages:
            raise InvalidRequestError("messages", "messages is empty: give at least one message")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(template_kwargs or {}))
        except jinja2.TemplateError as e:
            raise InvalidRequestError(
                "messages", f"the chat template rejected the messages: {e}") from e
        except TypeError as e:  # a template variable that names one of the call's own
            raise InvalidRequestError("chat_template_kwargs", f"chat_template_kwargs: {e}") \
                from e
        return text, self.tokenizer(text, add_special_tokens=False).input_ids
