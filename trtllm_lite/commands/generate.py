"""``trtllm-lite generate``: one prompt, answer printed as it is generated."""
from __future__ import annotations

import argparse
import asyncio
import sys

from ..async_llm import AsyncLLM
from ..sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user message)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default 1: all tokens)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=None, help="the request's sampling seed (default: none)")
    p.add_argument("--stats", action="store_true",
                   help="print TTFT, end-to-end time, decode speed (tokens after the first over the time "
                        "after it), the finish reason and the engine's step count to stderr")


async def _stream(llm: AsyncLLM, prompt, params: SamplingParams):
    """Print the answer as it streams; returns the last output (a delta) and the tokens generated."""
    last, tokens = None, 0
    async for out in llm.generate(prompt, params):
        sys.stdout.write(out.outputs[0].text)
        sys.stdout.flush()
        last, tokens = out, tokens + len(out.outputs[0].token_ids)
    sys.stdout.write("\n")
    return last, tokens


def run(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:   # (QA, session 34: it was silently dropped)
        raise ValueError("--system is a chat message: it needs --chat")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = AsyncLLM(args.engine, kv_cache_prefault=False)   # one request: commit only the blocks it writes
    try:
        prompt = args.prompt
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        last, tokens = asyncio.run(_stream(llm, prompt, params))
        if args.stats and last is not None:
            m, n = last.metrics, llm.engine.stats()
            speed = (f", decode {(tokens - 1) / (m.e2e - m.ttft):.1f} tokens/s"
                     if tokens > 1 and m.e2e > m.ttft else "")
            print(f"[ttft {m.ttft * 1e3:.0f} ms, e2e {m.e2e * 1e3:.0f} ms{speed}, "
                  f"finish {last.outputs[0].finish_reason}, steps {n['num_steps']}]", file=sys.stderr)
    finally:
        llm.shutdown()
    return 0
