"""The roofline bounds the benchmarks print beside measured speeds, measured in the same run.

* batch-1 decode is bound by memory bandwidth: every weight is read once per step, so
  ``tokens/s <= read bandwidth / bytes of weights read per step``;
* batched decode is bound by compute: ``tokens/s <= GEMM rate / (2 * parameters)``
  (one multiply-add per parameter per token; attention FLOPs left out, small at these lengths).
  The float32 GEMM rate sets the bound of the float engines; a W8A8 engine's linears run at
  the integer GEMM rate (:func:`ort_int8_gemm_rate`), printed beside it.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np


def read_bandwidth(num_threads: int | None = None, nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Read bandwidth (bytes/s): ``num_threads`` threads each take the maximum of their share of
    a ``nbytes`` float32 array (numpy releases the GIL in the reduction); best of ``repeats``.
    The maximum is a load and a compare per vector: numpy's sum, pairwise, ran at ~11 GB/s a
    core on the Xeon VM of session 41, below what its caches deliver (~25 GB/s a core
    for the maximum over 100 MB). Over the default 512 MiB, more than the L3 of the machines
    so far, this is the DRAM rate; over fewer bytes, read again and again as decode steps read
    their weights, it is what the caches give (:func:`resident_read_bandwidth`)."""
    return _best_threaded_read(np.ones(nbytes // 4, np.float32), num_threads, repeats)


def resident_read_bandwidth(nbytes: int, num_threads: int | None = None, repeats: int = 9) -> float:
    """Read bandwidth (bytes/s) over ``nbytes``, the same buffer read again and again (best of
    ``repeats`` after one warm-up pass over it): a decode step's weights as a batch-1 engine
    sees them when they fit in the CPU's last-level cache (the Xeon VM of session 41, 480 MiB
    L3: ~50 GB/s over 100 MB, against ~31 from DRAM). The suite's bounds use the DRAM rate
    (:func:`read_bandwidth` over 512 MiB), as the issue defines them; this one shows how much of
    an engine's bytes the caches could serve."""
    data = np.ones(nbytes // 4, np.float32)
    _best_threaded_read(data, num_threads, 1)
    return _best_threaded_read(data, num_threads, repeats)


def _best_threaded_read(data: np.ndarray, num_threads: int | None, repeats: int) -> float:
    """Bytes/s of the fastest of ``repeats`` passes of ``num_threads`` threads (default all
    cores) each taking the maximum of their share of ``data``."""
    parts = np.array_split(data, num_threads or os.cpu_count() or 1)
    best = float("inf")
    for _ in range(repeats):
        threads = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        best = min(best, time.perf_counter() - t)
    return data.nbytes / best


def gemv_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Read bandwidth (bytes/s) seen by BLAS matrix-vector product over a ``nbytes`` float32
    matrix (all cores): the access pattern of batch-1 decode. Best of ``repeats``."""
    a = np.ones((nbytes // 4 // 4096, 4096), np.float32)
    x = np.ones(4096, np.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ x
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def gemm_rate(n: int = 2048, repeats: int = 5) -> float:
    """fp32 GEMM rate (FLOP/s) of numpy's BLAS on ``n x n x n`` (all cores), best of ``repeats``."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = a.T.copy()
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def float_gemm_rates(num_threads: int | None = None) -> tuple[float, float]:
    """fp32 GEMM rates now (FLOP/s, 2048^3): ONNX Runtime's MLAS, then numpy's BLAS. MLAS
    goes first: after a numpy BLAS call OpenBLAS's threads spin for a while, and an ONNX
    Runtime GEMM right after ran 15-20% slower on 2 cores (session 25)."""
    ort_rate = ort_gemm_rate(num_threads=num_threads)
    return ort_rate, gemm_rate()


def ort_gemm_rate(n: int = 2048, num_threads: int | None = None, repeats: int = 5) -> float:
    """fp32 GEMM rate (FLOP/s) of ONNX Runtime's own kernel (MLAS, prepacked B) on
    ``n x n x n``, best of ``repeats``: what the engine's GEMMs can reach."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gemm", ["a", "w"], ["y"], transB=1)], "gemm",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    return 2 * n ** 3 / _best_run_seconds(model, {"a": w}, num_threads, repeats)


def _best_run_seconds(model, feed: dict, num_threads: int | None, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of a one-node ONNX Runtime ``model`` (after
    one warm-up run), on ``num_threads`` threads (default all cores)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = num_threads or os.cpu_count() or 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, feed)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run(None, feed)
        best = min(best, time.perf_counter() - t)
    return best


def ort_int8_gemm_rate(n: int = 2048, num_threads: int | None = None, repeats: int = 5) -> float:
    """Integer GEMM rate (multiply-adds x 2 per second) of ONNX Runtime's
    ``MatMulIntegerToFloat`` with uint8 A and int8 B (MLAS's u8s8 kernel, prepacked B: AMX or
    VNNI where the CPU has them) on ``n x n x n``, best of ``repeats``: what a W8A8 engine's
    GEMMs can reach. Where that kernel saturates (no VNNI or AMX), B as uint8 with zero point
    128, as the runner then loads w8a8 weights (``trtllm_lite/runners/w8a8_uint8.py``)."""
    from onnx import TensorProto, helper, numpy_helper

    from trtllm_lite.runners.w8a8_uint8 import uint8_int8_gemm_saturates

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (n, n), dtype=np.uint8)
    b = rng.integers(-127, 128, (n, n), dtype=np.int8)
    unsigned = uint8_int8_gemm_saturates()
    inits = [numpy_helper.from_array(b.view(np.uint8) ^ np.uint8(0x80) if unsigned else b, "b"),
             numpy_helper.from_array(np.array(1.0, np.float32), "a_scale"),
             numpy_helper.from_array(np.full(n, 1e-3, np.float32), "b_scale"),
             numpy_helper.from_array(np.array(128, np.uint8), "zero_point")]
    node = helper.make_node("MatMulIntegerToFloat", ["a", "b", "a_scale", "b_scale", "zero_point"]
                            + (["zero_point"] if unsigned else []), ["y"], domain="com.microsoft")
    graph = helper.make_graph([node], "int8_gemm", [helper.make_tensor_value_info("a", TensorProto.UINT8, [n, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])
    return 2 * n ** 3 / _best_run_seconds(model, {"a": a}, num_threads, repeats)


def decode_bytes_per_step(manifest: dict, streamed: bool = True) -> int:
    """Bytes of weights one decode step reads, from an engine manifest's weight table.

    Every per-layer tensor, the final norm and the lm_head (the tied embedding when it is the
    lm_head and stays float; its quantized form when quantized). The embedding Gather reads a
    few rows and the rotary tables one row per token: both left out, like the KV cache.

    ``streamed``: for an engine built at accuracy level 0, whose 4-bit weights the
    ``QuantizedLinear`` kernel reads in its own layout, count that layout (per 16 rows and
    block: the codes, then 16 scales and 16 offsets, float16 for GGUF Q4_0/Q4_1/Q8_0 weights,
    float32 otherwise (Q4_K's scales d x sc are not float16 values), no offsets where all are 0; a split 8-bit weight recombined into 8-bit codes:
    ``trtllm_lite/ort_kernels/quantized_linear.cc``), not the engine's tensors (float32 scales
    and offsets, zero points). Otherwise the engine's tensors.
    """
    tensors = manifest["weights"]["tensors"]
    tied = manifest["model"]["tie_word_embeddings"]
    head = "embed.weight" if tied else "lm_head.weight"
    # a float32 engine's FloatLinear panels (builder.fused_ops.use_float_linears) are its weights
    # again in another layout: a step reads one or the other (the same bytes where N is a
    # multiple of 32), so the weights are counted as the engine's Gemm graphs read them
    tensors = {n: t for n, t in tensors.items() if not n.endswith(".panels")}
    quantized_head = any(n.startswith(head + ".") for n in tensors)
    sources = manifest.get("quantization", {}).get("weights", {})
    kernel_layout = streamed and bool(sources) and manifest["build"].get("accuracy_level") == 0
    total = 0
    for name, t in tensors.items():
        if not (name.startswith(("layers.", "final_norm", head + ".")) or (name == head and not quantized_head)):
            continue
        weight, _, part = name.rpartition(".")
        if kernel_layout and weight + ".qweight" in tensors and 2 * tensors[weight + ".qweight"]["shape"][-1] == (
                32 if sources[weight].startswith("gguf:") else manifest["build"]["quant_block_size"]):
            if part == "qweight":   # 4-bit codes: a QuantizedLinear node (8-bit ones stay MatMulNBits)
                n, nb, code_bytes = t["shape"]
                # float16 where every value is exact there: GGUF's own fp16 d and m (not Q4_K's d x sc)
                scale_bytes = 2 if sources[weight].startswith(("gguf:Q4_0", "gguf:Q4_1", "gguf:Q8_0")) else 4
                scale_planes = 2   # 16 scales, then 16 offsets
                if sources[weight].endswith("+split"):   # recombined: 8-bit codes over half the blocks
                    nb, code_bytes = nb // 2, 2 * code_bytes
                    # zero point 128 (GGUF Q8_0, symmetric int8): every offset 0, none stored
                    if sources[weight].startswith("gguf:Q8_0") or (
                            not sources[weight].startswith("gguf:") and manifest["build"].get("quant_symmetric")):
                        scale_planes = 1
                total += -(-n // 16) * 16 * nb * (code_bytes + scale_planes * scale_bytes)
            continue
        total += t["nbytes"]
    return total


def w8a8_compute_bound(manifest: dict, int8_rate: float, float_rate: float) -> float:
    """Tokens/s a W8A8 engine's batched steps can reach: its int8 linears (the
    ``*.int8_weight`` tensors) at ``int8_rate``, its other parameters (the float lm_head) at
    ``float_rate`` (both per second, 2 x multiply-adds). An untied embedding (a rotated
    engine's, builder/rotation.py) is a Gather, no multiply-adds: not counted."""
    int8_params = sum(int(np.prod(t["shape"])) for name, t in manifest["weights"]["tensors"].items()
                      if name.endswith(".int8_weight"))
    model = manifest["model"]
    embedding = 0 if model["tie_word_embeddings"] else model["vocab_size"] * model["hidden_size"]
    float_params = flops_per_token(manifest) / 2 - embedding - int8_params
    return 1.0 / (2 * int8_params / int8_rate + 2 * float_params / float_rate)


def flops_per_token(manifest: dict) -> float:
    """2 x parameters (tied embeddings counted once), from the manifest's model config."""
    from builder.model_config import ModelConfig

    return 2.0 * ModelConfig(**manifest["model"]).num_parameters
