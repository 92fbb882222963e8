"""Issue #8's figures: output tokens/s with and without speculative decoding (SmolLM2 fp32).

    python tools/bench_spec.py [--engine engines/smollm2] [--draft engines/smollm2-draft8] [--json out.json]

For an input-grounded task (repeat / edit a paragraph, code completion from context) and
open-ended chat, at batch 1 and batch 8: greedy output tokens/s without speculation, with
n-gram proposals, and (when ``--draft`` is given or built) with a draft model made from the
target's first layers; acceptance rates. Every arm runs in this process on the same engine
and prompts; outputs are checked identical to the plain run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_core import ensure_engine  # noqa: E402

from trtllm_lite import LLM, SamplingParams  # noqa: E402

PARAGRAPH = ("Paged attention stores the key and value cache in fixed-size blocks, so memory is allocated "
             "on demand and shared between requests with the same prefix. The scheduler batches requests "
             "continuously, admitting new ones as soon as others finish, and long prompts are split into "
             "chunks so that running decodes are not stalled.")
CODE = ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n\n\n"
        "def variance(xs):\n    m = mean(xs)\n    total = 0\n    for x in xs:\n        total += (x - m) ** 2\n"
        "    return total / len(xs)\n\n\ndef std(xs):\n")
GROUNDED = [
    [{"role": "user", "content": "Repeat this paragraph exactly:\n\n" + PARAGRAPH}],
    [{"role": "user", "content": "Rewrite this paragraph replacing 'requests' with 'jobs':\n\n" + PARAGRAPH}],
    [{"role": "user", "content": "Complete this Python file; write variance_sample and std_sample like the "
                                 "functions above:\n\n" + CODE}],
]
OPEN = [[{"role": "user", "content": q}] for q in (
    "Write a short poem about the sea.", "What are three tips for a job interview?",
    "Explain why the sky is blue to a child.", "Invent a name and a story for a new dragon.")]


def run(llm, conversations, batch: int, max_tokens: int):
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in conversations]
    prompts = (prompts * batch)[:max(batch, len(prompts))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))   # warm
    outs, t0, n = [], time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        res = llm.generate(prompts[i:i + batch], params)
        outs += [r.outputs[0].token_ids for r in res]
    elapsed = time.perf_counter() - t0
    n = sum(len(o) for o in outs)
    return n / elapsed, outs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/smollm2")
    p.add_argument("--draft", default=None, help="draft engine (default: build one with --draft-layers)")
    p.add_argument("--draft-layers", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    engine = ensure_engine(args.engine)
    draft = args.draft or ensure_engine(f"{args.engine}-draft{args.draft_layers}", draft_layers=args.draft_layers)
    load = os.getloadavg()[0]
    arms = {"plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
            f"draft{args.draft_layers}": {"method": "draft_model", "draft_engine": draft, "num_speculative_tokens": 3}}
    results = {}
    llms = {name: LLM(engine, verify_checksums=False, speculative_config=spec) for name, spec in arms.items()}
    for task, convs in (("grounded", GROUNDED), ("open_chat", OPEN)):
        for batch in (1, 8):
            for rep in range(2):               # arms interleaved, best of two: load drifts less
                for name, llm in llms.items():
                    llm.engine.spec_stats = {k: 0 for k in llm.engine.spec_stats}
                    tps, outs = run(llm, convs, batch, args.max_tokens)
                    stats = llm.engine.stats()
                    best = results.get((name, task, batch))
                    if best is None or tps > best["tokens_per_s"]:
                        results[(name, task, batch)] = {
                            "tokens_per_s": tps, "outs": outs,
                            "acceptance_rate": stats.get("spec_acceptance_rate"),
                            "mean_accepted_length": stats.get("spec_mean_accepted_length")}
    rows, table = [], ["| task | batch | plain tok/s | " + " | ".join(f"{a} tok/s (x, acceptance)" for a in list(arms)[1:]) + " |",
                       "|---|---:|---:|" + "---:|" * (len(arms) - 1)]
    for task in ("grounded", "open_chat"):
        for batch in (1, 8):
            base = results[("plain", task, batch)]
            cells = []
            for a in list(arms)[1:]:
                r = results[(a, task, batch)]
                assert r["outs"] == base["outs"], f"{a} changed outputs on {task} batch {batch}"
                cells.append(f"{r['tokens_per_s']:.1f} ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x, "
                             f"{(r['acceptance_rate'] or 0) * 100:.0f}%)")
                rows.append({"task": task, "batch": batch, "arm": a, "tokens_per_s": r["tokens_per_s"],
                             "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                             "acceptance_rate": r["acceptance_rate"], "mean_accepted_length": r["mean_accepted_length"]})
            table.append(f"| {task} | {batch} | {base['tokens_per_s']:.1f} | " + " | ".join(cells) + " |")
    print("\n".join(table))
    print(f"outputs identical to plain decoding in every arm; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load_avg_before": load, "load_avg_after": os.getloadavg()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
