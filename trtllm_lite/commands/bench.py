"""``trtllm-lite bench``: latency and throughput of one engine (no peers, no torch).

The measurements here drive the engine through its public step API; ``tools/bench.py``
reuses them and adds the peers (HF transformers, onnxruntime-genai, llama.cpp) and the
bandwidth / compute bounds. Terms as in vLLM's benchmarks:

* TTFT: request arrival to its first output token (ms), on an idle engine for latency runs.
* TPOT: (finish - first token) / (output tokens - 1), per request (ms).
* batch-1 decode tokens/s: ``1 / TPOT`` of a lone request.
* output tokens/s: all requests' output tokens over the run's wall time;
  total tokens/s adds the prompt tokens.

Prompts are random token ids from a seeded generator (ids 1000..vocab-1, no special
tokens; vocab/2..vocab-1 for a vocabulary under 2,000) and every request is greedy with
``ignore_eos`` so each produces exactly its ``max_tokens``: runs are repeatable and peers can
be fed the very same ids.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from ..sampling_params import SamplingParams


def random_prompts(num: int, lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of random token ids in ``[1000, vocab_size)`` (``[vocab_size // 2,
    vocab_size)`` for a vocabulary under 2,000: a tiny test model's); ``lengths`` is an int or
    a sequence of ``num`` ints."""
    rng = np.random.default_rng(seed)
    lens = [int(lengths)] * num if np.isscalar(lengths) else [int(x) for x in lengths]
    low = min(1000, vocab_size // 2)
    return [rng.integers(low, vocab_size, n).tolist() for n in lens]


def random_lengths(num: int, low: int, high: int, seed: int) -> list[int]:
    """``num`` ints uniform in ``[low, high]`` from a seeded generator."""
    return np.random.default_rng(seed).integers(low, high + 1, num).tolist()


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., ...}`` of ``values`` (empty dict when there are none)."""
    values = [v for v in values if v is not None]
    return {f"p{q}": float(np.percentile(values, q)) for q in qs} if values else {}


@dataclass
class RunResult:
    """One run of ``num_requests`` requests at a given concurrency.

    Times in seconds except the ``*_ms`` percentile dicts; rates in tokens/s.
    """

    num_requests: int
    concurrency: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    num_steps: int = 0
    peak_kv_blocks: int = 0
    host_overhead: float | None = None   # share of wall time outside graph runs (Python, numpy)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(output_tokens_per_s=self.output_tokens_per_s, total_tokens_per_s=self.total_tokens_per_s)
        return d


def run_requests(engine, prompts: list[list[int]], max_tokens: list[int] | int,
                 concurrency: int | None = None) -> RunResult:
    """Drive ``engine`` (an :class:`~trtllm_lite.core.llm_engine.LLMEngine`) closed-loop.

    At most ``concurrency`` requests are in flight (default: all at once); a finished
    request is replaced by the next one before the following step, as a client pool would.
    Every request is greedy with ``ignore_eos``, so it yields exactly its ``max_tokens``.
    """
    n = len(prompts)
    max_tokens = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    concurrency = concurrency or n
    pending, in_flight = deque(range(n)), set()
    ttft, tpot, out_tokens, peak_blocks = [], [], 0, 0
    steps0 = engine.num_steps
    graph0 = getattr(engine.runner, "graph_time_s", None)
    t0 = time.monotonic()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i = pending.popleft()
            params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
            in_flight.add(engine.add_request(prompts[i], params, request_id=f"bench-{i}"))
        outputs = engine.step()
        peak_blocks = max(peak_blocks, engine.kv.pool.num_used)
        for out in outputs:
            if not out.finished:
                continue
            in_flight.discard(out.request_id)
            m, k = out.metrics, max_tokens[int(out.request_id[6:])]
            out_tokens += k
            ttft.append(m.ttft * 1e3)
            if k > 1:
                tpot.append((m.finished_time - m.first_token_time) / (k - 1) * 1e3)
    wall = time.monotonic() - t0
    host = None if graph0 is None else 1.0 - (engine.runner.graph_time_s - graph0) / wall
    return RunResult(n, concurrency, wall, sum(len(p) for p in prompts), out_tokens,
                     percentiles(ttft), percentiles(tpot), engine.num_steps - steps0, peak_blocks, host)


def greedy_ids(engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy output ids of one request (``ignore_eos``) through ``engine``, run alone."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ids = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                ids.extend(out.outputs[0].token_ids)
    return ids


def measure_latency(engine, prompt_len: int, max_tokens: int, repeats: int = 3, seed: int = 0
                    ) -> dict[str, float]:
    """Lone-request latency: median TTFT (ms) and batch-1 decode tokens/s over ``repeats``.

    One unmeasured warm-up run first.
    """
    vocab = engine.model_config["vocab_size"]
    prompt = random_prompts(1, prompt_len, vocab, seed)
    run_requests(engine, prompt, min(max_tokens, 4))
    ttft, tpot = [], []
    for _ in range(repeats):
        r = run_requests(engine, prompt, max_tokens)
        ttft.append(r.ttft_ms["p50"])
        tpot.append(r.tpot_ms.get("p50"))
    result = {"prompt_len": prompt_len, "max_tokens": max_tokens, "ttft_ms": float(np.median(ttft)),
              "host_overhead": r.host_overhead}
    if max_tokens > 1:
        result["tpot_ms"] = float(np.median(tpot))
        result["decode_tokens_per_s"] = 1e3 / result["tpot_ms"]
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--num-threads", type=int, default=None, help="intra-op threads (default: all cores)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512],
                   help="TTFT prompt lengths (tokens)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated for batch-1 decode")
    p.add_argument("--num-requests", type=int, default=16, help="requests in the throughput run")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of each throughput request (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="tokens each throughput request generates (default 64)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16],
                   help="requests in flight (one throughput run each)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids (default 0)")
    p.add_argument("--accuracy-level", type=int, choices=[0, 4], default=None,
                   help="MatMulNBits compute precision of a quantized engine (default: as built)")
    p.add_argument("--no-spinning", action="store_true",
                   help="ONNX Runtime worker threads sleep between operators (shared cores)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse counts below 1 and a ``--json`` file that cannot be opened for writing, before
    the engine loads (QA 25: a count of 0 failed with a KeyError after the latency runs, an
    unwritable path after the whole run).

    Raises:
        ValueError: naming the flag.
    """
    counts = {"--num-requests": [args.num_requests], "--input-len": [args.input_len],
              "--output-len": [args.output_len], "--decode-tokens": [args.decode_tokens],
              "--prompt-lens": args.prompt_lens, "--concurrency": args.concurrency}
    for flag, values in counts.items():
        if any(v < 1 for v in values):
            raise ValueError(f"{flag} must be at least 1, got {' '.join(map(str, values))}")
    if args.json:   # opened for appending, as the run will write it (os.access says yes to root)
        existed = os.path.exists(args.json)
        try:
            with open(args.json, "a"):
                pass
        except OSError as e:
            raise ValueError(f"--json {args.json!r} cannot be written: {e.strerror}") from None
        if not existed:
            os.remove(args.json)


