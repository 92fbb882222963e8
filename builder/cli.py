"""``trtllm-lite build``."""
from __future__ import annotations

import argparse

from .build import BACKENDS, BuildConfig, build_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BuildConfig()
    p.add_argument("--model", required=True,
                   help="smollm2-135m-instruct, a .gguf file, or a Hugging Face directory")
    p.add_argument("--output", required=True, help="engine directory to write")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS)
    p.add_argument("--dtype", default=d.dtype, choices=["float32"])
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step (the token budget)")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len,
                   help="prompt + output tokens per sequence")


def run(args: argparse.Namespace) -> int:
    config = BuildConfig(backend=args.backend, dtype=args.dtype, block_size=args.block_size,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         max_seq_len=args.max_seq_len)
    build_engine(args.model, args.output, config)
    return 0
