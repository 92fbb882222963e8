"""Where a step's time goes: ONNX Runtime's per-operator profile of decode steps.

    python tools/profile_step.py --engine engines/bench-smollm2-int4 --batch 1
    python tools/profile_step.py --engine engines/bench-smollm2-fp32 --batch 64

Runs ``--batch`` requests of ``--prompt-len`` random tokens closed-loop for ``--decode-tokens``
tokens with ONNX Runtime's profiler on, then prints, over the decode steps only (every
sequence computing one token; ``--phase prefill``: the steps where every sequence computes
prompt tokens), the median step time and the kernel time per operator type per step. The profiler adds its own per-node cost, so absolute times read high: compare
operator types within a run, and take step times from ``tools/bench.py``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# control-flow nodes: their time is their subgraph's nodes, which the profile lists as well
CONTAINERS = ("If", "Loop", "Scan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--batch", type=int, default=1, help="concurrent requests")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--top", type=int, default=15, help="operator types shown")
    p.add_argument("--nodes", type=int, default=0, help="also show this many slowest nodes")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="profile the decode-only steps or the prefill-only steps")
    args = p.parse_args(argv)

    import trtllm_lite.runners.onnxruntime_runner as ort_runner
    from trtllm_lite.commands.bench import random_prompts, run_requests
    from trtllm_lite.core.llm_engine import LLMEngine

    plain = ort_runner.session_options

    def profiled(*a, **k):
        so = plain(*a, **k)
        so.enable_profiling = True
        so.profile_file_prefix = "/tmp/trtllm_lite_profile"
        return so

    ort_runner.session_options = profiled
    engine = LLMEngine(args.engine, num_threads=args.num_threads, verify_checksums=False,
                       enable_prefix_caching=False)
    runner = engine.runner
    phase_runs, plain_call = [], runner._call

    def call(seqs):       # remember which graph runs were decode-only or prefill-only
        decode = args.phase == "decode"
        phase_runs.append(all((s.num_new_tokens == 1) == decode for s in seqs))
        return plain_call(seqs)

    runner._call = call
    vocab = engine.model_config["vocab_size"]
    run_requests(engine, random_prompts(args.batch, args.prompt_len, vocab), args.decode_tokens)
    path = next(iter(runner.sessions.values())).end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    runs = [r for r, in_phase in zip(runs, phase_runs) if in_phase]
    runs = runs[1:] if args.phase == "decode" else runs     # drop the first decode step
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    per_op, per_node, j = collections.Counter(), collections.Counter(), 0
    for r in runs:
        start, end = r["ts"], r["ts"] + r["dur"]
        while j < len(nodes) and nodes[j]["ts"] < start:
            j += 1
        k = j
        while k < len(nodes) and nodes[k]["ts"] <= end:
            op = nodes[k]["args"]["op_name"]
            if op not in CONTAINERS:
                per_op[op] += nodes[k]["dur"]
                per_node[nodes[k]["name"].removesuffix("_kernel_time")] += nodes[k]["dur"]
            k += 1
    if not runs:
        print(f"no {args.phase} steps profiled")
        return 1
    steps = sorted(r["dur"] for r in runs)
    total = sum(per_op.values()) / len(runs)
    print(f"{args.engine}: batch {args.batch}, {len(runs)} {args.phase} steps, median step "
          f"{steps[len(steps) // 2] / 1e3:.2f} ms (profiled), kernels {total / 1e3:.2f} ms/step")
    for op, us in per_op.most_common(args.top):
        print(f"  {op:30s} {us / len(runs) / 1e3:8.2f} ms/step  {us / len(runs) / total:6.1%}")
    if args.nodes:
        print("slowest nodes:")
        for name, us in per_node.most_common(args.nodes):
            print(f"  {name:50s} {us / len(runs):8.1f} us/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
