"""Issue #2's figures in one short run: SmolLM2 fp32 against HF transformers on the same weights.

    python tools/bench_core.py [--engine engines/smollm2] [--num-threads 2]

Measures, in one process and one run:
  * batch-1 decode tokens/s and TTFT (128-token prompt) of our engine and of HF
    transformers ``generate`` on the same dequantized GGUF weights;
  * output tokens/s of 16 concurrent requests (128 in / 64 out) against batch 1 (the same
    16 requests one at a time).
The engine is built (fp32, from the GGUF) when ``--engine`` does not exist yet.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers import HFPeer  # noqa: E402

from trtllm_lite.commands.bench import greedy_ids, measure_latency, random_prompts, run_requests  # noqa: E402

MODEL = "smollm2-135m-instruct"


def ensure_engine(path: str, model: str = MODEL, **build_options) -> str:
    """Build ``model`` into ``path`` unless an engine built with these ``build_options``
    (``BuildConfig`` fields) by this builder code (``builder.build.builder_revision``) is
    already there; one built with other values or other builder code is rebuilt."""
    from builder.build import BuildConfig, build_engine, builder_revision

    manifest = os.path.join(path, "engine.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            m = json.load(f)
        built = m.get("build", {})
        stale = {k: built.get(k) for k, v in build_options.items() if built.get(k) != v}
        revision = m.get("versions", {}).get("builder")
        if revision != builder_revision():
            stale["builder revision"] = revision
        if not stale:
            return path
        print(f"{path} was built with {stale}: rebuilding", file=sys.stderr)

    build_engine(model, path, BuildConfig(**build_options))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/smollm2")
    p.add_argument("--num-threads", type=int, default=os.cpu_count())
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from builder.loaders import resolve_model_path
    from trtllm_lite.core.llm_engine import LLMEngine

    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    engine = LLMEngine(ensure_engine(args.engine), num_threads=args.num_threads, verify_checksums=False,
                       enable_prefix_caching=False)
    vocab = engine.model_config["vocab_size"]
    prompt = random_prompts(1, args.prompt_len, vocab, seed=1)[0]

    ours = measure_latency(engine, args.prompt_len, args.max_tokens)
    hf = HFPeer(resolve_model_path(MODEL), args.num_threads)
    theirs = hf.latency(prompt, args.max_tokens)
    same = hf.generate_ids(prompt, 32) == greedy_ids(engine, prompt, 32)

    prompts = random_prompts(args.concurrency, args.prompt_len, vocab, seed=2)
    one = run_requests(engine, prompts, args.max_tokens, concurrency=1)
    many = run_requests(engine, prompts, args.max_tokens, concurrency=args.concurrency)
    load = os.getloadavg()

    rows = [
        ("batch-1 decode tokens/s", ours["decode_tokens_per_s"], theirs["decode_tokens_per_s"]),
        (f"TTFT, {args.prompt_len}-token prompt (ms)", ours["ttft_ms"], theirs["ttft_ms"]),
    ]
    print(f"\n| SmolLM2 fp32, {args.num_threads} threads | trtllm-lite | HF transformers | ratio |")
    print("|---|---:|---:|---:|")
    for name, a, b in rows:
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    print(f"\ngreedy ids identical to HF (32 tokens): {same}")
    print(f"\n| {args.concurrency} requests, {args.prompt_len} in / {args.max_tokens} out | output tokens/s |")
    print("|---|---:|")
    print(f"| one at a time (batch 1) | {one.output_tokens_per_s:.1f} |")
    print(f"| {args.concurrency} concurrent | {many.output_tokens_per_s:.1f} "
          f"({many.output_tokens_per_s / one.output_tokens_per_s:.2f}x) |")
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ours": ours, "hf": theirs, "greedy_identical": same, "batch1": one.to_dict(),
                       "concurrent": many.to_dict(), "load_after": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
