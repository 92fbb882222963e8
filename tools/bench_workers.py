"""One benchmark worker per system, each in its own process (so its peak RSS is its own).

``python tools/bench.py --worker SYSTEM --spec spec.json --out result.json``; the spec
(written by :mod:`bench`) holds paths, threads and the workloads as token ids, so every
system gets the very same prompts. Systems: ``ours`` (an engine directory, accuracy level
from ``TRTLLM_LITE_ORT_ACCURACY_LEVEL``), ``hf``, ``genai`` (a model directory), ``llamacpp``,
``paired`` (batch-1 decode of our engines and genai's in alternating rounds in one
process: :func:`run_paired`) and ``paired-random`` (the 64 random-length requests through our
fp32 engine against genai fp32 one at a time, in alternating rounds: :func:`run_paired_random`).
"""
from __future__ import annotations

import functools
import json
import os
import resource
import time

from bench_peers import GenAIPeer, HFPeer, LlamaCppPeer


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: ``VmHWM`` from ``/proc/self/status``
    (``ru_maxrss`` would carry the parent's peak across ``exec``)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def local_gemm_rate(threads: int) -> float:
    """The float32 GEMM rate now (FLOP/s): the higher of MLAS's and numpy's
    (:func:`bench_bounds.float_gemm_rates`), as the suite's compute bound takes it."""
    import bench_bounds

    return max(bench_bounds.float_gemm_rates(threads))


def run_ours(spec: dict, engine_path: str, full: bool) -> dict:
    from trtllm_lite.commands.bench import greedy_ids, measure_latency, run_requests
    from trtllm_lite.core.llm_engine import LLMEngine, default_max_num_batched_tokens

    t0 = time.monotonic()
    engine = LLMEngine(engine_path, num_threads=spec["threads"], verify_checksums=False,
                       enable_prefix_caching=False, kv_cache_memory_bytes=spec["kv_cache_bytes"])
    load_s = time.monotonic() - t0     # with the pool's prefault (kv_cache_prefault, the default)
    out = {"latency": {}, "greedy": [greedy_ids(engine, p, spec["greedy_tokens"]) for p in spec["test_prompts"]]}
    for i, n in enumerate(spec["ttft_lens"]):
        lat = measure_latency(engine, n, spec["decode_tokens"] if i == 0 else 1)
        out["latency"][str(n)] = lat["ttft_ms"]
        if i == 0:
            out["decode_tokens_per_s"] = lat["decode_tokens_per_s"]
            out["host_overhead_batch1"] = lat["host_overhead"]
    if full:
        # offline throughput runs with the offline LLM class's token budget, the latency and
        # concurrency (serving) figures with the server's (one engine, so one peak RSS)
        serving_budget = engine.scheduler_config.max_num_batched_tokens
        engine.scheduler_config.max_num_batched_tokens = default_max_num_batched_tokens(
            engine.engine.build, engine.scheduler_config.max_num_seqs, offline=True)
        out["offline_max_num_batched_tokens"] = engine.scheduler_config.max_num_batched_tokens
        try:
            for name in ("random", "equal"):
                w = spec[name]
                before = local_gemm_rate(spec["threads"]) if name == "equal" else None
                out[name] = run_requests(engine, w["prompts"], w["max_tokens"], len(w["prompts"])).to_dict()
                if before is not None:   # this VM's speed moves between minutes: a bound of its own
                    out[name]["gemm_rate_local"] = max(before, local_gemm_rate(spec["threads"]))
        finally:   # the serving budget again, even when a workload raised
            engine.scheduler_config.max_num_batched_tokens = serving_budget
        out["sweep"] = []
        for c in spec["sweep"]["concurrency"]:
            n = max(2 * c, 4)
            r = run_requests(engine, spec["sweep"]["prompts"][:n], spec["sweep"]["max_tokens"], c)
            out["sweep"].append(r.to_dict())
    runner = engine.runner
    # the model's weights once: a float32 engine's FloatLinear panels are the same weights again
    # (builder.fused_ops.use_float_linears), which its sessions read instead of the row-major ones
    out["memory"] = {"weights_bytes": sum(t["nbytes"] for n, t in engine.engine.manifest["weights"]["tensors"].items()
                                          if not n.endswith(".panels")),
                     "kv_pool_bytes": int(runner.key_cache.nbytes + runner.value_cache.nbytes),
                     "kv_bytes_per_block": runner.kv_bytes_per_block,
                     "kv_cache_prefault": engine.kv_cache_prefault, "load_s": load_s}
    return out


def run_paired(spec: dict) -> dict:
    """Batch-1 decode of our fp32 and int4 engines and onnxruntime-genai fp32 and int4, all
    loaded in this one process, in ``spec["paired"]["rounds"]`` rounds; each round first probes the read
    bandwidth, then runs every system once (128-token prompt, ``decode_tokens`` tokens; the
    order rotates by a place each round). On a VM whose speed moves between minutes, ratios
    within a round compare like with like, where the sequential workers' ratios take figures
    minutes apart. Every rate is 1 / TPOT of one request: the mean time of a token after the
    first.

    Returns ``{"rounds": [{"read_bandwidth": bytes/s, system: tokens/s, ...}, ...]}``.
    """
    import bench_bounds
    from trtllm_lite.commands.bench import measure_latency
    from trtllm_lite.core.llm_engine import LLMEngine

    paired, threads = spec["paired"], spec["threads"]
    prompt_len, n = spec["ttft_lens"][0], spec["decode_tokens"]
    prompt = spec["latency_prompts"][str(prompt_len)]
    def ours_rate(engine) -> float:
        return measure_latency(engine, prompt_len, n, repeats=1)["decode_tokens_per_s"]

    rates = {name: functools.partial(ours_rate, LLMEngine(
                 path, num_threads=threads, verify_checksums=False, enable_prefix_caching=False,
                 kv_cache_memory_bytes=256 << 20))
             for name, path in paired["engines"].items()}
    for name, model_dir in (paired.get("genai") or {}).items():
        genai = GenAIPeer(model_dir, threads)
        genai.tpot_rate(prompt, 4)      # warm-up
        rates[name] = functools.partial(genai.tpot_rate, prompt, n)
    systems, rounds = list(rates), []
    for r in range(paired["rounds"]):
        # BLAS's GEMV first, and a pause after the probe: OpenBLAS's threads spin a while after
        # a call (bench.measure_bounds)
        row = {"read_bandwidth": max(bench_bounds.gemv_bandwidth(), bench_bounds.read_bandwidth(threads))}
        time.sleep(0.5)
        for name in systems[r % len(systems):] + systems[:r % len(systems)]:
            row[name] = rates[name]()
        rounds.append(row)
    return {"rounds": rounds}


def run_paired_random(spec: dict) -> dict:
    """The 64 random-length requests through our fp32 engine (inflight batching, the offline
    token budget) and onnxruntime-genai fp32 one request at a time (the first
    ``genai_requests`` of them), both loaded in this one process, in
    ``spec["paired_random"]["rounds"]`` rounds whose order alternates: the issue's 5x ratio
    from figures a minute apart, not from workers many minutes apart on a VM whose speed moves.

    Returns ``{"rounds": [{"ours-fp32": output tokens/s, "genai-fp32": output tokens/s}, ...]}``.
    """
    from trtllm_lite.commands.bench import run_requests
    from trtllm_lite.core.llm_engine import LLMEngine

    paired, threads, w = spec["paired_random"], spec["threads"], spec["random"]
    n = spec["genai_requests"]
    max_tokens = _list(w["max_tokens"], w["prompts"])
    engine = LLMEngine(paired["engine"], num_threads=threads, verify_checksums=False, enable_prefix_caching=False,
                       kv_cache_memory_bytes=spec["kv_cache_bytes"], offline=True)
    genai = GenAIPeer(paired["genai"], threads)
    genai.tpot_rate(w["prompts"][0], 4)      # warm-up
    runs = {"ours-fp32": lambda: run_requests(engine, w["prompts"], max_tokens, len(w["prompts"])).output_tokens_per_s,
            "genai-fp32": lambda: genai.sequential(w["prompts"][:n], max_tokens[:n])["output_tokens_per_s"]}
    rounds = []
    for r in range(paired["rounds"]):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        rounds.append({name: runs[name]() for name in order})
    return {"rounds": rounds}


def run_peer(spec: dict, peer, full: bool) -> dict:
    out = {"latency": {}, "greedy": [peer.generate_ids(p, spec["greedy_tokens"]) for p in spec["test_prompts"]]}
    prompt = spec["latency_prompts"][str(spec["ttft_lens"][0])]
    lat = peer.latency(prompt, spec["decode_tokens"])
    out["decode_tokens_per_s"] = lat["decode_tokens_per_s"]
    for n in spec["ttft_lens"]:
        out["latency"][str(n)] = peer.latency(spec["latency_prompts"][str(n)], 2, repeats=1)["ttft_ms"]
    if full and isinstance(peer, HFPeer):
        for name in ("random", "equal"):
            w = spec[name]
            out[name] = peer.static_batches(w["prompts"], _list(w["max_tokens"], w["prompts"]), spec["hf_batch"])
    if full and isinstance(peer, (GenAIPeer, LlamaCppPeer)):   # no batching across requests
        w, n = spec["random"], spec["genai_requests"]
        out["random_sequential"] = peer.sequential(w["prompts"][:n], _list(w["max_tokens"], w["prompts"])[:n])
    return out


def _list(max_tokens, prompts) -> list[int]:
    return [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)


def main(system: str, spec_path: str, out_path: str, target: str | None, full: bool) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    load0 = os.getloadavg()
    if system == "ours":
        result = run_ours(spec, target, full)
    elif system == "hf":
        result = run_peer(spec, HFPeer(spec["hf_model"], spec["threads"]), full)
    elif system == "genai":
        result = run_peer(spec, GenAIPeer(target, spec["threads"]), full)
    elif system == "paired":
        result = run_paired(spec)
    elif system == "paired-random":
        result = run_paired_random(spec)
    elif system == "llamacpp":
        result = run_peer(spec, LlamaCppPeer(spec["gguf"], spec["threads"]), full)
    else:
        raise ValueError(f"unknown worker system {system!r}")
    result.update(peak_rss_bytes=peak_rss_bytes(), load_before=load0, load_after=os.getloadavg())
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0
