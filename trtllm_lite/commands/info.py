"""``trtllm-lite info``: what an engine is and what it was built with."""
from __future__ import annotations

import argparse
import json

from ..engine_dir import load_engine_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--json", action="store_true", help="print the whole manifest")


def run(args: argparse.Namespace) -> int:
    engine = load_engine_dir(args.engine)
    m = engine.manifest
    if args.json:
        print(json.dumps({k: v for k, v in m.items() if k != "weights"}, indent=1))
        return 0
    model, build = m["model"], m["build"]
    weights = sum(t["nbytes"] for t in m["weights"]["tensors"].values())
    print(f"engine      {engine.path} (format {m['format_version']}, backend {build['backend']})")
    print(f"model       {model['architecture']} from {m['source']['path']}")
    print(f"            {model['num_layers']} layers, hidden {model['hidden_size']}, heads "
          f"{model['num_heads']} (kv {model['num_kv_heads']}), head_dim {model['head_dim']}, "
          f"vocab {model['vocab_size']}")
    print(f"build       dtype {build['dtype']}, kv_cache_dtype {engine.kv_pool_dtype}, block_size "
          f"{build['block_size']}, max_num_seqs "
          f"{build['max_num_seqs']}, max_num_batched_tokens {build['max_num_batched_tokens']}, "
          f"max_seq_len {build['max_seq_len']}")
    quantization = build.get("quantization", "none")
    if quantization == "w8a8":
        planes = build.get("activation_planes") or 2
        print(f"quantized   w8a8 (int8 weights per output channel, activations as {planes} int8 "
              f"plane{'s' if planes > 1 else ''} per token), lm_head {'int8' if build.get('quantize_lm_head') else 'float'}")
        if build["backend"] == "onnxruntime":
            from ..runners.w8a8_uint8 import uint8_int8_gemm_saturates

            print("            on this CPU: " + (
                "int8 weights loaded as uint8 + 128 (ONNX Runtime's uint8 x int8 GEMM saturates here: no VNNI or AMX)"
                if uint8_int8_gemm_saturates() else "int8 weights (ONNX Runtime's uint8 x int8 GEMM is exact here)"))
    elif quantization != "none":
        sources = sorted(set(m.get("quantization", {}).get("weights", {}).values()))
        levels = sorted({str(build.get("accuracy_level"))} | set(m.get("graph_variants", {}).get("accuracy_level", {})))
        print(f"quantized   {quantization} (block {build.get('quant_block_size')}, from {', '.join(sources)}), "
              f"lm_head {'quantized' if build.get('quantize_lm_head') else 'float'}, accuracy levels "
              f"{', '.join(levels)} (built {build.get('accuracy_level')})")
    if build.get("rotate_activations"):
        print("rotation    activations rotated (--rotate-activations): the residual stream in the weights, "
              "the down projections' inputs at run time")
    print(f"weights     {weights / 2**20:.1f} MiB in {m['weights']['file']}")
    kernel_graphs = m.get("graph_variants", {}).get("custom_kernels")
    level_graphs = {level: files for level, files in m.get("graph_variants", {}).get("accuracy_level", {}).items()
                    if str(level) != str(build.get("accuracy_level"))}
    float_graphs = m.get("graph_variants", {}).get("float_linear_kernels")
    extras = [", ".join(kernel_graphs.values()) + " for the C++ kernels"] if kernel_graphs else []
    extras += [", ".join(float_graphs.values()) + " for them on AVX-512 (FloatLinear)"] if float_graphs else []
    extras += [", ".join(files.values()) + f" for accuracy level {level}" for level, files in sorted(level_graphs.items())]
    print(f"graphs      {', '.join(m['graphs'])}{' (+ ' + '; '.join(extras) + ')' if extras else ''}; "
          f"tokenizer {', '.join(m['tokenizer']['files']) or 'none'}")
    print(f"built with  {', '.join(f'{k} {v}' for k, v in m['versions'].items())}")
    return 0
