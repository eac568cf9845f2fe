"""Command line: `jaxpaged generate`, `jaxpaged chat`, `jaxpaged serve`, `jaxpaged run-batch`,
`jaxpaged replay`, `jaxpaged prepare`, `jaxpaged import`, `jaxpaged convert`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local Hugging Face folder or GGUF file (served from the file, int8); "
                   "default: embedded SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto", help="auto (f32 on CPU, bf16 on GPU), float32, ...")
    g.add_argument("--quantization", "-q", default="auto", choices=["auto", "none", "int8"],
                   help="weight-only int8 for the linear layers and embedding (auto: int8 for "
                   "a GGUF file, else none)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8"],
                   help="the KV pool's dtype; int8 and fp8 (e4m3) keep one scale per token and "
                   "head, about a quarter of float32's bytes")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\' or \'{"model": '
                   'PATH, "num_speculative_tokens": 4}\' (a draft model)')
    g.add_argument("--generation-config", default="auto",
                   help="default sampling values: 'auto' from the model folder's "
                   "generation_config.json (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, max_new_tokens), 'vllm' for none, or a folder holding "
                   "one; a request's own fields override them")
    g.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step; default max(max_model_len, 2048)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="prompt tokens a sequence computes at most in a step that also decodes "
                   "(0: no cap; default 128); bounds inter-token latency under load")
    g.add_argument("--max-num-partial-prefills", type=int, default=1,
                   help="prompts computed at most in a step that also decodes")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: arrival order; priority: a request's 'priority' (lower first, "
                   "ties by arrival), a waiting request preempting lower ones")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="blocks in the KV pool")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV pool budget in bytes, when --num-kv-blocks is not given (default "
                   "2 GiB; generate and chat take at most what their sequences can fill)")
    g.add_argument("--enable-prefix-caching", default=True,
                   action=argparse.BooleanOptionalAction,
                   help="reuse the KV blocks of common prompt prefixes")
    g.add_argument("--precompile", default=None, action=argparse.BooleanOptionalAction,
                   help="compile every step shape at startup (about 25 under the default "
                   "limits), so that serving compiles nothing new; default: on for serve, off "
                   "for generate and chat (they compile the shapes they run)")
    g.add_argument("--compilation-cache-dir", default="auto",
                   help="keep compiled step shapes here across runs; 'off' for none (default: "
                   "$JAXPAGED_COMPILATION_CACHE_DIR, else $JAXPAGED_HOME/compile-cache)")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "cpu", "pallas", "pallas-interpret", "xla"])
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the sampling of requests that give no seed")
    g.add_argument("--batch-invariant", action="store_true",
                   help="results that do not depend on the batch: the same ids and logprobs "
                   "whatever shares a step, chunking, prefix caching or preemption (CPU: "
                   "the cpu or xla attention backend)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices to split the model over (tensor parallelism)")
    g = p.add_argument_group("several processes (hosts): one JAX runtime through "
                             "jax.distributed; run the same command on each, with its "
                             "--process-id")
    g.add_argument("--coordinator-address", default=None,
                   help="host:port of process 0, where the processes meet")
    g.add_argument("--num-processes", type=int, default=1, help="processes in all")
    g.add_argument("--process-id", type=int, default=0, help="this process's index, from 0")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")


def build_parser() -> argparse.ArgumentParser:
    from jaxpaged.server.tool_calls import TOOL_CALL_PARSERS

    parser = argparse.ArgumentParser(prog="jaxpaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text")
    chat = sub.add_parser("chat", help="reply to one user message via the chat template")
    chat.add_argument("message", help="the user's message")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        _add_engine_args(p)
        _add_sampling_args(p)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_engine_args(serve)
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
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="return a reasoning model's <think>...</think> text apart, as "
                   "reasoning_content in chat messages and stream deltas")
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
    _add_engine_args(batch)
    rep = sub.add_parser("replay", help="run a recorded batch again (its manifest) and compare")
    rep.add_argument("manifest", help="a run-batch manifest (<output>.manifest.json)")
    rep.add_argument("-o", "--output-file", default=None,
                     help="where the new results go; default: <recorded output>.replay")
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


def _build_llm(args: argparse.Namespace, one_shot: int = 0,
               kv_cache_memory_bytes: int | None = None):
    """The engine the flags describe. A one-shot command (generate, chat: `one_shot` is its
    number of sequences) compiles only the shapes it runs unless --precompile is given: its
    decode step while the tokenizer loads (when it decodes: more than one token), its prompt's
    when it meets it."""
    from jaxpaged import LLM

    return LLM(**_engine_options(args, one_shot, kv_cache_memory_bytes))


def _engine_options(args: argparse.Namespace, one_shot: int = 0,
                    kv_cache_memory_bytes: int | None = None) -> dict:
    """`LLM`'s keyword arguments from the engine options (`model` among them)."""
    precompile = args.precompile
    if precompile is None and one_shot:
        precompile = [one_shot] if args.max_tokens != 1 else False
    return dict(model=args.model, dtype=args.dtype,
                quantization=None if args.quantization == "none" else args.quantization,
                kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                speculative_config=args.speculative_config,
                generation_config=args.generation_config,
                reasoning_parser=getattr(args, "reasoning_parser", None),
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                max_num_partial_prefills=args.max_num_partial_prefills,
                scheduling_policy=args.scheduling_policy,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory_bytes=(kv_cache_memory_bytes or args.kv_cache_memory_bytes
                                       or 2 << 30),
                enable_prefix_caching=args.enable_prefix_caching,
                attention_backend=args.attention_backend, seed=args.seed,
                precompile=precompile, tensor_parallel_size=args.tensor_parallel_size,
                coordinator_address=args.coordinator_address,
                num_processes=args.num_processes, process_id=args.process_id,
                compilation_cache_dir=args.compilation_cache_dir,
                batch_invariant=args.batch_invariant)


