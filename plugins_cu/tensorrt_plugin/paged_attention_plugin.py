"""``trtllm_lite::PagedAttention`` as a TensorRT IPluginV3 written in Python (TensorRT >= 10.3).

The plugin runs the op's CUDA kernels (``plugins_cu/``, ``tl_paged_attention`` through
:mod:`trtllm_lite.cuda`): it writes the step's K/V into the pools **in place** and returns the
attention output. It is the in-process twin of the C++ library in this folder
(``PagedAttentionPlugin.cpp``, same name, version, fields and I/O); build either into an engine,
load the same one at run time.

I/O (the ``kv_write="in_op"`` graphs of :mod:`builder.export_onnx`; shapes as in
``builder/paged_attention.py``)::

    inputs   0 query [T, H, D]   1 key [T, Hkv, D]   2 value [T, Hkv, D]       fp16 | bf16
             3 key_cache, 4 value_cache [num_blocks, block_size, Hkv, D]       same type
             5 slot_mapping [T]  6 block_tables [S, max_blocks]  7 context_lens [S]
             8 query_start_loc [S + 1]                                         int64
    outputs  0 output [T, H, D]
             1 key_cache_out  = input 3 (aliased: IPluginV3OneBuildV2.get_aliased_input)
             2 value_cache_out = input 4 (aliased)
    fields   num_heads, num_kv_heads (int32), scale (float32)  -- the ONNX node's attributes

With ``PreviewFeature.ALIASED_PLUGIN_IO_10_03`` on, TensorRT hands the plugin the same buffer
for input 3 and output 1 (it may insert a copy to make that so, never when the pool comes
straight from a network input used only by this node); the kernels write the new K/V through
the output pointers, so the pool is updated where it lives and never round-trips to the host.

Kernel bounds the plugin cannot read from device memory without a sync: ``max_query_len`` is
1 when ``T == S`` (every sequence has at least one token, so each has exactly one: the decode
kernel) and ``T`` otherwise; ``max_seq_len`` is ``max_blocks * block_size``. Both only size
grids (an overstated bound costs idle thread blocks, never correctness).

Why not the ``tensorrt.plugin`` ahead-of-time path: an AOT implementation is one kernel launch
whose grid is a symbolic expression of the input shapes, while the op is a KV write followed by
either a decode split + merge pair (flash-decoding) or the prefill kernel, chosen from the
shapes. The C++ library is the no-Python-at-run-time path.
"""
from __future__ import annotations

import numpy as np

PLUGIN_NAME = "PagedAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "trtllm_lite"
NUM_INPUTS, NUM_OUTPUTS = 9, 3
ALIASES = {1: 3, 2: 4}          # output index -> input index it aliases (the pools)
FLOAT_INPUTS = (0, 1, 2, 3, 4)  # query, key, value, key_cache, value_cache
DTYPE_NAMES = {"HALF": "float16", "BF16": "bfloat16"}


def kernel_arguments(query_shape, key_cache_shape, block_tables_shape, num_heads: int,
                     num_kv_heads: int) -> dict:
    """Sizes ``tl_paged_attention`` takes, from the step's tensor shapes alone.

    Args:
        query_shape: ``(T, H, D)``; key_cache_shape: ``(num_blocks, block_size, Hkv, D)``;
        block_tables_shape: ``(S, max_blocks)``. num_heads, num_kv_heads: the node's fields.
    Returns:
        keyword arguments of :func:`trtllm_lite.cuda.paged_attention` except pointers, dtype,
        scale, workspace and stream.
    Raises:
        ValueError: the shapes disagree with each other or with the fields.
    """
    num_tokens, heads, head_dim = (int(x) for x in query_shape)
    _, block_size, kv_heads, kv_dim = (int(x) for x in key_cache_shape)
    num_seqs, max_blocks = (int(x) for x in block_tables_shape)
    if (heads, kv_heads, kv_dim) != (num_heads, num_kv_heads, head_dim):
        raise ValueError(f"PagedAttention: query {tuple(query_shape)} / key_cache "
                         f"{tuple(key_cache_shape)} disagree with num_heads {num_heads}, "
                         f"num_kv_heads {num_kv_heads}")
    return dict(num_seqs=num_seqs, num_tokens=num_tokens,
                max_query_len=1 if num_tokens == num_seqs else num_tokens,
                max_seq_len=max_blocks * block_size, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                max_blocks_per_seq=max_blocks)


def launch(dtype: str, args: dict, scale: float, inputs, outputs, workspace: int,
           workspace_size: int, stream: int) -> None:
    """Run the op on device pointers: ``inputs`` (9) and ``outputs`` (3) as in the module
    docstring; the pools are read and written through ``outputs[1]`` / ``outputs[2]``."""
    from trtllm_lite.cuda import paged_attention

    q, k, v, _, _, slots, tables, ctx, qsl = (int(p) for p in inputs)
    paged_attention(dtype=dtype, query=q, key=k, value=v, key_cache=int(outputs[1]),
                    value_cache=int(outputs[2]), out=int(outputs[0]), slot_mapping=slots,
                    block_tables=tables, context_lens=ctx, query_start_loc=qsl, scale=scale,
                    workspace=workspace, workspace_size=workspace_size, stream=stream, **args)


def workspace_bytes(max_query_shape, max_block_tables_shape, key_cache_shape, num_heads: int,
                    num_kv_heads: int) -> int:
    """Scratch for the split decode at the profile's largest shapes (bytes)."""
    from trtllm_lite.cuda import decode_workspace_size

    args = kernel_arguments(max_query_shape, key_cache_shape, max_block_tables_shape,
                            num_heads, num_kv_heads)
    return decode_workspace_size(args["num_seqs"], num_heads, num_kv_heads, args["head_dim"],
                                 args["max_seq_len"])


