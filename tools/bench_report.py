"""Turn the suite's results into tables, target checks, JSON, a PNG and the docs section."""
from __future__ import annotations

import json
import os
import time

import numpy as np

import bench_bounds

BEGIN, END = "<!-- bench.py:cpu begin -->", "<!-- bench.py:cpu end -->"
NAMES = {"ours-fp32": "trtllm-lite fp32", "ours-fp32-kv16": "trtllm-lite fp32, float16 KV cache",
         "ours-int4": "trtllm-lite int4 (GGUF Q4_1, accuracy 0)",
         "ours-int4-acc4": "trtllm-lite int4, accuracy_level 4 (int8 activations)",
         "ours-w8a8": "trtllm-lite w8a8, rotated (int8 weights per channel, lm_head too; activations as two int8 planes "
                      "per token; float16 KV cache)",
         "ours-w8a8-1plane": "trtllm-lite w8a8, one activation plane, rotated (W8A8 with QuaRot's rotations; int8 lm_head, float16 KV cache)",
         "hf": "HF transformers fp32", "genai-fp32": "onnxruntime-genai fp32",
         "genai-int4": "onnxruntime-genai int4", "llamacpp": "llama.cpp Q4_1 (llama-cpp-python)"}

OURS_SWEPT = ("ours-fp32", "ours-fp32-kv16", "ours-int4", "ours-w8a8", "ours-w8a8-1plane")   # engines with a concurrency sweep


def _pool_commit(mem: dict) -> str:
    """How the run's KV pool was committed (older runs' JSON has no ``kv_cache_prefault``)."""
    if mem.get("kv_cache_prefault"):
        return f"committed at start, kv_cache_prefault; the engine loaded in {mem['load_s']:.1f} s"
    return "pages committed as blocks are first used"


def _fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


