"""Load generator for ``trtllm-lite serve`` over gRPC, in the manner of vLLM's serving benchmark.

    python tools/bench_serving.py --engine engines/smollm2 --concurrency 1,4,16,64
    python tools/bench_serving.py --server 127.0.0.1:50051 --request-rate 4 --num-prompts 64

Each run sends ``--num-prompts`` streaming requests of random token ids (``--input-len``
tokens in, exactly ``--max-tokens`` out: ``ignore_eos``, greedy) either closed-loop at a
fixed concurrency, or open-loop with Poisson arrivals at ``--request-rate`` requests/s
(optionally capped by ``--max-concurrency``). Client-side per request: TTFT (send -> first
token), ITL (gaps between streamed responses), TPOT ((E2E - TTFT) / (tokens - 1)) and E2E;
reported as mean / p50 / p90 / p99 with request and output-token throughput, as a table and
JSON.

``--compare-inprocess`` also runs concurrency 1 through an in-process ``AsyncLLM`` (same
engine options): request pairs on the same prompt, server and in-process back to back in
alternating order, so that drifting machine load hits both; it reports the median per-pair
E2E ratio. The concurrency sweep runs ``--rounds`` times round-robin, and ratios between
concurrencies are taken within a round. Without ``--server`` the script
starts one (``trtllm-lite serve`` on 127.0.0.1, a free port) and stops it at the end.
Prefix caching is off on both sides so that repeated prompts do not flatter either.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

from trtllm_lite.commands.bench import percentiles, random_prompts


# -- one request ---------------------------------------------------------------------------
async def grpc_request(client, prompt, max_tokens):
    """Yields the number of new tokens of each streamed response."""
    async for r in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        n = sum(len(o.token_ids) for o in r.outputs)
        if n:
            yield n


async def inprocess_request(llm, prompt, max_tokens):
    from trtllm_lite import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for out in llm.generate(prompt, params):
        n = sum(len(o.token_ids) for o in out.outputs)
        if n:
            yield n


async def timed(request_fn, prompt, max_tokens) -> dict:
    start = time.perf_counter()
    stamps, tokens = [], 0
    async for n in request_fn(prompt, max_tokens):
        stamps.append(time.perf_counter())
        tokens += n
    e2e = stamps[-1] - start
    ttft = stamps[0] - start
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens, "itl": np.diff(stamps).tolist(),
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None}


# -- one run -------------------------------------------------------------------------------
async def run_load(request_fn, prompts, max_tokens, concurrency=None, request_rate=None, seed=0) -> dict:
    """Closed loop at ``concurrency``, or Poisson arrivals at ``request_rate`` (req/s)."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    rng = np.random.default_rng(seed)

    async def one(prompt, delay):
        await asyncio.sleep(delay)
        if limit is None:
            return await timed(request_fn, prompt, max_tokens)
        async with limit:
            return await timed(request_fn, prompt, max_tokens)

    delays = (np.cumsum(rng.exponential(1.0 / request_rate, len(prompts))) if request_rate
              else np.zeros(len(prompts)))
    start = time.perf_counter()
    results = await asyncio.gather(*[one(p, float(d)) for p, d in zip(prompts, delays)])
    duration = time.perf_counter() - start
    return summarize(results, duration)


def summarize(results: list[dict], duration: float) -> dict:
    ms = lambda xs: [x * 1e3 for x in xs if x is not None]  # noqa: E731
    out = {"num_requests": len(results), "duration_s": duration,
           "request_throughput": len(results) / duration,
           "output_throughput": sum(r["tokens"] for r in results) / duration,
           "total_output_tokens": sum(r["tokens"] for r in results)}
    for name, values in (("ttft_ms", ms(r["ttft"] for r in results)), ("tpot_ms", ms(r["tpot"] for r in results)),
                         ("itl_ms", ms(x for r in results for x in r["itl"])),
                         ("e2e_ms", ms(r["e2e"] for r in results))):
        out[name] = {"mean": float(np.mean(values)) if values else None, **percentiles(values)}
    return out


def table(rows: list[tuple[str, dict]]) -> str:
    head = (f"{'run':<24}{'req/s':>7}{'out tok/s':>10}{'TTFT p50':>9}{'p90':>7}{'p99':>7}{'TPOT p50':>9}"
            f"{'p90':>7}{'p99':>7}{'ITL p50':>8}{'p99':>7}{'E2E p50':>9}{'p90':>8}{'p99':>8}   (ms)")
    lines = [head, "-" * len(head)]
    for name, r in rows:
        t, p, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2e_ms"]
        lines.append(f"{name:<24}{r['request_throughput']:>7.2f}{r['output_throughput']:>10.1f}"
                     f"{t['p50']:>9.0f}{t['p90']:>7.0f}{t['p99']:>7.0f}{p['p50']:>9.1f}{p['p90']:>7.1f}{p['p99']:>7.1f}"
                     f"{i['p50']:>8.1f}{i['p99']:>7.1f}{e['p50']:>9.0f}{e['p90']:>8.0f}{e['p99']:>8.0f}")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/smollm2", help="engine dir (to start a server, or in-process)")
    p.add_argument("--server", default=None, help="host:port of a running server (default: start one)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated fixed concurrencies")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals (req/s) instead")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap with --request-rate")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per run (default: 2 x concurrency, >= 8)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=os.cpu_count())
    p.add_argument("--compare-inprocess", action="store_true", help="also concurrency 1 through AsyncLLM")
    p.add_argument("--rounds", type=int, default=2, help="round-robin rounds of the concurrency sweep")
    p.add_argument("--num-pairs", type=int, default=8, help="paired requests for --compare-inprocess")
    p.add_argument("--json", default=None, help="write all results here")
    return p.parse_args(argv)