def check_lengths(args: argparse.Namespace, max_model_len: int) -> None:
    """Refuse prompt and output lengths past the engine's ``max_model_len`` before the first
    run (QA 25: the default 512-token TTFT prompt failed a 256-token engine after the 128-token
    one had run).

    Raises:
        ValueError: naming the flags and the limit.
    """
    runs = [("--prompt-lens", n, "--decode-tokens" if i == 0 else "1 token", args.decode_tokens if i == 0 else 1)
            for i, n in enumerate(args.prompt_lens)]
    runs.append(("--input-len", args.input_len, "--output-len", args.output_len))
    for flag, n, out_flag, out in runs:
        if n + out > max_model_len:
            raise ValueError(f"{flag} {n} + {out_flag} ({out}) exceed the engine's max_model_len "
                             f"({max_model_len} tokens)")


def run(args: argparse.Namespace) -> int:
    from ..core.llm_engine import LLMEngine

    check_arguments(args)
    if args.accuracy_level is not None:
        os.environ["TRTLLM_LITE_ORT_ACCURACY_LEVEL"] = str(args.accuracy_level)
    if args.no_spinning:
        os.environ["TRTLLM_LITE_ORT_SPINNING"] = "0"
    engine = LLMEngine(args.engine, num_threads=args.num_threads, verify_checksums=False,
                       enable_prefix_caching=False)  # repeated prompts must not hit the cache
    check_lengths(args, engine.max_model_len)
    vocab = engine.model_config["vocab_size"]
    results = {"latency": [], "throughput": []}
    for n in args.prompt_lens:
        lat = measure_latency(engine, n, args.decode_tokens if n == args.prompt_lens[0] else 1)
        results["latency"].append(lat)
        extra = f", decode {lat['decode_tokens_per_s']:.1f} tokens/s" if "decode_tokens_per_s" in lat else ""
        print(f"prompt {n:5d} tokens: TTFT {lat['ttft_ms']:.1f} ms{extra}")
    prompts = random_prompts(args.num_requests, args.input_len, vocab, args.seed)
    for c in args.concurrency:
        r = run_requests(engine, prompts, args.output_len, c)
        results["throughput"].append(r.to_dict())
        print(f"{args.num_requests} requests x {args.input_len} in / {args.output_len} out, concurrency "
              f"{c:3d}: {r.output_tokens_per_s:.1f} output tokens/s, {r.total_tokens_per_s:.1f} total "
              f"tokens/s, TTFT p50 {r.ttft_ms['p50']:.0f} ms, TPOT p50 {r.tpot_ms.get('p50', 0):.1f} ms"
              + (f", host work {r.host_overhead:.1%} of wall" if r.host_overhead is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
