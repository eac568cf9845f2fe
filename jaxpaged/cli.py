"""Command line: `jaxpaged generate`, `jaxpaged chat`, `jaxpaged prepare`."""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local Hugging Face folder; default: embedded SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto", help="auto (f32 on CPU, bf16 on GPU), float32, ...")
    g.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="blocks in the KV pool")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "pallas", "pallas-interpret", "xla"])
    g.add_argument("--seed", type=int, default=None, help="sampling seed")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")


def build_parser() -> argparse.ArgumentParser:
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
    sub.add_parser("prepare", help="import the embedded default model into $JAXPAGED_HOME")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "prepare":
            from jaxpaged.model_store import ensure_default_model
            print(ensure_default_model())
            return 0
        return _generate(args)
    except ValueError as e:
        print(f"jaxpaged: error: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from jaxpaged import LLM, SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, block_size=args.block_size,
              num_kv_blocks=args.num_kv_blocks, attention_backend=args.attention_backend)
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
