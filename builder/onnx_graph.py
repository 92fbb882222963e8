"""A small helper to write ONNX graphs node by node, with shared external weights."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 20  # default-domain opset of every graph and of the PagedAttention function
MS_DOMAIN = "com.microsoft"  # ONNX Runtime contrib ops (MatMulNBits, RotaryEmbedding, GroupQueryAttention)

_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
               np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8}


def onnx_dtype(dtype) -> int:
    """The ONNX ``TensorProto`` element type of a numpy dtype. KeyError for others."""
    return _NP_TO_ONNX[np.dtype(dtype)]


class NodeWriter:
    """Appends nodes to a list and returns their output names.

    ``w.op("MatMul", a, b)`` adds a node and returns its single output name; ``outputs=n``
    returns a list of n names. Constants become ``Constant`` nodes (function bodies cannot
    hold initializers).
    """

    def __init__(self, prefix: str = ""):
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix
        self._ids = itertools.count()

    def fresh(self, hint: str) -> str:
        return f"{self.prefix}{hint}_{next(self._ids)}"

    def op(self, op_type: str, *inputs: str, outputs: int | list[str] = 1, domain: str = "",
           name: str | None = None, **attrs) -> str | list[str]:
        if isinstance(outputs, int):
            outs = [self.fresh(op_type.lower()) for _ in range(outputs)]
        else:
            outs = list(outputs)
        node = helper.make_node(op_type, list(inputs), outs, name=name or self.fresh(op_type),
                                domain=domain, **attrs)
        self.nodes.append(node)
        return outs[0] if len(outs) == 1 and isinstance(outputs, int) and outputs == 1 else outs

    def const(self, value, dtype=np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        return self.op("Constant", value=numpy_helper.from_array(arr, self.fresh("c")))


class WeightStore:
    """Collects initializers and lays them out in one external weights file.

    Every graph that references a weight points at the same ``(offset, length)`` in the same
    file, so both graphs share one copy on disk (and the runtime one copy in memory).
    """

    ALIGN = 64

    def __init__(self, filename: str = "weights.bin"):
        self.filename = filename
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, array: np.ndarray) -> str:
        if name in self.arrays:
            raise ValueError(f"weight {name!r} added twice")
        self.arrays[name] = np.ascontiguousarray(array)
        return name

    def layout(self) -> dict[str, dict]:
        """``name -> {offset, nbytes, shape, dtype}`` in file order (bytes, aligned)."""
        table, offset = {}, 0
        for name, arr in self.arrays.items():
            offset = -(-offset // self.ALIGN) * self.ALIGN
            table[name] = {"offset": offset, "nbytes": int(arr.nbytes), "shape": list(arr.shape),
                           "dtype": arr.dtype.name}
            offset += arr.nbytes
        return table

    def write(self, path: str, progress=None) -> dict[str, dict]:
        table = self.layout()
        with open(path, "wb") as f:
            for i, (name, arr) in enumerate(self.arrays.items()):
                f.seek(table[name]["offset"])
                f.write(arr.tobytes())
                if progress:
                    progress(i + 1, len(self.arrays))
        return table

    def initializer_protos(self, names) -> list[onnx.TensorProto]:
        """External-data TensorProtos for ``names`` (no bytes inline)."""
        table = self.layout()
        protos = []
        for name in names:
            arr, entry = self.arrays[name], table[name]
            proto = TensorProto(name=name, data_type=onnx_dtype(arr.dtype), dims=list(arr.shape))
            proto.data_location = TensorProto.EXTERNAL
            for k, v in (("location", self.filename), ("offset", str(entry["offset"])),
                         ("length", str(entry["nbytes"]))):
                proto.external_data.add(key=k, value=v)
            protos.append(proto)
        return protos