async def paired_c1(fn, local, args, vocab) -> dict:
    """Concurrency 1, server and in-process alternately on the same prompt (the order
    flips every pair), so that drifting machine load hits both: per-pair E2E ratios."""
    server, inproc, ratios = [], [], []
    prompts = random_prompts(args.num_pairs, args.input_len, vocab, seed=7)
    for k, prompt in enumerate(prompts):
        order = [(fn, server), (local, inproc)] if k % 2 == 0 else [(local, inproc), (fn, server)]
        for f, sink in order:
            sink.append(await timed(f, prompt, args.max_tokens))
        ratios.append(server[-1]["e2e"] / inproc[-1]["e2e"])
        print(f"  pair {k + 1}/{len(prompts)}: server {server[-1]['e2e'] * 1e3:.0f} ms, in-process "
              f"{inproc[-1]['e2e'] * 1e3:.0f} ms", flush=True)
    return {"grpc c=1 (paired)": summarize(server, sum(r["e2e"] for r in server)),
            "inprocess c=1 (paired)": summarize(inproc, sum(r["e2e"] for r in inproc)),
            "e2e_ratio": {"median": float(np.median(ratios)), "mean": float(np.mean(ratios)),
                          "all": ratios}}


async def bench(args, target: str, vocab: int) -> dict:
    from trtllm_lite.serving.client import AsyncLLMClient

    results: dict = {"runs": {}}
    async with AsyncLLMClient(target, api_key=args.api_key, timeout=3600) as client:
        fn = lambda prompt, n: grpc_request(client, prompt, n)  # noqa: E731
        await run_load(fn, random_prompts(2, args.input_len, vocab, seed=1), 4, concurrency=2)  # warm-up
        if args.compare_inprocess:
            from trtllm_lite import AsyncLLM

            llm = AsyncLLM(args.engine, num_threads=args.num_threads, verify_checksums=False,
                           enable_prefix_caching=False)
            local = lambda prompt, n: inprocess_request(llm, prompt, n)  # noqa: E731
            await run_load(local, random_prompts(2, args.input_len, vocab, seed=1), 4, concurrency=2)
            paired = await paired_c1(fn, local, args, vocab)
            llm.shutdown()
            results["paired"] = paired
        if args.request_rate:
            n = args.num_prompts or 64
            res = await run_load(fn, random_prompts(n, args.input_len, vocab, seed=3), args.max_tokens,
                                 args.max_concurrency, args.request_rate)
            results["runs"][f"grpc rate={args.request_rate:g}"] = [res]
            return results
        seed = 100
        for r in range(args.rounds):          # round-robin: each concurrency sees every load phase
            for c in [int(x) for x in args.concurrency.split(",") if x]:
                seed += 1
                n = args.num_prompts or max(4, 2 * c if c < 64 else c)
                res = await run_load(fn, random_prompts(n, args.input_len, vocab, seed=seed), args.max_tokens, c)
                results["runs"].setdefault(f"grpc c={c}", []).append(res)
                print(f"  round {r + 1} grpc c={c}: {res['output_throughput']:.1f} output tokens/s, "
                      f"TPOT p50 {res['tpot_ms']['p50']:.1f} ms", flush=True)
    return results


def merge_rounds(runs: list[dict]) -> dict:
    """Rounds of one configuration: the round with the median output throughput stands for them."""
    return sorted(runs, key=lambda r: r["output_throughput"])[(len(runs) - 1) // 2]


def main(argv=None) -> int:
    args = parse_args(argv)
    from trtllm_lite.engine_dir import load_engine_dir

    vocab = load_engine_dir(args.engine, verify_checksums=False).model["vocab_size"]
    load_before = os.getloadavg()
    server = None
    if args.server is None:
        from trtllm_lite.serving.process import ServerProcess

        server = ServerProcess(args.engine, "--num-threads", str(args.num_threads), "--no-verify-checksums",
                               "--no-prefix-caching", "--max-waiting-requests", "100000", metrics=False)
    try:
        results = asyncio.run(bench(args, args.server or server.grpc, vocab))
    finally:
        if server is not None:
            server.stop()
    rows = [(name, merge_rounds(runs)) for name, runs in results["runs"].items()]
    paired = results.get("paired")
    if paired:
        rows = [(k, paired[k]) for k in ("grpc c=1 (paired)", "inprocess c=1 (paired)")] + rows
    print(table(rows))
    if paired:
        ratio = paired["e2e_ratio"]["median"]
        results["server_e2e_overhead"] = ratio - 1
        print(f"server vs in-process AsyncLLM at concurrency 1 ({len(paired['e2e_ratio']['all'])} paired "
              f"requests): median E2E ratio {ratio:.3f} ({100 * (ratio - 1):+.1f}%)")
    runs = results["runs"]
    if "grpc c=1" in runs and "grpc c=16" in runs:
        per_round = [b["output_throughput"] / a["output_throughput"] for a, b in zip(runs["grpc c=1"], runs["grpc c=16"])]
        results["throughput_16_over_1"] = {"median": float(np.median(per_round)), "per_round": per_round}
        print(f"output tokens/s at concurrency 16 / concurrency 1 (per round {', '.join(f'{x:.2f}' for x in per_round)}):"
              f" median {np.median(per_round):.2f}x")
    load_after = os.getloadavg()
    results.update(load_average_before=load_before, load_average_after=load_after, cores=os.cpu_count(),
                   args=vars(args))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
