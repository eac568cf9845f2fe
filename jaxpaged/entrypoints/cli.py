"""Command line: `jaxpaged generate`, `jaxpaged chat`, `jaxpaged serve`, `jaxpaged run-batch`,
`jaxpaged replay`, `jaxpaged prepare`, `jaxpaged import`, `jaxpaged convert`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each engine flag comes from a field of `EngineArgs`
    (`EngineArgs.add_cli_args`): serve, generate, chat, run-batch and replay take them all."""
    from jaxpaged.engine.arg_utils import EngineArgs
    from jaxpaged.server.tool_calls import TOOL_CALL_PARSERS

    parser = argparse.ArgumentParser(prog="jaxpaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text")
    chat = sub.add_parser("chat", help="reply to one user message via the chat template")
    chat.add_argument("message", help="the user's message")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        EngineArgs.add_cli_args(p)
        _add_sampling_args(p)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    EngineArgs.add_cli_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="if set, /v1/* requests need 'Authorization: Bearer <key>'")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients use; default: --model as given")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the default when a chat sends tools): the '
                   "model's own tool calls are read with --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="the model's tool-call syntax (hermes: <tool_call>{json}</tool_call>, "
                   "as Hermes 2 Pro and Qwen2.5 write)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve, each under its name as a "
                   "request's model (needs --enable-lora)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file (or the template itself) in place of the "
                   "tokenizer's")
    batch = sub.add_parser("run-batch", help="run an OpenAI Batch file (JSONL of /v1/completions "
                           "and /v1/chat/completions requests), writing results and a manifest")
    batch.add_argument("-i", "--input-file", required=True, help="the requests, one per line")
    batch.add_argument("-o", "--output-file", required=True,
                       help="the results, one per line; the manifest goes beside it "
                       "(<output>.manifest.json)")
    batch.add_argument("--served-model-name", default=None,
                       help="the model name requests give; default: --model as given")
    batch.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) a request's model may name (needs "
                       "--enable-lora); recorded with their files' sha256 in the manifest")
    EngineArgs.add_cli_args(batch)
    rep = sub.add_parser("replay", help="run a recorded batch again (its manifest) and compare; "
                         "an engine flag given replaces the recorded option")
    rep.add_argument("manifest", help="a run-batch manifest (<output>.manifest.json)")
    rep.add_argument("-o", "--output-file", default=None,
                     help="where the new results go; default: <recorded output>.replay")
    EngineArgs.add_cli_args(rep)
    sub.add_parser("prepare", help="import the embedded default model into $JAXPAGED_HOME")
    imp = sub.add_parser("import", help="import a llama.cpp GGUF file into a Hugging Face folder "
                         "(config, tokenizer, float32 safetensors) that --model can load")
    imp.add_argument("gguf", help="the .gguf file (architectures: llama, qwen2, qwen3, gemma2, "
                     "gemma3, phi3)")
    imp.add_argument("out", nargs="?", default=None,
                     help="the folder to write; it must not exist or be empty "
                     "(default: $JAXPAGED_HOME/models/<file name without .gguf>)")
    conv = sub.add_parser("convert", help="write a model as an orbax checkpoint (params/, with "
                          "its config and tokenizer beside) that --model can load")
    conv.add_argument("src", help="a Hugging Face folder, or a .gguf file")
    conv.add_argument("out", help="the folder to write; it must not exist or be empty")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxpaged.platforms import prepare_jax

    # jax is imported already (by the `jaxpaged` package), but its backends start only on
    # first use: XLA's flags and jax's platforms can still be set.
    prepare_jax(batch_invariant=getattr(args, "batch_invariant", False) or (
        args.command == "replay" and _recorded_batch_invariant(args.manifest)))
    try:
        if args.command == "prepare":
            from jaxpaged.model_loader.model_store import ensure_default_model
            print(ensure_default_model())
            return 0
        if args.command == "import":
            return _import(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "run-batch":
            return _run_batch(args)
        if args.command == "replay":
            return _replay(args)
        return _generate(args)
    except ValueError as e:
        print(f"jaxpaged: error: {e}", file=sys.stderr)
        return 2


def _chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the value itself when it names no file but reads as
    a template (vLLM's rule).

    Raises:
      ValueError: neither a file nor a template (the value named).
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _recorded_batch_invariant(manifest: str) -> bool:
    """Whether the run-batch manifest at `manifest` was batch-invariant (False if unreadable:
    `replay` reports that)."""
    import json

    try:
        with open(manifest, encoding="utf-8") as f:
            return bool(json.load(f)["engine_options"].get("batch_invariant"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _import(args: argparse.Namespace) -> int:
    """Imports into a new folder (`model_store.write_aside`), so a failed import leaves nothing."""
    from pathlib import Path

    from jaxpaged.model_loader.gguf_import import import_gguf
    from jaxpaged.model_loader.model_store import jaxpaged_home, write_aside

    src = Path(args.gguf).expanduser()
    if not src.is_file():
        raise ValueError(f"{args.gguf!r} is not a file")
    name = src.name[:-len(".gguf")] if src.name.endswith(".gguf") else src.name
    out = Path(args.out).expanduser() if args.out else jaxpaged_home() / "models" / name
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{str(out)!r} exists and is not an empty folder")
    write_aside(out, lambda folder: import_gguf(src, folder))
    print(out)
    return 0


def _convert(args: argparse.Namespace) -> int:
    """Converts into a new folder (`model_store.write_aside`); a GGUF is imported on the way."""
    import tempfile
    from pathlib import Path

    from jaxpaged.model_loader.gguf_import import import_gguf
    from jaxpaged.model_loader.model_store import write_aside
    from jaxpaged.models.registry import convert_to_orbax

    src, out = Path(args.src).expanduser(), Path(args.out).expanduser()
    if not src.exists():
        raise ValueError(f"{args.src!r} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{str(out)!r} exists and is not an empty folder")
    if src.is_dir():
        write_aside(out, lambda folder: convert_to_orbax(src, folder))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            import_gguf(src, Path(tmp))
            write_aside(out, lambda folder: convert_to_orbax(tmp, folder))
    print(out)
    return 0


def _engine_args(args: argparse.Namespace, one_shot: int = 0):
    """The `EngineArgs` the flags give. A one-shot command (generate, chat: `one_shot` is its
    number of sequences) compiles only the shapes it runs unless --precompile is given: its
    decode step while the tokenizer loads (when it decodes: more than one token), its prompt's
    when it meets it; and its KV pool is what its sequences can fill (`_one_shot_pool`) unless
    --num-kv-blocks or --kv-cache-memory-bytes is given."""
    from jaxpaged.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    if one_shot and "precompile" not in args:
        engine_args.precompile = [one_shot] if args.max_tokens != 1 else False
    if one_shot and not {"num_kv_blocks", "kv_cache_memory_bytes",
                         "gpu_memory_utilization"} & vars(args).keys():
        engine_args.kv_cache_memory_bytes = _one_shot_pool(engine_args, one_shot)
    return engine_args


def _run_batch(args: argparse.Namespace) -> int:
    """`jaxpaged run-batch`: the OpenAI Batch file through the engine, and its manifest."""
    from jaxpaged import LLM
    from jaxpaged.entrypoints.batch import run_batch
    from jaxpaged.model_loader.model_store import DEFAULT_MODEL

    engine_args = _engine_args(args)
    model_name = args.served_model_name or engine_args.model or DEFAULT_MODEL
    if engine_args.model is not None:  # recorded as an absolute folder, for replay from anywhere
        engine_args.model = os.path.abspath(os.path.expanduser(engine_args.model))
    loras = _lora_modules(args, engine_args)
    llm = LLM.from_engine_args(engine_args)
    for lora in loras:
        llm.add_lora(lora)
    manifest = run_batch(llm, model_name, os.path.abspath(args.input_file),
                         os.path.abspath(args.output_file), seed=engine_args.seed)
    print(f"{manifest['num_requests']} requests, {manifest['num_errors']} errors; "
          f"{args.output_file}.manifest.json")
    return 0


def _replay(args: argparse.Namespace) -> int:
    """`jaxpaged replay`: exit 0 when the outputs are identical, 1 at the first difference.
    Engine flags given replace the recorded options."""
    from jaxpaged.engine.arg_utils import EngineArgs
    from jaxpaged.entrypoints.batch import replay

    overrides = {f: getattr(args, f) for f in EngineArgs.__dataclass_fields__ if f in args}
    code, message = replay(args.manifest, args.output_file, overrides=overrides)
    print(message)
    return code


def _serve(args: argparse.Namespace) -> int:
    """Serves HTTP on process 0; with several processes, the others follow its engine calls
    (`jaxpaged.distributed.multihost`)."""
    from jaxpaged import LLM
    from jaxpaged.model_loader.model_store import DEFAULT_MODEL
    from jaxpaged.distributed.multihost import LeaderEngine, follow
    from jaxpaged.server import run_server

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    engine_args = _engine_args(args)
    if args.allow_runtime_lora_updating and not engine_args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    if engine_args.enable_lora and engine_args.num_processes > 1:
        raise ValueError("--enable-lora: adapters are served on one process only")
    loras = _lora_modules(args, engine_args)
    # The serving defaults (`EngineArgs.DEFAULT_SCHEDULER_STEPS`): one decode step a call, as
    # a request arriving during a multi-step call would wait for it.
    llm = LLM.from_engine_args(engine_args, usage_context="serve")
    for lora in loras:
        llm.add_lora(lora)
    if engine_args.num_processes > 1 and engine_args.process_id > 0:
        try:
            follow(llm.llm_engine)
        except RuntimeError as e:
            print(f"jaxpaged: error: {e}", file=sys.stderr)
            return 1
        return 0
    if engine_args.num_processes > 1:
        llm.llm_engine = LeaderEngine(llm.llm_engine)
    model = engine_args.model
    model_name = args.served_model_name or model or DEFAULT_MODEL
    try:
        return run_server(llm, model_name, host=args.host, port=args.port,
                          api_key=args.api_key, model_root=str(model or DEFAULT_MODEL),
                          log_level=args.log_level,
                          tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice
                          else None, chat_template=_chat_template(args.chat_template),
                          allow_runtime_lora_updating=args.allow_runtime_lora_updating)
    finally:
        if engine_args.num_processes > 1:
            llm.llm_engine.shutdown()


def _lora_modules(args: argparse.Namespace, engine_args) -> list:
    """--lora-modules' `NAME=PATH`s as `LoRARequest`s (ids from 1, in order; folders made
    absolute, as a manifest records them).

    Raises:
      ValueError: a malformed entry, or adapters without --enable-lora.
    """
    from jaxpaged.lora import LoRARequest

    if args.lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    loras = []
    for index, spec in enumerate(args.lora_modules):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected NAME=PATH, got {spec!r}")
        loras.append(LoRARequest(name, index + 1, os.path.abspath(os.path.expanduser(path))))
    return loras


def _one_shot_pool(engine_args, num_seqs: int) -> int:
    """A one-shot command's pool: the bytes its `num_seqs` sequences of `max_model_len` can
    fill, within the default budget (a smaller pool starts faster: its memory is zeroed)."""
    from jaxpaged.platforms import resolve_dtype
    from jaxpaged.worker.kv_cache import kv_cache_bytes_per_token, resolve_kv_cache_dtype
    from jaxpaged.worker.memory import DEFAULT_KV_CACHE_MEMORY_BYTES
    from jaxpaged.model_loader.model_store import resolve_model
    from jaxpaged.models import load_config

    config = load_config(resolve_model(engine_args.model))
    max_model_len = engine_args.max_model_len or config.max_position_embeddings
    S = engine_args.block_size
    tokens = num_seqs * (-(-max_model_len // S) * S)
    per_token = kv_cache_bytes_per_token(config, resolve_kv_cache_dtype(
        engine_args.kv_cache_dtype, resolve_dtype(engine_args.dtype)))
    return min(engine_args.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES,
               tokens * per_token)


def _generate(args: argparse.Namespace) -> int:
    from jaxpaged import LLM, SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens)
    num_seqs = args.n * (1 if args.command == "chat" else len(args.prompts))
    llm = LLM.from_engine_args(_engine_args(args, one_shot=num_seqs))
    if args.command == "chat":
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.message})
        outputs = llm.chat(messages, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for output in outputs:
        for completion in output.outputs:
            print(completion.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
