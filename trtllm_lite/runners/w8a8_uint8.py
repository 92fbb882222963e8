"""w8a8's integer GEMM where ONNX Runtime's uint8 x int8 kernel saturates: the weights as uint8.

A w8a8 engine's linears are ``com.microsoft.MatMulIntegerToFloat`` nodes on uint8 activations
(zero point 128) and int8 weights (``builder/export_onnx.py``). On x86 CPUs without VNNI or AMX
(AVX2, and AVX-512 without VNNI: AMD Zen 1-3, older Xeons) ONNX Runtime's MLAS multiplies
them with ``vpmaddubsw``, which adds each pair of uint8 x int8 products into an int16 with
saturation: ``255 * 127 + 255 * 127`` comes out as 32767, not 64770, and the logits are wrong
(ONNX Runtime's quantization guide names the issue and answers it with 7-bit weights,
``reduce_range``). MLAS's uint8 x uint8 kernel widens to int16 first (``vpmaddwd``) and is
exact. Where :func:`uint8_int8_gemm_saturates` finds the saturation, :func:`uint8_weight_graph`
rewrites a graph's int8 weights ``w`` to uint8 ``w + 128`` with a weight zero point of 128:
the same integer products, so the same logits as on a VNNI CPU, at ~0.9x the GEMM rate on a
Zen 3 (measured: 253-261 against 284-289 GOP/s for a 576 x 1536 weight; float32 ~165).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

INTEGER_GEMM = "MatMulIntegerToFloat"
MS_DOMAIN = "com.microsoft"
UINT8_SUFFIX = ".uint8"
WEIGHT_ZERO_POINT = "w8a8.uint8_weight_zero_point"
B_INPUT, B_ZERO_POINT_INPUT = 1, 5     # MatMulIntegerToFloat(A, B, a_scale, b_scale, a_zp, b_zp, bias)


def _probe_model() -> bytes:
    """``[1, 2] uint8 (zero point 128) x [2, 1] int8 (both 127) -> [1, 1] float32``."""
    graph = helper.make_graph(
        [helper.make_node(INTEGER_GEMM, ["a", "b", "one", "one", "zp"], ["y"], domain=MS_DOMAIN)], "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor("b", TensorProto.INT8, [2, 1], [127, 127]),
         helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
         helper.make_tensor("zp", TensorProto.UINT8, [], [128])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
    return model.SerializeToString()


@functools.lru_cache(maxsize=None)
def uint8_int8_gemm_saturates() -> bool:
    """Whether this CPU's ``MatMulIntegerToFloat`` (uint8 x int8) saturates: ``(255 - 128) *
    127 * 2`` must be 32258; a ``vpmaddubsw`` kernel gives ``32767 - 128 * 254 = 255``.
    Measured once per process (a two-element GEMM, ~10 ms)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(_probe_model(), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {"a": np.full((1, 2), 255, np.uint8)})[0]
    return float(got[0, 0]) != 2.0 * 127 * 127


def uint8_weight_graph(graph_path: str, read_weight: Callable[[str], np.ndarray],
                       converted: dict[str, np.ndarray] | None = None) -> tuple[bytes, dict[str, np.ndarray]]:
    """The graph at ``graph_path`` with each ``MatMulIntegerToFloat``'s int8 weight ``w``
    (``[K, N] int8``, read with ``read_weight(name)``) replaced by ``{name}.uint8``, ``w + 128``
    as ``[K, N] uint8``, and a weight zero point of 128 (:data:`WEIGHT_ZERO_POINT`).

    Returns ``(model_bytes, {new name: [K, N] uint8})``: the serialized graph, whose other
    initializers still name ``weights.bin`` (load it with the session config
    ``session.model_external_initializers_file_folder_path`` set to the engine directory),
    and the uint8 weights to give the session with ``add_external_initializers``. The int8
    initializers are dropped from the graph. ``converted``: uint8 weights made for another
    graph of the same engine, reused (and added to).
    """
    model = onnx.load(graph_path, load_external_data=False)
    graph = model.graph
    int8 = {t.name: t for t in graph.initializer if t.data_type == TensorProto.INT8}
    weights: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.op_type != INTEGER_GEMM or node.domain != MS_DOMAIN or node.input[B_INPUT] not in int8:
            continue
        name = node.input[B_INPUT]
        if name + UINT8_SUFFIX not in weights:
            if converted is None or name + UINT8_SUFFIX not in converted:
                w = read_weight(name)
                if w.dtype != np.int8:
                    raise ValueError(f"{graph_path}: weight {name!r} is {w.dtype}, not int8")
                u = w.view(np.uint8) ^ np.uint8(0x80)   # two's complement: w + 128
                if converted is not None:
                    converted[name + UINT8_SUFFIX] = u
            else:
                u = converted[name + UINT8_SUFFIX]
            weights[name + UINT8_SUFFIX] = u
        inputs = list(node.input) + [""] * max(0, B_ZERO_POINT_INPUT + 1 - len(node.input))
        if inputs[B_ZERO_POINT_INPUT]:
            raise ValueError(f"{graph_path}: {node.name or INTEGER_GEMM} already has a weight zero point")
        inputs[B_INPUT], inputs[B_ZERO_POINT_INPUT] = name + UINT8_SUFFIX, WEIGHT_ZERO_POINT
        del node.input[:]
        node.input.extend(inputs)
    if not weights:
        return model.SerializeToString(), weights
    used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name not in int8 or t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.initializer.append(helper.make_tensor(WEIGHT_ZERO_POINT, TensorProto.UINT8, [], [128]))
    for name, w in weights.items():   # declared here; the data comes with add_external_initializers
        t = graph.initializer.add()
        t.name, t.data_type = name, TensorProto.UINT8
        t.dims.extend(w.shape)
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value="(given in memory)")
    return model.SerializeToString(), weights


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; nothing
    elsewhere). The uint8 weights, freed once the sessions hold their own copies, otherwise
    stay in the process's RSS: SmolLM2's w8a8 runner measured 393 MB before, 214 after (the
    int8 path: 213)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
