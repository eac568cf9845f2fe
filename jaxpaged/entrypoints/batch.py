"""Batch runs on the OpenAI Batch file format (`jaxpaged run-batch`, as vLLM's `run-batch`),
the manifest that records how a run was made, and its replay (`jaxpaged replay`).

Input: one JSON object per line, `{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`. Output: one line per input line, in input order,
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`: the body is
what the HTTP server answers for that request (the same handlers: `server.serving`), or its
OpenAI error body with the message also in `error`. A bad line (not JSON, another method or
URL, an invalid body, `stream`) becomes an error line for its `custom_id` (null when the line
is not JSON); the others run. At most `window` requests are in flight, so any input size
streams through in bounded memory.

Each request without a `seed` gets `seed + line index` (the run's `--seed`), recorded in the
manifest, so that sampled requests can be run again. Whether a replay gives the same results
on the same machine depends on the batches matching: with `--batch-invariant` it does whatever
the batching (`LLM(batch_invariant=True)`); otherwise requests arrive at the engine in an
order that the threads decide, and logprobs (rarely, sampled tokens) may differ.

The manifest (`<output>.manifest.json`): versions (jaxpaged and its git commit when run from
a checkout, jax, jaxlib, flax, transformers, Python), platform, devices and XLA_FLAGS, every
engine option and the modes that ran (each with what was asked and why it differs), the sha256 of each file of the model folder (the tokenizer's files among them),
of the input and of the output, each request's effective seed, the LoRA adapters held (their
folders and files' sha256; `replay` refuses changed files) and which one each request named,
and the wall time.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import time
import uuid
from pathlib import Path
from typing import Literal

import numpy as np
import pydantic
from tqdm.auto import tqdm

URLS = {"/v1/completions": "create_completion", "/v1/chat/completions": "create_chat_completion"}


class BatchRequestInput(pydantic.BaseModel):
    """One input line (OpenAI's Batch API)."""

    custom_id: str
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict


def sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_files(model_dir: Path) -> dict[str, str]:
    """sha256 of each file of the model folder (its weights, configs and tokenizer), by name."""
    return {p.name: sha256(p) for p in sorted(Path(model_dir).iterdir()) if p.is_file()}


def _git_commit() -> str | None:
    """The commit of the checkout jaxpaged runs from, or None (an installed copy)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def environment() -> dict:
    """Versions, platform and devices of this process."""
    import jax

    import jaxpaged
    from jaxpaged import envs
    from jaxpaged.platforms import current_platform

    versions = {"jaxpaged": jaxpaged.__version__, "python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    devices = jax.devices()
    return {"versions": versions, "git_commit": _git_commit(),
            "platform": {"system": platform.system(), "machine": platform.machine(),
                         "jax_backend": current_platform().jax_backend},
            "devices": {"kind": devices[0].device_kind, "count": len(devices)},
            "xla_flags": envs.xla_flags()}


def _error_line(custom_id, status: int, error) -> dict:
    from jaxpaged.server.errors import APIError

    body = error.body() if isinstance(error, APIError) else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": None, "body": body},
            "error": str(error)}


async def _run_line(serving, index: int, line: str, seed: int, seeds: dict,
                    loras: dict) -> dict:
    """One input line's output line; `seeds` and `loras` get its effective seed and the
    adapter its `model` names (if any), by custom_id."""
    from jaxpaged.server import protocol as api
    from jaxpaged.server.errors import APIError, parse_body

    try:
        data = json.loads(line)
    except ValueError as e:
        return _error_line(None, 400, APIError(f"line {index + 1} is not JSON: {e}"))
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    try:
        item = parse_body(BatchRequestInput, data if isinstance(data, dict) else line)
        model = (api.CompletionRequest if item.url == "/v1/completions"
                 else api.ChatCompletionRequest)
        req = parse_body(model, item.body)
        if req.stream:
            raise APIError("stream is not supported in a batch", param="stream")
        if req.seed is None:
            req.seed = seed + index
        seeds[item.custom_id] = req.seed
        lora = serving.check_model(req.model)
        if lora is not None:
            loras[item.custom_id] = lora.lora_name
        response = await getattr(serving, URLS[item.url])(req)
    except APIError as e:
        return _error_line(custom_id, e.status, e)
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id,
            "response": {"status_code": 200, "request_id": response.id,
                         "body": response.model_dump(mode="json")}, "error": None}


async def _run(llm, model_name: str, lines, out, total: int, seed: int, window: int,
               progress: bool) -> dict:
    from jaxpaged.engine.async_llm_engine import AsyncLLMEngine
    from jaxpaged.server.serving import OpenAIServing

    engine = AsyncLLMEngine(llm.llm_engine)
    serving = OpenAIServing(engine, model_name)
    engine.start()
    seeds: dict[str, int] = {}
    loras: dict[str, str] = {}
    pending: collections.deque = collections.deque()
    counts = collections.Counter()

    def write(result: dict) -> None:
        counts["ok" if result["error"] is None else "error"] += 1
        out.write(json.dumps(result) + "\n")
        bar.update()

    with tqdm(total=total, desc="Batch requests", disable=not progress) as bar:
        try:
            for index, line in enumerate(lines):
                if not line.strip():
                    bar.update()
                    continue
                pending.append(asyncio.ensure_future(_run_line(serving, index, line, seed,
                                                               seeds, loras)))
                while len(pending) >= window:
                    write(await pending.popleft())
            while pending:
                write(await pending.popleft())
        finally:
            for task in pending:
                task.cancel()
            await engine.shutdown()
    return {"seeds": seeds, "loras": loras, "num_ok": counts["ok"],
            "num_errors": counts["error"]}


def run_batch(llm, model_name: str, input_path: str | os.PathLike,
              output_path: str | os.PathLike, engine_options: dict | None = None, seed: int = 0,
              window: int | None = None, progress: bool = True) -> dict:
    """Runs every line of `input_path` through `llm` and writes `output_path` and its manifest
    (`<output_path>.manifest.json`, returned). `engine_options`: the options `llm` was built
    with, recorded for replay (default: all of them, `llm.engine_args.to_dict()`); `window`:
    requests in flight (default 2 * max_num_seqs).

    Raises:
      OSError: the input cannot be read or the output written.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    if engine_options is None:
        engine_options = llm.engine_args.to_dict()
    start = time.time()
    with open(input_path, encoding="utf-8") as f:
        total = sum(1 for _ in f)
    window = window or 2 * llm.llm_engine.scheduler_config.max_num_seqs
    with open(input_path, encoding="utf-8") as lines, \
            open(output_path, "w", encoding="utf-8") as out:
        summary = asyncio.run(_run(llm, model_name, lines, out, total, seed, window, progress))
    return write_manifest(
        Path(f"{output_path}.manifest.json"), "jaxpaged run-batch", llm, engine_options,
        input_path, output_path, summary["seeds"], time.time() - start, model_name=model_name,
        seed=seed, window=window, num_requests=summary["num_ok"] + summary["num_errors"],
        num_errors=summary["num_errors"], lora_modules=_lora_modules(llm),
        request_loras=summary["loras"])


def _lora_modules(llm) -> dict:
    """The adapters the engine holds that were read from folders: name -> their folder and
    its files' sha256 (`jaxpaged.lora.peft.read_peft_folder`)."""
    manager = llm.llm_engine.lora
    if manager is None:
        return {}
    return {name: {"path": loaded.adapter.source, "files": loaded.adapter.files_sha256}
            for name, loaded in manager.adapters.items() if loaded.adapter.source}


def write_manifest(path: Path, kind: str, llm, engine_options: dict, input_path, output_path,
                   request_seeds: dict, wall_time_s: float, path_text=str, **fields) -> dict:
    """Writes (and returns) the manifest of a run of `llm` (module doc): `environment()`, the
    engine's backend, dtype and options, the sha256 of each model file and of the input and
    output files (their paths recorded as `path_text` gives them), each request's effective
    seed, the wall time and any further `fields`; and the modes that ran, each with what was
    asked and why it differs (`effective_modes`, `config.EffectiveModes.to_dict`)."""
    engine = llm.llm_engine
    manifest = {
        "kind": kind, **environment(), "attention_backend": engine.attention_backend,
        "dtype": np.dtype(engine.dtype).name, "engine_options": engine_options,
        "effective_modes": engine.config.modes.to_dict(),
        "model_files": model_files(engine.model_dir),
        "input": {"path": path_text(input_path), "sha256": sha256(input_path)},
        "output": {"path": path_text(output_path), "sha256": sha256(output_path)},
        **fields, "request_seeds": request_seeds, "wall_time_s": wall_time_s,
    }
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def comparable(result: dict) -> dict:
    """An output line without what differs on every run (ids, timestamps)."""
    response = dict(result.get("response") or {})
    body = response.get("body")
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("id", "created")}
    response.pop("request_id", None)
    return {"custom_id": result.get("custom_id"), "status_code": response.get("status_code"),
            "body": body, "error": result.get("error")}