class Report:
    """Results of one run: ``results[system]`` from :mod:`bench_workers`, bounds in bytes/s and
    FLOP/s, the engines' manifests, the workload spec, notes, load averages, machine."""

    def __init__(self, results, bounds, manifests, spec, notes, load0, load1, machine,
                 command: str = "python tools/bench.py"):
        self.r, self.bounds, self.spec, self.notes, self.command = results, bounds, spec, notes, command
        self.load0, self.load1, self.machine = load0, load1, machine
        self.bytes = {k: bench_bounds.decode_bytes_per_step(m) for k, m in manifests.items()}
        if "ours-int4" in manifests:   # MatMulNBits (prepacked) reads the engine's own tensors
            self.bytes["ours-int4-acc4"] = bench_bounds.decode_bytes_per_step(manifests["ours-int4"], streamed=False)
        self.flops = bench_bounds.flops_per_token(manifests["ours-fp32"])
        self.w8a8_manifests = {k: m for k, m in manifests.items() if k.startswith("ours-w8a8")}
        self.tokenizer = None

    def get(self, system, *keys):
        x = self.r.get(system)
        for k in keys:
            if x is None:
                return None
            x = x[k] if isinstance(x, list) else x.get(k)
        return x

    def bound_bw(self, system):
        b = self.bytes.get(system)
        return self.bounds["read_bandwidth"] / b if b else None

    @property
    def bound_compute(self):
        return self.bounds["gemm_rate"] / self.flops

    def bound_compute_w8a8(self, system: str):
        """A W8A8 engine's own compute bound, tokens/s (its int8 linears at the integer GEMM
        rate, once per activation plane; the float lm_head at the float32 rate), or None."""
        manifest = self.w8a8_manifests.get(system)
        if not manifest or "int8_gemm_rate_ort" not in self.bounds:
            return None
        planes = manifest["build"].get("activation_planes") or 2
        return bench_bounds.w8a8_compute_bound(manifest, self.bounds["int8_gemm_rate_ort"] / planes,
                                               self.bounds["gemm_rate"])

    def answer(self, system) -> str | None:
        ids = self.get(system, "greedy")
        if not ids:
            return None
        from trtllm_lite.tokenizer import Tokenizer

        if self.tokenizer is None:
            self.tokenizer = Tokenizer(self.spec["tokenizer_dir"])
        first = ids[0]
        first = first[:first.index(2)] if 2 in first else first
        return self.tokenizer.decode(first)

    def same_as_fp32(self, system):
        a, b = self.get(system, "greedy"), self.get("ours-fp32", "greedy")
        return None if a is None or b is None else a == b

    def local_bound_target(self, out: list, system: str, label: str) -> None:
        """The 128/128 compute-bound target against the GEMM rate the worker probed just before
        and after that workload (the higher), where it did: the suite's bounds are taken
        minutes away, and this VM's speed moves between minutes."""
        rate = self.get(system, "equal", "gemm_rate_local")
        tokens = self.get(system, "equal", "output_tokens_per_s")
        if rate and tokens:
            x = tokens / (rate / self.flops)
            out.append((f"64 x 128/128{label}: >= 50% of the compute bound (output tokens/s; the GEMM rate "
                        f"probed just before and after the workload, {rate / 1e9:.0f} GFLOP/s)", f"{x:.0%}", x >= 0.5))

    # -- targets ----------------------------------------------------------------------------
    def targets(self) -> list[tuple[str, str, bool | None]]:
        g = self.get
        out = []

        def ratio(name, a, b, need, fmt="{:.2f}x"):
            ok = None if a is None or b is None else a / b >= need
            out.append((name, "-" if ok is None else fmt.format(a / b), ok))

        ratio("int4 batch-1 decode >= 1.3x onnxruntime-genai int4", g("ours-int4", "decode_tokens_per_s"),
              g("genai-int4", "decode_tokens_per_s"), 1.3)
        paired = self.paired_medians()
        if "ours-int4/genai-int4" in paired:
            x = paired["ours-int4/genai-int4"]
            out.append(("int4 batch-1 decode >= 1.3x onnxruntime-genai int4 (paired rounds: median of the "
                        "rounds' ratios)", f"{x:.2f}x", x >= 1.3))
        ratio("int4 batch-1 decode >= 70% of its bandwidth bound", g("ours-int4", "decode_tokens_per_s"),
              self.bound_bw("ours-int4"), 0.7, "{:.0%}")
        if "ours-int4 % of bound" in paired:
            x = paired["ours-int4 % of bound"]
            out.append(("int4 batch-1 decode >= 70% of its bandwidth bound (paired rounds: each round's "
                        "own probe, median)", f"{x:.0%}", x >= 0.7))
        resident = self.bounds.get("resident_read_bandwidth_int4")
        if resident and self.bytes.get("ours-int4") and g("ours-int4", "decode_tokens_per_s"):
            x = g("ours-int4", "decode_tokens_per_s") * self.bytes["ours-int4"] / resident
            out.append(("int4 batch-1 decode against the read rate over its own bytes, cache-resident where they "
                        "fit (not a target; the bound above uses the DRAM rate)", f"{x:.0%}", None))
        same = self.same_as_fp32("ours-int4")
        out.append(("int4 greedy ids identical to our fp32 engine (test prompts)", str(same), same))
        ratio("fp32 batch-1 decode >= 90% of its bandwidth bound", g("ours-fp32", "decode_tokens_per_s"),
              self.bound_bw("ours-fp32"), 0.9, "{:.0%}")
        if "ours-fp32 % of bound" in paired:
            x = paired["ours-fp32 % of bound"]
            out.append(("fp32 batch-1 decode >= 90% of its bandwidth bound (paired rounds: each round's "
                        "own probe, median)", f"{x:.0%}", x >= 0.9))
        ratio("fp32 batch-1 decode >= HF transformers", g("ours-fp32", "decode_tokens_per_s"),
              g("hf", "decode_tokens_per_s"), 1.0)
        ratio("64 random-length requests: >= 3x HF static batching (64)", g("ours-fp32", "random", "output_tokens_per_s"),
              g("hf", "random", "output_tokens_per_s"), 3.0)
        ratio("64 random-length requests: >= 5x onnxruntime-genai fp32 one at a time",
              g("ours-fp32", "random", "output_tokens_per_s"), g("genai-fp32", "random_sequential", "output_tokens_per_s"), 5.0)
        ratios = [row["ours-fp32"] / row["genai-fp32"] for row in self.get("paired-random", "rounds") or []]
        if ratios:
            x = float(np.median(ratios))
            out.append(("64 random-length requests: >= 5x onnxruntime-genai fp32 one at a time (paired rounds: "
                        "median of the rounds' ratios)", f"{x:.2f}x", x >= 5.0))
        if g("ours-fp32-kv16", "random"):   # the same float32 weights, the KV cache in float16 (genai's is float32)
            ratio("64 random-length requests, float16 KV cache: >= 5x onnxruntime-genai fp32 one at a time",
                  g("ours-fp32-kv16", "random", "output_tokens_per_s"),
                  g("genai-fp32", "random_sequential", "output_tokens_per_s"), 5.0)
        ratio("64 x 128/128: >= HF static batching (64)", g("ours-fp32", "equal", "output_tokens_per_s"),
              g("hf", "equal", "output_tokens_per_s"), 1.0)
        ratio("64 x 128/128: >= 50% of the compute bound (output tokens/s)",
              g("ours-fp32", "equal", "output_tokens_per_s"), self.bound_compute, 0.5, "{:.0%}")
        ratio("64 x 128/128: >= 50% of the compute bound (prompt + output tokens/s, each 2 x params FLOPs)",
              g("ours-fp32", "equal", "total_tokens_per_s"), self.bound_compute, 0.5, "{:.0%}")
        self.local_bound_target(out, "ours-fp32", "")
        for k, label in (("ours-w8a8", "w8a8 engine, rotated"), ("ours-w8a8-1plane", "w8a8 engine, one activation plane, rotated")):
            if not g(k, "equal"):   # int8 arithmetic: past float32's bound; measured against its own too
                continue
            ratio(f"64 x 128/128, {label}: >= HF static batching (64)", g(k, "equal", "output_tokens_per_s"),
                  g("hf", "equal", "output_tokens_per_s"), 1.0)
            ratio(f"64 x 128/128, {label}: >= 50% of the compute bound (output tokens/s; float32 GEMM's bound, "
                  "as above)", g(k, "equal", "output_tokens_per_s"), self.bound_compute, 0.5, "{:.0%}")
            self.local_bound_target(out, k, f", {label}")
            own = self.bound_compute_w8a8(k)
            if own:
                x = g(k, "equal", "total_tokens_per_s") / own
                out.append((f"64 x 128/128, {label}: prompt + output tokens/s against its own bound (int8 "
                            "linears at the integer GEMM rate)", f"{x:.0%}", None))
            a, b = g(k, "equal", "output_tokens_per_s"), g("ours-fp32", "equal", "output_tokens_per_s")
            if a and b:
                out.append((f"64 x 128/128: {label} vs fp32 (output tokens/s)", f"{a / b:.2f}x", None))
        for w, label in (("random", "64 random-length requests"), ("equal", "64 x 128/128")):
            a, b = g("ours-fp32-kv16", w, "output_tokens_per_s"), g("ours-fp32", w, "output_tokens_per_s")
            if a and b:   # (no target: what the float16 KV cache gives, same memory budget)
                out.append((f"{label}: float16 KV cache vs float32 (output tokens/s)", f"{a / b:.2f}x", None))
        if "llamacpp" in self.r:
            ratio("int4 batch-1 decode vs llama.cpp Q4_1 (aim: match)", g("ours-int4", "decode_tokens_per_s"),
                  g("llamacpp", "decode_tokens_per_s"), 1.0)
            ratio("int4, 64 random-length requests vs llama.cpp one at a time (aim: beat)",
                  g("ours-int4", "random", "output_tokens_per_s"),
                  g("llamacpp", "random_sequential", "output_tokens_per_s"), 1.0)
        sweep = {s["concurrency"]: s for s in g("ours-fp32", "sweep") or []}
        if 1 in sweep and 16 in sweep:
            ratio("16 concurrent requests >= 4x batch 1 output tokens/s (issue #2)",
                  sweep[16]["output_tokens_per_s"], sweep[1]["output_tokens_per_s"], 4.0)
        for system in ("fp32", "int4"):   # int4's steps are the shortest: its share is the larger
            for label, value in (("batch 1", g(f"ours-{system}", "host_overhead_batch1")),
                                 ("64 concurrent", g(f"ours-{system}", "equal", "host_overhead"))):
                if value is not None:
                    out.append((f"per-step host work (Python, numpy) < 10% of wall time, {system} {label}",
                                f"{value:.1%}", value < 0.1))
        mem = g("ours-fp32", "memory")
        if mem and g("ours-fp32", "peak_rss_bytes") and g("ours-fp32", "random"):   # (not with --quick)
            peak = g("ours-fp32", "peak_rss_bytes") / (mem["weights_bytes"] + mem["kv_pool_bytes"])
            out.append(("fp32 serving peak RSS < 1.3x (weights + KV pool)", f"{peak:.2f}x", peak < 1.3))
        return out

    def paired_rounds(self) -> list[dict]:
        """Each paired round (bench_workers.run_paired) with its ratios: ``{system: tokens/s,
        "<system> % of bound": rate x bytes per step / the round's read bandwidth,
        "ours-int4/genai-int4" and "ours-fp32/genai-fp32": ratios}``."""
        out = []
        for row in self.get("paired", "rounds") or []:
            row = dict(row)
            for k in ("ours-fp32", "ours-int4"):
                if row.get(k) and self.bytes.get(k):
                    row[f"{k} % of bound"] = row[k] * self.bytes[k] / row["read_bandwidth"]
            for p in ("fp32", "int4"):
                if row.get(f"ours-{p}") and row.get(f"genai-{p}"):
                    row[f"ours-{p}/genai-{p}"] = row[f"ours-{p}"] / row[f"genai-{p}"]
            out.append(row)
        return out

    def paired_medians(self) -> dict:
        """The median over the paired rounds of every figure in :meth:`paired_rounds`."""
        rounds = self.paired_rounds()
        keys = {k for row in rounds for k in row}
        return {k: float(np.median([row[k] for row in rounds if k in row])) for k in keys}

    # -- output -----------------------------------------------------------------------------
    def markdown(self) -> str:
        b, m, L = self.bounds, self.machine, []
        quick = "--quick" in self.command.split()
        L += [BEGIN, "", f"## CPU: the {'quick' if quick else 'full'} suite (`tools/bench.py`)", "",
              f"Run {time.strftime('%Y-%m-%d %H:%M')} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB); "
              + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + f"; {self.spec['threads']} threads for every system.",
              f"Load average {self.load0[0]:.2f} before, {self.load1[0]:.2f} after (the suite's own "
              f"{self.spec['threads']} threads count in the latter)"
              + ("; the machine had other work shortly before: figures may be taken under load"
                 if self.load0[0] > 0.5 else "")
              + ".", "", "```bash",
              (f"GLIBC_TUNABLES={m['glibc_tunables']} " if m.get("glibc_tunables") else "") + self.command,
              "```", ""]
        L += ["### Bounds (measured in this run, before and after the systems; the higher of the two)", "",
              "| quantity | value |", "|---|---:|",
              f"| read bandwidth (best of threaded numpy max, BLAS GEMV over 512 MiB) | {b['read_bandwidth'] / 1e9:.1f} GB/s |",
              f"| fp32 GEMM rate, numpy BLAS / ONNX Runtime MLAS (2048^3; the bound uses the higher) | "
              f"{b['gemm_rate_numpy'] / 1e9:.0f} / {b['gemm_rate_ort'] / 1e9:.0f} GFLOP/s |",
              f"| FLOPs per token (2 x parameters) | {self.flops / 1e9:.3f} GFLOP |",
              f"| compute bound, batched decode | {self.bound_compute:,.0f} tokens/s |"]
        if "int8_gemm_rate_ort" in b:
            L.append(f"| int8 GEMM rate, ONNX Runtime MatMulIntegerToFloat u8s8 (2048^3) | "
                     f"{b['int8_gemm_rate_ort'] / 1e9:.0f} GOP/s |")
        for k in self.w8a8_manifests:
            if self.bound_compute_w8a8(k) and k in self.r:
                planes = self.w8a8_manifests[k]["build"].get("activation_planes") or 2
                L.append(f"| compute bound, w8a8 engine with {planes} activation plane{'s' if planes > 1 else ''} "
                         f"(its int8 linears, any int8 lm_head among them, at that rate once per plane; float ones at float32's) | "
                         f"{self.bound_compute_w8a8(k):,.0f} tokens/s |")
        for k in ("ours-fp32", "ours-int4", "ours-int4-acc4"):
            if self.bytes.get(k) and k in self.r:
                what = {"ours-int4": " (as the QuantizedLinear kernel streams them)",
                        "ours-int4-acc4": " (the engine's MatMulNBits tensors)"}.get(k, "")
                L.append(f"| {NAMES[k]}: weight bytes per decode step{what} / bandwidth bound | "
                         f"{self.bytes[k] / 1e6:.0f} MB / {self.bound_bw(k):.0f} tokens/s |")
        if b.get("resident_read_bandwidth_int4") and self.bytes.get("ours-int4"):
            L.append(f"| read bandwidth over the int4 engine's {self.bytes['ours-int4'] / 1e6:.0f} MB, read again and "
                     f"again (what the caches serve where the bytes fit; the targets' bound uses the DRAM rate) / int4 decode at that rate | "
                     f"{b['resident_read_bandwidth_int4'] / 1e9:.1f} GB/s / "
                     f"{b['resident_read_bandwidth_int4'] / self.bytes['ours-int4']:.0f} tokens/s |")
        L += ["", "### Batch 1 (latency)", "",
              "| system | decode tokens/s | % of bound | TTFT 128 / 512 / 2048 (ms) | peak RSS (MB) | greedy = our fp32 | chat answer |",
              "|---|---:|---:|---:|---:|:-:|---|"]
        for k, name in NAMES.items():
            if k not in self.r:
                continue
            d, bw = self.get(k, "decode_tokens_per_s"), self.bound_bw(k)
            ttft = " / ".join(_fmt(self.get(k, "latency", str(n)), 0) for n in self.spec["ttft_lens"])
            ans = (self.answer(k) or "").replace("|", "\\|").replace("\n", " ")[:60]
            L.append(f"| {name} | {_fmt(d)} | {'-' if not bw else f'{d / bw:.0%}'} | {ttft} | "
                     f"{_fmt(self.get(k, 'peak_rss_bytes') / 1e6, 0)} | {self.same_as_fp32(k)} | {ans} |")
        rounds = self.paired_rounds()
        if rounds:
            L += ["", "### Batch 1, paired rounds (one process; each round probes the read bandwidth, then runs "
                  "each system once, the order rotating)", "",
                  "| round | read bandwidth (GB/s) | trtllm-lite fp32 tokens/s (% of the round's bound) | "
                  "onnxruntime-genai fp32 | fp32 / genai fp32 | trtllm-lite int4 (% of bound) | "
                  "onnxruntime-genai int4 | int4 / genai int4 |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]

            def cells(row):
                out = [f"{row['read_bandwidth'] / 1e9:.1f}"]
                for p in ("fp32", "int4"):
                    ours, share, ratio = row.get(f"ours-{p}"), row.get(f"ours-{p} % of bound"), row.get(f"ours-{p}/genai-{p}")
                    out += [_fmt(ours) + ("" if share is None else f" ({share:.0%})"), _fmt(row.get(f"genai-{p}")),
                            "-" if ratio is None else f"{ratio:.2f}x"]
                return " | ".join(out)
            L += [f"| {i + 1} | {cells(row)} |" for i, row in enumerate(rounds)]
            L.append(f"| median | {cells(self.paired_medians())} |")
        random_rounds = self.get("paired-random", "rounds") or []
        if random_rounds:
            L += ["", "### 64 random-length requests, paired rounds (one process; our fp32 engine's 64 requests "
                  "and onnxruntime-genai fp32's first 16 one at a time, the order alternating)", "",
                  "| round | trtllm-lite fp32 output tokens/s | onnxruntime-genai fp32 one at a time | ratio |",
                  "|---:|---:|---:|---:|"]
            for i, row in enumerate(random_rounds):
                L.append(f"| {i + 1} | {_fmt(row['ours-fp32'])} | {_fmt(row['genai-fp32'])} | "
                         f"{row['ours-fp32'] / row['genai-fp32']:.2f}x |")
            L.append(f"| median | {_fmt(float(np.median([r['ours-fp32'] for r in random_rounds])))} | "
                     f"{_fmt(float(np.median([r['genai-fp32'] for r in random_rounds])))} | "
                     f"{float(np.median([r['ours-fp32'] / r['genai-fp32'] for r in random_rounds])):.2f}x |")
        offline = ["", "### Offline throughput (64 requests, greedy, every request runs to its max_tokens)", "",
                   "| system | workload | output tokens/s | total tokens/s | wall (s) |", "|---|---|---:|---:|---:|"]
        rows = [("ours-fp32", "random"), ("ours-fp32-kv16", "random"), ("ours-int4", "random"), ("ours-w8a8", "random"),
                ("ours-w8a8-1plane", "random"),
                ("hf", "random"), ("genai-fp32", "random_sequential"),
                ("genai-int4", "random_sequential"), ("llamacpp", "random_sequential"),
                ("ours-fp32", "equal"), ("ours-fp32-kv16", "equal"), ("ours-int4", "equal"), ("ours-w8a8", "equal"),
                ("ours-w8a8-1plane", "equal"),
                ("hf", "equal")]
        labels = {"random": "random lengths (16-512 in, 16-256 out, seeded)", "equal": "128 in / 128 out",
                  "random_sequential": f"random lengths, one at a time ({self.spec['genai_requests']} requests)"}
        for k, w in rows:
            x = self.get(k, w)
            if x:
                budget = self.get(k, "offline_max_num_batched_tokens")
                ours = f" (inflight batching, offline budget {budget} tokens)" if budget else " (inflight batching)"
                how = " (static batches of 64, padded)" if k == "hf" else (ours if k.startswith("ours") else "")
                offline.append(f"| {NAMES[k]}{how} | {labels[w]} | {_fmt(x['output_tokens_per_s'])} | "
                               f"{_fmt(x['total_tokens_per_s'])} | {_fmt(x['wall_s'])} |")
        sweep = ["", "### Concurrency sweep (128 in / 64 out; 2 x concurrency requests, at least 4)", "",
                 "| system | concurrency | output tokens/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) |",
                 "|---|---:|---:|---:|---:|"]
        for k in OURS_SWEPT:
            for s in self.get(k, "sweep") or []:
                t, p = s["ttft_ms"], s["tpot_ms"]
                sweep.append(f"| {NAMES[k]} | {s['concurrency']} | {_fmt(s['output_tokens_per_s'])} | "
                             + " / ".join(_fmt(t.get(q), 0) for q in ("p50", "p90", "p99")) + " | "
                             + " / ".join(_fmt(p.get(q)) for q in ("p50", "p90", "p99")) + " |")
        for table in (offline, sweep):   # (--quick runs neither workload)
            if len(table) > 5:
                L += table
        for k in ("ours-fp32", "ours-fp32-kv16"):
            mem = self.get(k, "memory")
            if mem and self.get(k, "random"):
                L += ["", f"Memory, {NAMES[k]} serving the random workload: peak RSS "
                          f"{self.get(k, 'peak_rss_bytes') / 1e6:.0f} MB; weights {mem['weights_bytes'] / 1e6:.0f} MB; "
                          f"KV pool {mem['kv_pool_bytes'] / 1e6:.0f} MB ({_pool_commit(mem)}; peak "
                          f"{(self.get(k, 'random') or {}).get('peak_kv_blocks', 0)} "
                          f"blocks of {mem['kv_bytes_per_block'] / 1e6:.2f} MB)."]
        L += ["", "### Targets (issue #9, and issue #2's measure)", "", "| target | measured | met |", "|---|---:|:-:|"]
        for name, value, ok in self.targets():
            L.append(f"| {name} | {value} | {'-' if ok is None else ('yes' if ok else '**no**')} |")
        if self.notes:
            L += [""] + [f"- {n}" for n in self.notes]
        if self.has_sweep():
            L += ["", "![throughput and latency vs concurrency](benchmarks_cpu.png)"]
        L += ["", END]
        return "\n".join(L)

    def write(self, docs: str) -> None:
        os.makedirs(docs, exist_ok=True)
        with open(os.path.join(docs, "benchmarks_cpu.json"), "w") as f:
            json.dump({"results": self.r, "bounds": self.bounds, "bytes_per_step": self.bytes,
                       "flops_per_token": self.flops, "machine": self.machine,
                       "load": [self.load0, self.load1], "targets": self.targets()}, f, indent=1)
        if self.has_sweep():
            self.plot(os.path.join(docs, "benchmarks_cpu.png"))
        path = os.path.join(docs, "benchmarks.md")
        text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
        section = self.markdown()
        if BEGIN in text and END in text:
            text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
        with open(path, "w") as f:
            f.write(text)

    def has_sweep(self) -> bool:
        """Whether any engine ran the concurrency sweep (the plot's data; not with --quick)."""
        return any(self.get(k, "sweep") for k in OURS_SWEPT)

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for k in OURS_SWEPT:
            sweep = self.get(k, "sweep") or []
            if not sweep:
                continue
            c = [s["concurrency"] for s in sweep]
            a.plot(c, [s["output_tokens_per_s"] for s in sweep], "o-", label=NAMES[k])
            for q, style in (("p50", "-"), ("p99", ":")):
                b.plot(c, [s["tpot_ms"].get(q) for s in sweep], "o" + style, label=f"{NAMES[k].split(' (')[0]} TPOT {q}")
                b.plot(c, [s["ttft_ms"].get(q) for s in sweep], "s" + style, label=f"{NAMES[k].split(' (')[0]} TTFT {q}")
        for k in ("hf", "genai-fp32", "genai-int4", "llamacpp"):
            d = self.get(k, "decode_tokens_per_s")
            if d:
                a.plot([1], [d], "x", markersize=9, label=f"{NAMES[k]} batch 1")
        a.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s",
              title="throughput vs concurrency (128 in / 64 out)")
        b.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms", title="TTFT and TPOT percentiles")
        a.legend(fontsize=7)
        b.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