def _run_batch(args: argparse.Namespace) -> int:
    """`jaxpaged run-batch`: the OpenAI Batch file through the engine, and its manifest."""
    from jaxpaged.entrypoints.batch import run_batch
    from jaxpaged.model_loader.model_store import DEFAULT_MODEL

    options = _engine_options(args)
    if options["model"] is not None:  # recorded as an absolute folder, for replay from anywhere
        options["model"] = os.path.abspath(os.path.expanduser(options["model"]))
    llm = _build_llm(args)
    manifest = run_batch(llm, args.served_model_name or args.model or DEFAULT_MODEL,
                         os.path.abspath(args.input_file), os.path.abspath(args.output_file),
                         options, seed=args.seed)
    print(f"{manifest['num_requests']} requests, {manifest['num_errors']} errors; "
          f"{args.output_file}.manifest.json")
    return 0


def _replay(args: argparse.Namespace) -> int:
    """`jaxpaged replay`: exit 0 when the outputs are identical, 1 at the first difference."""
    from jaxpaged.entrypoints.batch import replay

    code, message = replay(args.manifest, args.output_file)
    print(message)
    return code


def _serve(args: argparse.Namespace) -> int:
    """Serves HTTP on process 0; with several processes, the others follow its engine calls
    (`jaxpaged.distributed.multihost`)."""
    from jaxpaged.model_loader.model_store import DEFAULT_MODEL
    from jaxpaged.distributed.multihost import LeaderEngine, follow
    from jaxpaged.server import run_server

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    llm = _build_llm(args)
    if args.num_processes > 1 and args.process_id > 0:
        try:
            follow(llm.llm_engine)
        except RuntimeError as e:
            print(f"jaxpaged: error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.num_processes > 1:
        llm.llm_engine = LeaderEngine(llm.llm_engine)
    model_name = args.served_model_name or args.model or DEFAULT_MODEL
    try:
        return run_server(llm, model_name, host=args.host, port=args.port,
                          api_key=args.api_key, model_root=str(args.model or DEFAULT_MODEL),
                          log_level=args.log_level,
                          tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice
                          else None, chat_template=_chat_template(args.chat_template),
                          reasoning_parser=args.reasoning_parser)
    finally:
        if args.num_processes > 1:
            llm.llm_engine.shutdown()


def _one_shot_pool(args: argparse.Namespace, num_seqs: int) -> int | None:
    """A one-shot command's pool: the blocks its `num_seqs` sequences of `max_model_len` can
    fill, within the 2 GiB default (a smaller pool starts faster: its memory is zeroed)."""
    if args.num_kv_blocks is not None or args.kv_cache_memory_bytes is not None:
        return None
    from jaxpaged.platforms import resolve_dtype
    from jaxpaged.worker.kv_cache import kv_cache_bytes_per_token, resolve_kv_cache_dtype
    from jaxpaged.model_loader.model_store import resolve_model
    from jaxpaged.models import load_config

    config = load_config(resolve_model(args.model))
    max_model_len = args.max_model_len or config.max_position_embeddings
    tokens = num_seqs * (-(-max_model_len // args.block_size) * args.block_size)
    per_token = kv_cache_bytes_per_token(
        config, resolve_kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype)))
    return min(2 << 30, tokens * per_token)


def _generate(args: argparse.Namespace) -> int:
    from jaxpaged import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens)
    num_seqs = args.n * (1 if args.command == "chat" else len(args.prompts))
    llm = _build_llm(args, one_shot=num_seqs,
                     kv_cache_memory_bytes=_one_shot_pool(args, num_seqs))
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