def _fields(fc) -> dict:
    """``{name: value}`` from a PluginFieldCollection (ints as int, floats as float)."""
    out = {}
    for f in fc or []:
        data = np.asarray(f.data).reshape(-1)
        out[f.name] = data[0].item() if data.size == 1 else data
    return out


_CLASSES: dict = {}


def plugin_classes(trt):
    """``(PagedAttentionPlugin, PagedAttentionPluginCreator)`` for the module ``trt``
    (``tensorrt``; ``tensorrt_rtx`` has the same plugin API)."""
    if trt.__name__ in _CLASSES:
        return _CLASSES[trt.__name__]

    class PagedAttentionPlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuildV2,
                               trt.IPluginV3OneRuntime):
        """The op on the CUDA kernels; fields ``num_heads``, ``num_kv_heads``, ``scale``."""

        def __init__(self, fields: dict | None = None, phase=None):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuildV2.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.plugin_name, self.plugin_version = PLUGIN_NAME, PLUGIN_VERSION
            self.plugin_namespace, self.num_outputs = PLUGIN_NAMESPACE, NUM_OUTPUTS
            self.timing_cache_id = ""
            self.phase = phase
            fields = fields or {}
            missing = {"num_heads", "num_kv_heads", "scale"} - set(fields)
            if fields and missing:
                raise ValueError(f"PagedAttention plugin: missing fields {sorted(missing)}")
            self.num_heads = int(fields.get("num_heads", 0))
            self.num_kv_heads = int(fields.get("num_kv_heads", 0))
            self.scale = float(fields.get("scale", 0.0))
            self.args: dict = {}
            self.workspace = 0

        # -- core
        def get_capability_interface(self, type):
            return self

        def clone(self):
            other = PagedAttentionPlugin()
            other.__dict__.update(self.__dict__)
            return other

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection([
                trt.PluginField("num_heads", np.array([self.num_heads], np.int32), trt.PluginFieldType.INT32),
                trt.PluginField("num_kv_heads", np.array([self.num_kv_heads], np.int32), trt.PluginFieldType.INT32),
                trt.PluginField("scale", np.array([self.scale], np.float32), trt.PluginFieldType.FLOAT32)])

        # -- build
        def get_output_data_types(self, input_types):
            return [input_types[0], input_types[3], input_types[4]]

        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            return [trt.DimsExprs(inputs[0]), trt.DimsExprs(inputs[3]), trt.DimsExprs(inputs[4])]

        def get_aliased_input(self, output_index):
            return ALIASES.get(output_index, -1)

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            if pos in FLOAT_INPUTS or pos >= NUM_INPUTS:
                same = desc.type == in_out[0].desc.type
                return desc.type in (trt.DataType.HALF, trt.DataType.BF16) and same
            return desc.type == trt.DataType.INT64

        def configure_plugin(self, inputs, outputs):
            pass

        def get_workspace_size(self, inputs, outputs):
            return workspace_bytes(tuple(inputs[0].max), tuple(inputs[6].max), tuple(inputs[3].max),
                                   self.num_heads, self.num_kv_heads)

        # -- runtime
        def on_shape_change(self, inputs, outputs):
            from trtllm_lite.cuda import decode_workspace_size

            self.args = a = kernel_arguments(tuple(inputs[0].dims), tuple(inputs[3].dims),
                                             tuple(inputs[6].dims), self.num_heads, self.num_kv_heads)
            self.workspace = decode_workspace_size(a["num_seqs"], self.num_heads, self.num_kv_heads,
                                                   a["head_dim"], a["max_seq_len"])

        def attach_to_context(self, context):
            return self.clone()

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            dtype = DTYPE_NAMES[input_desc[0].type.name]
            launch(dtype, self.args, self.scale, inputs, outputs, int(workspace or 0),
                   self.workspace, int(stream))

        def set_tactic(self, tactic):
            pass

    class PagedAttentionPluginCreator(trt.IPluginCreatorV3One):
        """Creates :class:`PagedAttentionPlugin` from the ONNX node's attributes or an engine."""

        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_version, self.plugin_namespace = (
                PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
            self.field_names = trt.PluginFieldCollection([
                trt.PluginField("num_heads", np.array([], np.int32), trt.PluginFieldType.INT32),
                trt.PluginField("num_kv_heads", np.array([], np.int32), trt.PluginFieldType.INT32),
                trt.PluginField("scale", np.array([], np.float32), trt.PluginFieldType.FLOAT32)])

        def create_plugin(self, name, fc, phase):
            return PagedAttentionPlugin(_fields(fc), phase)

    _CLASSES[trt.__name__] = (PagedAttentionPlugin, PagedAttentionPluginCreator)
    return _CLASSES[trt.__name__]


_REGISTERED: dict = {}


def register(trt) -> object:
    """Register the creator with ``trt``'s plugin registry once (namespace ``trtllm_lite``);
    return it (keep it alive as long as engines use the plugin)."""
    if trt.__name__ not in _REGISTERED:
        creator = plugin_classes(trt)[1]()
        if not trt.get_plugin_registry().register_creator(creator, PLUGIN_NAMESPACE):
            raise RuntimeError("could not register the trtllm_lite::PagedAttention plugin creator")
        _REGISTERED[trt.__name__] = creator
    return _REGISTERED[trt.__name__]
