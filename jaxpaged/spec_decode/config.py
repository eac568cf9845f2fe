"""Speculative decoding's options (vLLM's `speculative_config` keys)."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys.

    method: "ngram" (prompt lookup), "draft_model" (implied by `model`), or another proposer
      registered in `registry.PROPOSERS`.
    num_speculative_tokens: k, the tokens proposed per sequence and step.
    prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram matched ("ngram";
      vLLM's defaults: one given sets both, neither gives 5).
    model: the draft model ("draft_model"), as the target's `model` is given (a folder, a GGUF
      file or an embedded model's name), with the target's vocabulary.
    disable_by_batch_size: no proposals in a step in which more sequences decode than this
      (None: never off); the default, `DEFAULT_DISABLE_BY_BATCH_SIZE`, is where verification
      stopped paying on this project's CPU (`bench/speculative.py`; README, "Speculative
      decoding").
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = 8  # DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"speculative_config: {name} must be an int >= 1, "
                                 f"got {value!r}")

        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            positive(name)
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        from jaxpaged.spec_decode.registry import PROPOSERS
        if self.method not in PROPOSERS:
            raise ValueError(f"speculative_config: method {self.method!r} is not one of "
                             f"{sorted(PROPOSERS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs a 'model'")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: 'model' is for method 'draft_model', "
                                 "not 'ngram'")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min {lo} is larger than "
                                 f"prompt_lookup_max {hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, config: dict | str | None) -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the server's `--speculative-config`); None stays None.

        Raises:
          ValueError: not a JSON object, an unknown key, or a bad value (named).
        """
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {config!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        config = dict(config)
        if config.get("model") is not None:
            config.setdefault("method", "draft_model")
        return cls(**config)


# Decoding sequences above which a step proposes nothing, by default (see SpeculativeConfig).
DEFAULT_DISABLE_BY_BATCH_SIZE = SpeculativeConfig.disable_by_batch_size
