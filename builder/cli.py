"""``trtllm-lite build``."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from .build import BACKENDS, BuildConfig, build_engine
from .quantize import QUANTIZATIONS


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BuildConfig()
    p.add_argument("--model", required=True,
                   help="smollm2-135m-instruct, a .gguf file, or a Hugging Face directory")
    p.add_argument("--output", required=True, help="engine directory to write")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS,
                   help="onnxruntime (CPU), tensorrt (with the CUDA paged-attention plugin) or "
                        "tensorrt-rtx (default: %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"],
                   help="GEMMs, attention and KV cache: float32 (onnxruntime, tensorrt-rtx), "
                        "float16 or bfloat16 (tensorrt, tensorrt-rtx) (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["float32", "float16"],
                   help="KV cache element type (onnxruntime backend): float16 halves the pools' bytes "
                        "(K/V rounded to float16 when stored, attention computed in float32) (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step, the token budget (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len,
                   help="prompt + output tokens per sequence (default: %(default)s; at most the model's positions)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="build a speculative-decoding draft from the model's first N layers")
    p.add_argument("--quantization", default=d.quantization, choices=QUANTIZATIONS,
                   help="quantization of the linear layers: int8/int4 weight-only (GGUF Q4_0/Q4_1/Q4_K/Q8_0 "
                        "blocks map exactly, others are block-quantized); w8a8 int8 weights per "
                        "channel and int8 activations per token (faster batched steps, changes results)")
    p.add_argument("--quant-block-size", type=int, default=d.quant_block_size,
                   help="weights per quantization block (power of two >= 16)")
    p.add_argument("--quant-asymmetric", action="store_true",
                   help="an integer zero point per block (default: symmetric)")
    p.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="quantize the lm_head / tied embedding (default: only when the GGUF "
                        "stores it quantized, mapped exactly; float32 otherwise)")
    p.add_argument("--activation-planes", type=int, default=None, choices=[1, 2],
                   help="w8a8: int8 planes per activation: 2 (default, ~15 bits: only the weights' "
                        "rounding changes results) or 1 (classic W8A8: faster batched steps, changes them more)")
    p.add_argument("--rotate-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="Llama family, w8a8 (or none): rotate the residual stream and the down projections' "
                        "inputs (QuaRot) so int8 activations lose less (default: on for the Llama family's w8a8)")
    p.add_argument("--accuracy-level", type=int, default=None, choices=[0, 1, 2, 3, 4],
                   help="MatMulNBits compute precision: 0 float32 activations (default), "
                        "4 int8 activations (faster, changes results); 1-3 (float32 / float16 / "
                        "bfloat16 compute) are passed to the nodes as they are")


def run(args: argparse.Namespace) -> int:
    config = BuildConfig(backend=args.backend, dtype=args.dtype, block_size=args.block_size,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         max_seq_len=args.max_seq_len, draft_layers=args.draft_layers, quantization=args.quantization,
                         quant_block_size=args.quant_block_size,
                         quant_symmetric=not args.quant_asymmetric,
                         quantize_lm_head=args.quantize_lm_head, accuracy_level=args.accuracy_level,
                         kv_cache_dtype=args.kv_cache_dtype, activation_planes=args.activation_planes,
                         rotate_activations=args.rotate_activations)
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ValueError(f"--output {args.output!r} exists and is not a directory")
    with warnings.catch_warnings():   # the loader's warnings (a capped sliding window) as build lines
        warnings.showwarning = _show_warning
        build_engine(args.model, args.output, config)
    return 0


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"[build] warning: {message}", file=sys.stderr, flush=True)
