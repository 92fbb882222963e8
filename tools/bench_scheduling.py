"""Issue #4's figures: prefix caching TTFT, chunked prefill ITL, KV waste (SmolLM2 fp32).

    python tools/bench_scheduling.py [--engine engines/smollm2] [--json out.json]

All in one process on one engine; each comparison runs both arms in the same run:
  1. a ~1000-token shared system prompt + short distinct questions, one request at a time:
     median TTFT with prefix caching vs without;
  2. 8 running decodes while ~1500-token prompts arrive: p99 inter-token latency (ITL) of the
     running decodes and output throughput, chunked prefill (budget 256) vs unchunked;
  3. a mixed workload (random prompt 16-512 and output 16-256 tokens): KV waste = allocated
     slots minus tokens held, over allocated slots, averaged over steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_core import ensure_engine  # noqa: E402

from trtllm_lite import SamplingParams  # noqa: E402
from trtllm_lite.core.llm_engine import LLMEngine  # noqa: E402


def ttft_shared_prefix(engine_dir: str, caching: bool, n: int = 8) -> float:
    engine = LLMEngine(engine_dir, enable_prefix_caching=caching, verify_checksums=False)
    tok = engine.tokenizer
    system = " ".join(["You are a careful assistant for a hardware store; answer briefly and cite the aisle."] * 60)
    ttfts = []
    for i in range(n + 1):
        text = tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": f"Question {i}: where are the {['nails', 'saws', 'hoses', 'paints', 'bulbs', 'tapes', 'glues', 'locks', 'drills'][i]}?"}])
        ids = tok.encode(text, add_special_tokens=False)
        rid = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i:                                  # the first request only warms the cache
            ttfts.append(time.perf_counter() - t0)
        del rid
    return float(np.median(ttfts)), len(ids)


def itl_with_long_prompts(engine_dir: str, chunked: bool) -> dict:
    engine = LLMEngine(engine_dir, enable_chunked_prefill=chunked, enable_prefix_caching=False,
                       max_num_batched_tokens=256 if chunked else 2048, verify_checksums=False)
    rng = np.random.default_rng(0)
    decoders = [engine.add_request(rng.integers(200, 30000, 32).tolist(),
                                   SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)) for _ in range(8)]
    long_at = {12: 0, 40: 1, 70: 2}
    stamps: dict[str, list[float]] = {r: [] for r in decoders}
    total_out, step = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if step in long_at:
            engine.add_request(rng.integers(200, 30000, 1500).tolist(),
                               SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        for out in engine.step():
            total_out += len(out.outputs[0].token_ids)
            if out.request_id in stamps:
                stamps[out.request_id].append(time.perf_counter())
        step += 1
    elapsed = time.perf_counter() - t0
    itls = np.concatenate([np.diff(v) for v in stamps.values()])
    return {"p50_itl_ms": float(np.percentile(itls, 50) * 1e3), "p99_itl_ms": float(np.percentile(itls, 99) * 1e3),
            "max_itl_ms": float(itls.max() * 1e3), "output_tokens_per_s": total_out / elapsed}


def kv_waste(engine_dir: str) -> float:
    engine = LLMEngine(engine_dir, verify_checksums=False, enable_prefix_caching=False)
    rng = np.random.default_rng(1)
    for _ in range(48):
        engine.add_request(rng.integers(200, 30000, int(rng.integers(16, 513))).tolist(),
                           SamplingParams(max_tokens=int(rng.integers(16, 257)), temperature=0, ignore_eos=True))
    waste = []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.kv.stats(engine.scheduler.running)
        if s["blocks_used"]:
            waste.append(s["kv_waste_fraction"])
    return float(np.mean(waste))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/smollm2")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    engine_dir = ensure_engine(args.engine)
    load = os.getloadavg()[0]
    (cached, n_prompt), (uncached, _) = ttft_shared_prefix(engine_dir, True), ttft_shared_prefix(engine_dir, False)
    chunked, unchunked = itl_with_long_prompts(engine_dir, True), itl_with_long_prompts(engine_dir, False)
    waste = kv_waste(engine_dir)
    result = {"load_avg_before": load, "load_avg_after": os.getloadavg()[0],
              "prefix_caching": {"prompt_tokens": n_prompt, "median_ttft_ms_cached": cached * 1e3,
                                 "median_ttft_ms_uncached": uncached * 1e3, "speedup": uncached / cached},
              "chunked_prefill": {"chunked_256": chunked, "unchunked": unchunked,
                                  "p99_itl_ratio": unchunked["p99_itl_ms"] / chunked["p99_itl_ms"],
                                  "throughput_ratio": chunked["output_tokens_per_s"] / unchunked["output_tokens_per_s"]},
              "kv_waste_fraction": waste}
    print(json.dumps(result, indent=1))
    print(f"\n| figure | value |\n|---|---:|\n"
          f"| median TTFT, {n_prompt}-token prompt sharing a ~1000-token system prompt: no cache / cache | "
          f"{uncached * 1e3:.0f} ms / {cached * 1e3:.0f} ms = {uncached / cached:.1f}x |\n"
          f"| p99 ITL of 8 running decodes with 1500-token prompts arriving: unchunked / chunked (256) | "
          f"{unchunked['p99_itl_ms']:.0f} ms / {chunked['p99_itl_ms']:.0f} ms = {result['chunked_prefill']['p99_itl_ratio']:.1f}x |\n"
          f"| output tokens/s, chunked / unchunked | {chunked['output_tokens_per_s']:.1f} / "
          f"{unchunked['output_tokens_per_s']:.1f} = {result['chunked_prefill']['throughput_ratio']:.2f} |\n"
          f"| KV waste, mixed workload (mean over steps) | {waste * 100:.2f}% |\n"
          f"load average {load:.1f} before, {result['load_avg_after']:.1f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
