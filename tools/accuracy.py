"""How far quantized engines move from a reference engine: logits and greedy text.

    python tools/accuracy.py engines/bench-smollm2-fp32 engines/bench-smollm2-w8a8 [...]

The first engine is the reference (e.g. the fp32 engine built from the same GGUF). For each
other engine, on the same prompts:
  * the logits of every position of one prompt (:data:`LOGITS_TEXT`, ~50 tokens, one prefill
    step): the largest absolute deviation per position as a fraction of that position's
    reference logit range (max - min), its median and maximum over positions, and the share
    of positions whose argmax is the reference's;
  * the greedy ids of the bench's test prompts (``tools/bench.py``: the capital-of-France chat
    prompt and three texts), 32 tokens each with ``ignore_eos``: how many are identical to the
    reference's, and the start of each as text.
The logits are the rows :meth:`Runner.execute` returns, ``[num_positions, vocab]`` float32,
for a request asking for ``prompt_logprobs`` (so every prompt position gets a row).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOGITS_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
               "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from "
               "wine making. Within fifty years printing shops had spread across Europe, and the price "
               "of books fell sharply.")
GREEDY_TOKENS = 32


def prompt_logits(engine, ids: list[int]) -> np.ndarray:
    """Logits ``[len(ids), vocab]`` float32 of every position of ``ids``, run alone."""
    from trtllm_lite.sampling_params import SamplingParams

    rows, plain = [], engine.runner.execute

    def recording(batch):
        out = plain(batch)
        rows.append(np.array(out))
        return out

    engine.runner.execute = recording
    try:
        engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.runner.execute = plain
    return np.concatenate(rows)[:len(ids)]


def measure(engine_dir: str, logits_ids: list[int], prompts: list[list[int]], threads: int) -> dict:
    """One engine's prompt logits and greedy ids (see the module docstring)."""
    from trtllm_lite.commands.bench import greedy_ids
    from trtllm_lite.core.llm_engine import LLMEngine

    engine = LLMEngine(engine_dir, num_threads=threads, verify_checksums=False, enable_prefix_caching=False)
    return {"logits": prompt_logits(engine, logits_ids),
            "greedy": [greedy_ids(engine, p, GREEDY_TOKENS) for p in prompts]}


def compare(ref: dict, got: dict) -> dict:
    """Deviation of ``got`` from ``ref`` (both from :func:`measure`): fractions in [0, 1]."""
    span = ref["logits"].max(axis=1) - ref["logits"].min(axis=1)
    dev = np.abs(got["logits"] - ref["logits"]).max(axis=1) / span
    return {"deviation_median": float(np.median(dev)), "deviation_max": float(dev.max()),
            "same_argmax": float((got["logits"].argmax(1) == ref["logits"].argmax(1)).mean()),
            "identical_prompts": sum(a == b for a, b in zip(got["greedy"], ref["greedy"]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reference", help="engine directory the others are compared with")
    p.add_argument("engines", nargs="+")
    p.add_argument("--num-threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    for engine_dir in [args.reference, *args.engines]:   # before any work: the reference takes a while
        missing = [f for f in ("engine.json", "tokenizer.json") if not os.path.isfile(os.path.join(engine_dir, f))]
        if missing:
            p.error(f"{engine_dir!r} is not an engine directory (no {' or '.join(missing)}; build one "
                    f"with `trtllm-lite build`)")

    from bench import CAPITAL, TEST_TEXTS
    from trtllm_lite.tokenizer import Tokenizer

    tok = Tokenizer(args.reference)
    prompts = [tok.encode(tok.apply_chat_template(CAPITAL, True), add_special_tokens=False)]
    prompts += [tok.encode(t) for t in TEST_TEXTS]
    logits_ids = tok.encode(LOGITS_TEXT)
    ref = measure(args.reference, logits_ids, prompts, args.num_threads)
    print(f"reference {args.reference}; logits at {len(logits_ids)} positions, "
          f"{len(prompts)} prompts x {GREEDY_TOKENS} greedy tokens")
    print("| engine | logit deviation, median / max (of the range) | same argmax | prompts identical | chat answer |")
    print("|---|---:|---:|:-:|---|")
    for engine_dir in args.engines:
        got = measure(engine_dir, logits_ids, prompts, args.num_threads)
        c = compare(ref, got)
        answer = tok.decode(got["greedy"][0], skip_special_tokens=False).split("<|im_end|>")[0].strip()
        print(f"| {engine_dir} | {c['deviation_median']:.2%} / {c['deviation_max']:.2%} | "
              f"{c['same_argmax']:.1%} | {c['identical_prompts']} of {len(prompts)} | {answer!r} |")
        for ids, text in zip(got["greedy"][1:], TEST_TEXTS):
            print(f"    {text!r} -> {tok.decode(ids)[:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