def first_difference(a, b, path: str = "") -> str | None:
    """Where two JSON values first differ ("choices[0].logprobs.token_logprobs[7]"), or None."""
    if type(a) is not type(b):
        return path or "."
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            found = first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None if len(a) == len(b) else f"{path}[{min(len(a), len(b))}]"
    return None if a == b else (path or ".")


def _text_difference(tokenizer, a: dict, b: dict) -> str | None:
    """"choices[i] text, token k" for the first choice whose text (a chat message's content)
    differs, its tokens re-encoded; None when every choice's text is the same."""
    choices = [(r.get("body") or {}).get("choices") or [] for r in (a, b)]
    for i, (x, y) in enumerate(zip(*choices)):
        texts = [c.get("text", (c.get("message") or {}).get("content")) or "" for c in (x, y)]
        if texts[0] != texts[1]:
            ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
            k = next((k for k, (s, t) in enumerate(zip(*ids)) if s != t),
                     min(map(len, ids)))
            return f"choices[{i}] text, token {k}"
    return None


def replay(manifest_path: str | os.PathLike, output_path: str | os.PathLike | None = None,
           progress: bool = True, overrides: dict | None = None) -> tuple[int, str]:
    """Runs a recorded batch again with its options and seeds and compares the outputs. The
    manifest's `engine_options` are `EngineArgs.to_dict()`'s (every option); `overrides`
    (engine options by name) replace recorded ones, with a warning.

    Returns:
      (exit code, message): 0 and "identical N/N", or 1 naming the first differing
      `custom_id` and where in its response it differs.

    Raises:
      ValueError: a model file (or the input) whose sha256 differs from the manifest's, or a
        recorded option that is no engine option or a bad value, named.
    """
    import warnings

    from jaxpaged.engine.arg_utils import EngineArgs
    from jaxpaged.entrypoints.llm import LLM
    from jaxpaged.lora import LoRARequest
    from jaxpaged.model_loader.model_store import resolve_model

    manifest_path = Path(manifest_path)
    manifest = json.loads(manifest_path.read_text())
    engine_args = EngineArgs.from_dict({**manifest["engine_options"], **(overrides or {})})
    if overrides:
        warnings.warn(f"replaying with engine options other than the recorded ones: {overrides}",
                      stacklevel=2)
    model_dir = resolve_model(engine_args.model)
    files = model_files(model_dir)
    for name, digest in manifest["model_files"].items():
        if files.get(name) != digest:
            raise ValueError(f"{model_dir / name}: its sha256 differs from the one recorded in "
                             f"{manifest_path} (or it is missing); refusing to replay")
    input_path = Path(manifest["input"]["path"])
    if sha256(input_path) != manifest["input"]["sha256"]:
        raise ValueError(f"{input_path}: its sha256 differs from the one recorded in "
                         f"{manifest_path}; refusing to replay")
    now = environment()
    for key in ("versions", "devices", "platform", "xla_flags"):
        if now[key] != manifest.get(key):
            warnings.warn(f"replaying on other {key}: recorded {manifest[key]}, now {now[key]}",
                          stacklevel=2)
    llm = LLM.from_engine_args(engine_args)
    for i, (name, module) in enumerate(manifest.get("lora_modules", {}).items()):
        lora = LoRARequest(name, i + 1, module["path"])
        llm.add_lora(lora)
        if llm.llm_engine.lora.adapters[name].adapter.files_sha256 != module["files"]:
            raise ValueError(f"{module['path']}: adapter {name!r}'s files differ from those "
                             f"recorded in {manifest_path}; refusing to replay")
    out = Path(output_path or f"{manifest['output']['path']}.replay")
    # Requests keep their recorded seeds: the input with each request's effective seed.
    seeded = out.with_name(out.name + ".input.jsonl")
    with open(input_path, encoding="utf-8") as src, open(seeded, "w", encoding="utf-8") as dst:
        for line in src:
            try:
                data = json.loads(line)
                seed = manifest["request_seeds"].get(data.get("custom_id"))
                if seed is not None and isinstance(data.get("body"), dict):
                    data["body"]["seed"] = seed
                    line = json.dumps(data) + "\n"
            except (ValueError, AttributeError):
                pass  # a bad line stays as it was, to fail as it did
            dst.write(line)
    run_batch(llm, manifest["model_name"], seeded, out, seed=manifest["seed"],
              window=manifest["window"], progress=progress)
    seeded.unlink()
    Path(f"{out}.manifest.json").unlink(missing_ok=True)
    recorded = Path(manifest["output"]["path"])
    n = 0
    with open(recorded, encoding="utf-8") as a, open(out, encoding="utf-8") as b:
        for line_a, line_b in zip(a, b):
            ra, rb = comparable(json.loads(line_a)), comparable(json.loads(line_b))
            where = first_difference(ra, rb)
            if where is not None:
                where = _text_difference(llm.get_tokenizer(), ra, rb) or where
                return 1, (f"differs at custom_id {ra['custom_id']!r}: {where} (recorded "
                           f"{recorded}, replayed {out})")
            n += 1
    return 0, f"identical {n}/{n}"
