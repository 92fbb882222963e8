"""ONNX Runtime model runner (CPU execution provider): the embedded default backend.

Memory:
  * weights, default (prepacking on): one session (the prefill graph, which also runs
    decode steps) reads ``weights.bin`` and repacks its GEMM weights once; the weights live
    in memory once. With ``OrtOptions(enable_prepacking=False)``, and for a float32 engine's
    ``FloatLinear`` graphs (nothing to repack): the tensors the graphs read are read once into
    one buffer on transparent huge pages (:func:`load_weights`) and every initializer is an
    OrtValue view of it (``SessionOptions.add_initializer``), shared by both sessions.
  * KV pools: ``key_cache`` / ``value_cache`` ``[num_layers, num_blocks, block_size,
    num_kv_heads, head_dim]`` numpy arrays, float32 or float16 (build's kv_cache_dtype; float16
    halves the bytes a block holds and attention reads). Each layer's slice is bound once as an
    OrtValue sharing the array's memory; a step never copies the pool into or out of a
    session. The graph reads only the blocks in the step's block tables. With trtllm-lite's
    kernels (the ``*.kernels.onnx`` graphs) each PagedAttention node stores the step's new K/V
    at ``slot_mapping`` itself (``kv_write_in_op``); the plain graphs return them
    (``new_keys``/``new_values``, float32) and :meth:`OnnxRuntimeRunner.execute` stores them
    with one numpy scatter per pool (rounded to nearest even for float16 pools). Either way a
    step costs what it computes and attends, not what the pool holds.
"""
from __future__ import annotations

import functools
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from .. import ort_kernels
from . import w8a8_uint8
from ..engine_dir import EngineDir, clip_to_float16_range
from ..core.host_memory import KV_POOL_TOO_LARGE, available_memory_bytes, prefault
from .base import (ScheduledSeq, StepBatch, StepInputs, build_step_inputs, decode_step_inputs,
                   group_by_query_length, write_decode_step_inputs)

_INPUT_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens",
                 "query_start_loc")


def _tensor(raw: np.ndarray, entry: dict) -> np.ndarray:
    """``raw`` (uint8 bytes) as the tensor a weight-table entry describes (dtype, shape)."""
    return raw.view(np.dtype(entry["dtype"])).reshape(entry["shape"])


def read_weight(engine: EngineDir, name: str) -> np.ndarray:
    """One tensor of ``weights.bin`` (per the manifest's weight table), read alone."""
    info = engine.manifest["weights"]
    t = info["tensors"][name]
    return _tensor(np.fromfile(engine.file(info["file"]), dtype=np.uint8, count=t["nbytes"], offset=t["offset"]), t)


def load_weights(engine: EngineDir, files: list[str] | None = None) -> dict[str, np.ndarray]:
    """Read the weights into one buffer of this process's own; return ``name -> view`` per the
    manifest's weight table. With ``files`` (graph files), only the tensors those graphs read,
    where the manifest lists them (``graph_weights``: a float32 engine's ``FloatLinear`` graphs
    read its weights' panels, the others the weights themselves; each set is what one copy in
    memory should hold).

    The buffer is anonymous memory the kernel is asked to back with 2 MiB pages
    (:func:`huge_page_buffer`): a decode step streams every weight, and on 4 KiB pages each
    page costs a TLB miss and stops the hardware prefetcher at its edge (ONNX Runtime maps
    ``weights.bin`` itself, on 4 KiB pages, where it reads the file)."""
    info = engine.manifest["weights"]
    tensors = info["tensors"]
    listed = engine.manifest.get("graph_weights") or {}
    if files and all(f in listed for f in files):
        wanted = set().union(*(listed[f] for f in files))
        tensors = {name: t for name, t in tensors.items() if name in wanted}
    places, size = {}, 0
    for name, t in tensors.items():   # 64-byte aligned
        size = -(-size // 64) * 64
        places[name] = size
        size += t["nbytes"]
    buffer = huge_page_buffer(size)
    with open(engine.file(info["file"]), "rb") as f:
        for name, t in sorted(tensors.items(), key=lambda item: item[1]["offset"]):
            f.seek(t["offset"])
            if f.readinto(memoryview(buffer[places[name]:places[name] + t["nbytes"]])) != t["nbytes"]:
                raise ValueError(f"engine {engine.path!r}: {info['file']} ends inside weight {name!r}")
    return {name: _tensor(buffer[places[name]:places[name] + t["nbytes"]], t) for name, t in tensors.items()}


def huge_page_buffer(size: int) -> np.ndarray:
    """``size`` bytes (uint8, zeroed) of anonymous memory advised onto transparent huge pages
    where the kernel offers them (Linux ``MADV_HUGEPAGE``; elsewhere plain pages)."""
    import mmap

    # private: Python's default anonymous map is shared memory, which these pages do not reach
    region = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:   # (a kernel without transparent huge pages)
            pass
    return np.frombuffer(region, np.uint8, count=size)


def run_options() -> ort.RunOptions:
    """Run options for every graph call: ``gpu_graph_id`` set to -1 (no graph capture, which the
    CPU provider does not do anyway). Unset, onnxruntime's Python ``run_with_iobinding`` looks it
    up and catches the error a missing entry raises, ~35-80 us per call (SmolLM2 int4's batch-1
    decode step is ~6 ms)."""
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "-1")
    return options


@dataclass
class OrtOptions:
    """ONNX Runtime CPU options that matter for speed and memory.

    Attributes:
        intra_op_num_threads: threads per operator (default: all cores).
        accuracy_level: MatMulNBits compute precision for quantized engines: 0 (float32
            activations, results match the float32 engine) or 4 (int8 activations: faster,
            changes results); ``None`` keeps the engine's build value. Picks the graph
            variant the builder wrote for that level.
        enable_cpu_mem_arena: ONNX Runtime's CPU arena (reuses activation buffers between
            steps; off returns them to the system after each run: measured slower and, from
            fragmentation, a higher peak).
        arena_shrinkage: give the arena's unused chunks back after a run whose attention
            scores could be large (default on; :data:`ARENA_SHRINK_SCORE_BYTES`). A long
            prompt's attention scores (about 1 GB for 2048 tokens in the general body)
            otherwise stay held for the process's life; measured on SmolLM2 fp32 serving:
            peak RSS 2.9 GB instead of 3.7 GB with a 2 GiB KV pool. Shrinking after every run
            instead made the next run page its buffers in again: a 1,024-token prompt step
            ~16% slower (~5% of the prompt phase of 64 random-length requests). Not where
            trtllm-lite's kernels are registered: their attention allocates no scores.
        enable_prepacking: let kernels repack constant weights at load (default on). Then
            ONNX Runtime reads ``weights.bin`` itself, keeps the packed weights (and the
            originals only where an unpacked reader needs them, e.g. the embedding Gather)
            and every step runs through the prefill graph in one session, so the weights are
            in memory once. MatMulNBits' fast kernels need it (off: every call dequantizes
            the whole weight, SmolLM2 int4 decodes at 1.5 tokens/s); for float32 Gemm it
            measured 1.1x (batch 64) to 1.46x (batch 1, one thread) faster for +94 MB RSS
            on SmolLM2 (the packed lm_head beside the embedding table). Off: both sessions
            share one numpy copy of ``weights.bin`` (``SessionOptions.add_initializer``). A
            float32 engine's ``FloatLinear`` graphs repack nothing: either way the runner
            holds the tensors they read (the panels, and the embedding table a tied lm_head's
            panels sit beside).
        allow_spinning: intra-op worker threads spin between operators instead of sleeping
            (lower latency on idle cores; wasted cycles when the cores are shared).
        custom_kernels: register trtllm-lite's C++ kernels (:mod:`trtllm_lite.ort_kernels`,
            compiled on first use) so the graphs' ``PagedAttention``, ``RotarySplitQKV``,
            ``SiluAndMul``, ``SkipRMSNorm``, ``AddBlockOffsets``, ``QuantizedLinear`` (and its
            variants), the w8a8 row ops and ``DecoderLayer`` nodes run them instead of their
            ONNX function bodies (same results within float32 rounding; ``SkipRMSNorm`` and
            ``DecoderLayer`` bit for bit); without a C++ compiler the bodies run, with a
            warning.
        float_linear_kernels: where the engine has them (a float32 engine built for the
            onnxruntime backend) and the CPU has AVX-512, take the kernels graphs whose linears
            are ``FloatLinear`` nodes over 32-row weight panels instead of ``Gemm``
            (``trtllm_lite/ort_kernels/float_linear.cc``; default on): SmolLM2 fp32's batch-1
            decode streams its weights at ~36 GB/s where MLAS read them at ~29 on a 2-core Xeon
            VM. Needs ``custom_kernels``; results agree with ``Gemm``'s to float32 rounding.
        w8a8_uint8_weights: give a w8a8 engine's integer GEMMs uint8 weights (``w + 128``, zero
            point 128) instead of int8: ``None`` (the default) does where this CPU's uint8 x
            int8 GEMM saturates (x86 without VNNI or AMX: AVX2, AVX-512 without VNNI; see
            :mod:`trtllm_lite.runners.w8a8_uint8`). Same logits either way where int8 is exact;
            uint8 costs ~10% of the GEMM rate.

    Defaults can be set from the environment: ``TRTLLM_LITE_ORT_THREADS``,
    ``TRTLLM_LITE_ORT_ACCURACY_LEVEL``, ``TRTLLM_LITE_ORT_MEM_ARENA`` (0/1),
    ``TRTLLM_LITE_ORT_ARENA_SHRINKAGE`` (0/1),
    ``TRTLLM_LITE_ORT_PREPACKING`` (0/1), ``TRTLLM_LITE_ORT_SPINNING`` (0/1),
    ``TRTLLM_LITE_ORT_CUSTOM_KERNELS`` (0/1), ``TRTLLM_LITE_ORT_FLOAT_LINEAR`` (0/1),
    ``TRTLLM_LITE_ORT_W8A8_UINT8_WEIGHTS`` (0/1); see
    :meth:`from_env`.
    """

    intra_op_num_threads: int | None = None
    accuracy_level: int | None = None
    enable_cpu_mem_arena: bool = True
    arena_shrinkage: bool = True
    enable_prepacking: bool = True
    allow_spinning: bool = True
    custom_kernels: bool = True
    float_linear_kernels: bool = True
    w8a8_uint8_weights: bool | None = None

    @classmethod
    def from_env(cls, environ=os.environ, **overrides) -> "OrtOptions":
        """Options from ``TRTLLM_LITE_ORT_*`` variables, then ``overrides`` (``None`` skipped).
        Raises ``ValueError`` naming a variable whose value is not an integer, or not one of
        1/true/yes/on and 0/false/no/off for an on/off option."""
        def flag(name):   # (set but empty counts as unset)
            v = environ.get(name, "").strip()
            if not v:
                return None
            if v.lower() in ("1", "true", "yes", "on"):
                return True
            if v.lower() in ("0", "false", "no", "off"):
                return False
            # (QA, session 42: "disable" read as on)
            raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {v!r}")

        def integer(name):
            v = environ.get(name, "").strip()
            try:
                return None if not v else int(v)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {v!r}") from None

        values = {"intra_op_num_threads": integer("TRTLLM_LITE_ORT_THREADS"),
                  "accuracy_level": integer("TRTLLM_LITE_ORT_ACCURACY_LEVEL"),
                  "enable_cpu_mem_arena": flag("TRTLLM_LITE_ORT_MEM_ARENA"),
                  "arena_shrinkage": flag("TRTLLM_LITE_ORT_ARENA_SHRINKAGE"),
                  "enable_prepacking": flag("TRTLLM_LITE_ORT_PREPACKING"),
                  "allow_spinning": flag("TRTLLM_LITE_ORT_SPINNING"),
                  "custom_kernels": flag("TRTLLM_LITE_ORT_CUSTOM_KERNELS"),
                  "float_linear_kernels": flag("TRTLLM_LITE_ORT_FLOAT_LINEAR"),
                  "w8a8_uint8_weights": flag("TRTLLM_LITE_ORT_W8A8_UINT8_WEIGHTS")}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{k: v for k, v in values.items() if v is not None})


# A call whose padded attention scores (num_heads x S x Q x (Lc + Q) float32) may exceed this
# gives the arena's free chunks back after it runs (OrtOptions.arena_shrinkage); smaller
# calls keep them for the next step.
ARENA_SHRINK_SCORE_BYTES = 64 << 20


def is_quantized(engine: EngineDir) -> bool:
    """True when the engine's graphs hold MatMulNBits weights."""
    return engine.build.get("quantization", "none") != "none"


def session_options(num_threads: int | None, prepacking: bool = False,
                    mem_arena: bool = True, spinning: bool = True,
                    custom_kernels: bool = False) -> ort.SessionOptions:
    """CPU defaults: all graph optimizations, one intra-op thread per core, sequential
    execution, prepacking off unless asked, trtllm-lite's kernels registered when asked and
    available (see :class:`OrtOptions`)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = num_threads or os.cpu_count() or 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.enable_cpu_mem_arena = mem_arena
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_prepacking", "0" if prepacking else "1")
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    library = ort_kernels.library_path() if custom_kernels else None
    if library:
        so.register_custom_ops_library(library)
    return so


def graph_files(engine: EngineDir, accuracy_level: int | None = None,
                custom_kernels: bool = False, float_linear: bool = False) -> dict[str, str]:
    """``kind -> graph file`` for the requested MatMulNBits accuracy level; with
    ``custom_kernels`` (trtllm-lite's kernels are registered with the sessions), the graphs
    whose PagedAttention nodes take no metadata inputs and store the step's K/V themselves,
    where the engine has them (built for the onnxruntime backend at its own accuracy level:
    ``builder.paged_attention.without_attention_metadata`` and ``with_kv_write_in_op``), and
    with ``float_linear`` too those whose float32 linears are ``FloatLinear`` nodes, where the
    engine has them (:func:`uses_float_linears`).

    Raises:
        ValueError: the engine was not built with a graph variant for that level.
    """
    files = {kind: g["file"] for kind, g in engine.manifest["graphs"].items()}
    variants = engine.manifest.get("graph_variants", {})
    if accuracy_level is None or accuracy_level == engine.build.get("accuracy_level", accuracy_level):
        if custom_kernels and float_linear and variants.get("float_linear_kernels"):
            return dict(variants["float_linear_kernels"])
        return dict(variants.get("custom_kernels") or files) if custom_kernels else files
    levels = variants.get("accuracy_level", {})
    if str(accuracy_level) not in levels:
        built = sorted({engine.build.get("accuracy_level")} | {int(k) for k in levels} - {None})
        raise ValueError(f"accuracy_level {accuracy_level}: engine {engine.path!r} has graphs for "
                         f"accuracy levels {built}" if is_quantized(engine) else
                         f"accuracy_level {accuracy_level}: engine {engine.path!r} is not quantized")
    return dict(levels[str(accuracy_level)])


def uses_float_linears(options: OrtOptions) -> bool:
    """Whether sessions made with ``options`` take an engine's ``FloatLinear`` graphs where it
    has them: asked for (:attr:`OrtOptions.float_linear_kernels`), trtllm-lite's kernels
    registered, and a CPU with AVX-512 (elsewhere the kernel's portable loop would be slower
    than MLAS, so the ``Gemm`` graphs run)."""
    return (options.float_linear_kernels and kernels_registered(options)
            and "avx512f" in ort_kernels.cpu_flags().split())


def kernels_registered(options: OrtOptions) -> bool:
    """Whether sessions made with ``options`` register trtllm-lite's kernels (asked for, and
    the library builds and loads here)."""
    return options.custom_kernels and ort_kernels.library_path() is not None


def uses_prepacking(engine: EngineDir, options: OrtOptions) -> bool:
    """Whether sessions for ``engine`` repack their weights (see :class:`OrtOptions`)."""
    if not options.enable_prepacking and is_quantized(engine) and engine.build.get("quantization") != "w8a8":
        warnings.warn("prepacking is off for a quantized engine: its MatMulNBits nodes (accuracy level 4, "
                      "or without trtllm-lite's kernels) will dequantize every weight on every call (slow)",
                      stacklevel=3)
    return options.enable_prepacking


def create_sessions(engine: EngineDir, num_threads: int | None = None,
                    weights: dict[str, np.ndarray] | None = None, options: OrtOptions | None = None,
                    kinds: tuple[str, ...] | None = None, files: dict[str, str] | None = None
                    ) -> tuple[dict[str, ort.InferenceSession], dict[str, ort.OrtValue]]:
    """Create the sessions (``kinds``, default both graphs) over one shared copy of the weights;
    ``files``: ``kind -> graph file`` (default :func:`graph_files` for ``options``).

    Returns ``(sessions, ortvalues)``; keep ``ortvalues`` alive as long as the sessions.
    """
    options = options or OrtOptions()
    prepacking = uses_prepacking(engine, options)
    files = files or graph_files(engine, options.accuracy_level, kernels_registered(options),
                                 uses_float_linears(options))
    # FloatLinear graphs (a float32 engine's, builder.fused_ops.use_float_linears) have nothing
    # to repack: their weights go into this process's huge-page buffer (load_weights)
    float_graphs = (engine.manifest.get("graph_variants", {}).get("float_linear_kernels") or {}).values()
    if not prepacking or any(f in float_graphs for f in files.values()):
        weights = weights if weights is not None else load_weights(
            engine, [f for kind, f in files.items() if kinds is None or kind in kinds])
        values = {name: ort.OrtValue.ortvalue_from_numpy(arr) for name, arr in weights.items()}
    else:               # ONNX Runtime reads weights.bin itself and keeps only what it repacks
        values = {}
    sessions = {}
    unsigned = uses_uint8_weights(engine, options)
    converted: dict[str, np.ndarray] = {}   # uint8 weights, made once for both graphs
    uint8: dict[str, np.ndarray] = {}
    for kind, file in files.items():
        if kinds is not None and kind not in kinds:
            continue
        so = session_options(num_threads or options.intra_op_num_threads, prepacking,
                             options.enable_cpu_mem_arena, options.allow_spinning, options.custom_kernels)
        model, uint8 = engine.file(file), {}
        if unsigned:   # the int8 weights leave the graph; their uint8 forms come in memory
            model, uint8 = w8a8_uint8.uint8_weight_graph(
                model, (lambda name: weights[name]) if weights is not None else
                functools.partial(read_weight, engine), converted)
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", engine.path)
            # ONNX Runtime copies these into the session (ONNX Runtime 1.32; checked by
            # tests/test_quantization.py), so they are not kept past its creation
            so.add_external_initializers(list(uint8), [ort.OrtValue.ortvalue_from_numpy(w) for w in uint8.values()])
        int8 = {name[:-len(w8a8_uint8.UINT8_SUFFIX)] for name in uint8}
        for name, value in values.items():
            if name not in int8:
                so.add_initializer(name, value)
        sessions[kind] = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    if unsigned:
        del converted, uint8
        w8a8_uint8.return_freed_memory()
    return sessions, values


def uses_uint8_weights(engine: EngineDir, options: OrtOptions) -> bool:
    """Whether sessions for ``engine`` give its integer GEMMs uint8 weights
    (:attr:`OrtOptions.w8a8_uint8_weights`; only w8a8 engines have them)."""
    if engine.build.get("quantization") != "w8a8":
        return False
    if options.w8a8_uint8_weights is not None:
        return options.w8a8_uint8_weights
    return w8a8_uint8.uint8_int8_gemm_saturates()


class DecodeBinding:
    """A decode-only call's inputs, kept bound to a session's IOBinding between steps (vLLM
    v1's persistent batch, for ONNX Runtime's IOBinding): a step writes its tokens,
    positions, slots and block tables into the bound arrays in place
    (:func:`write_decode_step_inputs`), where the general path makes and binds six or seven
    new input OrtValues each call, and binds a new numpy array as the logits output, which
    ONNX Runtime fills where it would allocate one and the Python API copy it out (SmolLM2
    int4 batch 1 on the 2-core Zen 4 VM, steps interleaved: 1.013-1.019x against the general
    path, which shares the writer; 1.024-1.045x against the general path as it was before).

    The inputs (:attr:`inputs`, a :class:`StepInputs` of :func:`decode_step_inputs`) are bound
    again only when the call's shape changes: its number of sequences ``S``, or a block table
    outgrowing the bound width (kept a multiple of :data:`BLOCK_TABLE_WIDTH_STEP` blocks; the
    kernels read a row only as far as its context), or after the general path bound its own
    (:meth:`invalidate`).

    Args:
        binding: the session's IOBinding, whose KV pool inputs are already bound.
        vocab_size: the logits' width.
        with_logits_indices: the graph takes ``logits_indices`` (the prefill graph, which runs
            decode steps when it is the only session).
    """

    BLOCK_TABLE_WIDTH_STEP = 16

    def __init__(self, binding: ort.IOBinding, vocab_size: int, with_logits_indices: bool):
        self.binding, self.vocab_size, self.with_logits_indices = binding, vocab_size, with_logits_indices
        self.inputs: StepInputs | None = None       # the bound arrays; None: bind at the next call
        self._values: list[ort.OrtValue] = []       # the bound inputs (OrtValues sharing the arrays' memory)
        self._logits: ort.OrtValue | None = None    # the bound output

    def invalidate(self) -> None:
        """The general path bound its own inputs and output here: rebind at the next call."""
        self.inputs = None

    def _bind(self, num_seqs: int, width: int) -> None:
        self.inputs = decode_step_inputs(num_seqs, width)
        names = _INPUT_FIELDS + (("logits_indices",) if self.with_logits_indices else ())
        self._values = [ort.OrtValue.ortvalue_from_numpy(getattr(self.inputs, name)) for name in names]
        for name, value in zip(names, self._values):
            self.binding.bind_ortvalue_input(name, value)

    def prepare(self, seqs: list[ScheduledSeq], block_size: int) -> np.ndarray:
        """Write a decode-only call's inputs (each sequence one new token, one logits row) into
        the bound arrays and bind a new logits array; return it, ``[S, vocab]`` float32, which
        the session's next ``run_with_iobinding`` on this binding fills in ``seqs``' order."""
        longest = max(len(s.block_table) for s in seqs)
        if self.inputs is None or self.inputs.block_tables.shape[0] != len(seqs) or \
                self.inputs.block_tables.shape[1] < longest:
            step = self.BLOCK_TABLE_WIDTH_STEP
            self._bind(len(seqs), -(-longest // step) * step)
        write_decode_step_inputs(seqs, block_size, self.inputs)
        logits = np.empty((len(seqs), self.vocab_size), np.float32)   # a new array every step, as ONNX Runtime's
        self._logits = ort.OrtValue.ortvalue_from_numpy(logits)
        self.binding.bind_ortvalue_output("logits", self._logits)
        return logits


class OnnxRuntimeRunner:
    """Runs steps on the CPU through the prefill and decode sessions.

    With prepacking on (the default, :class:`OrtOptions`) every step runs through the
    prefill graph alone (decode tokens are one-token sequences there, with their logits
    rows requested): packed weights belong to a session, so one session holds them once.

    Args:
        engine: a validated engine directory; its pools are float32 or float16 (build's
            kv_cache_dtype).
        num_kv_blocks: KV blocks in the pool (each ``block_size`` tokens, all layers).
        num_threads: intra-op threads (default: ``options``, else all cores).
        options: ONNX Runtime options (default :meth:`OrtOptions.from_env`).
        prefault_kv_cache: write the K and V pools once here (:func:`prefault`), so the host
            commits their memory at start and no step page-faults; False leaves the pages to
            be committed as blocks are first written (RSS then grows with the peak load).
    Raises:
        ValueError: with ``prefault_kv_cache``, the pools are larger than the memory available
            once the weights are loaded.
        ValueError: ``options.accuracy_level`` names a graph variant the engine lacks, or
            graphs whose PagedAttention nodes store the K/V (``kv_write_in_op``) would run
            without trtllm-lite's kernels.
    """

    def __init__(self, engine: EngineDir, num_kv_blocks: int, num_threads: int | None = None,
                 options: OrtOptions | None = None, prefault_kv_cache: bool = False):
        self.options = options or OrtOptions.from_env()
        self.single_session = uses_prepacking(engine, self.options)
        m, b = engine.model, engine.build
        self.num_layers, self.vocab_size = m["num_layers"], m["vocab_size"]
        self.block_size, self.num_blocks = b["block_size"], num_kv_blocks
        self.kv_shape = (m["num_layers"], num_kv_blocks, b["block_size"], m["num_kv_heads"], m["head_dim"])
        self.kv_dtype = np.dtype(engine.kv_cache_dtype)   # float32 or float16 (build's kv_cache_dtype)
        self.key_cache = np.zeros(self.kv_shape, self.kv_dtype)
        self.value_cache = np.zeros(self.kv_shape, self.kv_dtype)
        kernels = kernels_registered(self.options)
        # the C++ PagedAttention kernel attends each sequence over its own keys (no padding to
        # the call's longest query or context), so any mix of sequences is one graph call
        self.ragged_attention = kernels
        self.graph_files = graph_files(engine, self.options.accuracy_level, kernels,
                                       uses_float_linears(self.options))
        self.sessions, self._weight_values = create_sessions(
            engine, num_threads, options=self.options, kinds=("prefill",) if self.single_session else None,
            files=self.graph_files)
        if prefault_kv_cache:   # after the weights: the memory left then is what the pools may take
            pool_bytes = self.key_cache.nbytes + self.value_cache.nbytes
            available = available_memory_bytes()
            if pool_bytes > available:
                raise ValueError(KV_POOL_TOO_LARGE.format(pool_bytes, available))
            prefault((self.key_cache, self.value_cache), num_threads or self.options.intra_op_num_threads)
        self.num_heads = m["num_heads"]
        self._run_options = run_options()
        self._shrink_options = None     # run options that also shrink the arena, for large calls
        # (the C++ PagedAttention kernel, in whichever graph, allocates no attention scores)
        if self.options.enable_cpu_mem_arena and self.options.arena_shrinkage and not kernels:
            self._shrink_options = run_options()
            self._shrink_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self.graph_time_s = 0.0     # seconds spent inside session runs (host overhead = the rest)
        self._pool_values = []
        self._bindings = {}
        # graphs whose PagedAttention nodes store the step's K/V themselves (the custom-kernel
        # variants: builder.paged_attention.with_kv_write_in_op) return only the logits
        self._stores_kv = {kind: "new_keys" in {o.name for o in sess.get_outputs()}
                           for kind, sess in self.sessions.items()}
        if not kernels and not all(self._stores_kv.values()):   # (only a hand-edited manifest gets here)
            raise ValueError(f"engine {engine.path!r}: graphs {sorted(self.graph_files.values())} store the "
                             f"step's K/V in their PagedAttention nodes, which only trtllm-lite's kernels do, "
                             f"and they are not registered with the sessions")
        for kind, sess in self.sessions.items():
            binding = sess.io_binding()
            for i in range(self.num_layers):
                for name, pool in ((f"key_cache.{i}", self.key_cache), (f"value_cache.{i}", self.value_cache)):
                    value = ort.OrtValue.ortvalue_from_numpy(pool[i])
                    self._pool_values.append(value)
                    binding.bind_ortvalue_input(name, value)
            self._bindings[kind] = binding
        # decode-only calls through inputs kept bound (graphs whose kernels store the K/V)
        self._decode_bindings = {kind: DecodeBinding(self._bindings[kind], self.vocab_size, kind == "prefill")
                                 for kind in self.sessions if not self._stores_kv[kind]}
        self._warm_up()

    def _warm_up(self) -> None:
        """Run each session once at load, on a dummy sequence in the pool's first blocks
        (zeroed again after): trtllm-lite's kernels repack their constant weights at their
        first call (SmolLM2 int4 on 2 cores: ~0.7 s), which would otherwise land in the first
        request's TTFT (QA, session 33: a one-shot ``generate`` showed 700-900 ms). vLLM runs
        the model once at start-up too."""
        tokens = min(2, self.num_blocks * self.block_size)
        if tokens == 0:
            return
        blocks = list(range(-(-tokens // self.block_size)))
        calls = [ScheduledSeq([0] * tokens, blocks, 0, tokens)]     # the prefill graph (decode's at 1 token)
        if "decode" in self.sessions and tokens > 1:
            calls.append(ScheduledSeq([0] * tokens, blocks, tokens - 1, 1))
        for seq in calls:
            self._call([seq])
        self.key_cache[:, blocks] = 0
        self.value_cache[:, blocks] = 0
        self.graph_time_s = 0.0

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one block holds over all layers, K and V (2 bytes an element for float16 pools)."""
        return 2 * int(np.prod(self.kv_shape[:1] + self.kv_shape[2:])) * self.kv_dtype.itemsize

    def _run(self, kind: str, inputs: StepInputs) -> np.ndarray:
        binding = self._bindings[kind]
        if kind in self._decode_bindings:
            self._decode_bindings[kind].invalidate()
        for name in _INPUT_FIELDS:
            binding.bind_cpu_input(name, getattr(inputs, name))
        if kind == "prefill":
            binding.bind_cpu_input("logits_indices", inputs.logits_indices)
        stores_kv = self._stores_kv[kind]
        for name in ("logits", "new_keys", "new_values") if stores_kv else ("logits",):
            binding.bind_output(name, "cpu")
        self._run_bound(kind, self._run_options_for(inputs))
        outputs = binding.get_outputs()
        if stores_kv:
            self._store_kv(inputs.slot_mapping, outputs[1].numpy(), outputs[2].numpy())
        return outputs[0].numpy()

    def _run_bound(self, kind: str, options: ort.RunOptions) -> None:
        t = time.perf_counter()
        self.sessions[kind].run_with_iobinding(self._bindings[kind], options)
        self.graph_time_s += time.perf_counter() - t

    def _run_options_for(self, inputs: StepInputs) -> ort.RunOptions:
        """Shrink the arena after calls whose padded attention scores may pass
        :data:`ARENA_SHRINK_SCORE_BYTES` (long prompts), not after every step."""
        if self._shrink_options is None:
            return self._run_options
        qsl = inputs.query_start_loc
        num_seqs, longest = len(qsl) - 1, int(np.diff(qsl).max())
        context = inputs.block_tables.shape[1] * self.block_size
        score_bytes = 4 * self.num_heads * num_seqs * longest * (context + longest)
        return self._shrink_options if score_bytes > ARENA_SHRINK_SCORE_BYTES else self._run_options

    def _store_kv(self, slot_mapping: np.ndarray, new_keys: np.ndarray, new_values: np.ndarray) -> None:
        """Paged KV write: ``pool[layer, slot] = new[layer, token]`` for the step's tokens, one
        scatter per pool (numpy rounds float32 to float16 pools' type, nearest even; values past
        float16's range saturate at +-65504)."""
        flat = (self.num_layers, -1) + self.kv_shape[3:]
        if self.kv_dtype == np.float16:   # saturate past float16's range (never inf), as the kernel reads them
            new_keys, new_values = clip_to_float16_range(new_keys), clip_to_float16_range(new_values)
        self.key_cache.reshape(flat)[:, slot_mapping] = new_keys
        self.value_cache.reshape(flat)[:, slot_mapping] = new_values

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src -> dst`` in every layer, K and V (copy-on-write)."""
        if pairs:
            src, dst = (np.array(x, np.int64) for x in zip(*pairs))
            self.key_cache[:, dst] = self.key_cache[:, src]
            self.value_cache[:, dst] = self.value_cache[:, src]

    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run one step; return logits ``[batch.num_logits, vocab]`` float32 (a new array).

        The step's sequences (decodes first, then prompt chunks / draft verifications) run
        in one graph call, so the weights are read once per step (measured: a 5-token
        verification costs 1.5x a decode step; decode + verify as two calls cost 2.5x; 64
        random-length requests ran 4-5% faster than in calls split by query length). Without
        trtllm-lite's kernels, the PagedAttention function body pads every sequence of a call,
        so the step runs in as few calls as padding allows (:func:`group_by_query_length`).
        A call whose sequences all compute one token uses the decode graph when its session
        exists.
        """
        seqs = batch.decode + batch.prefill
        if not seqs:
            return np.zeros((0, self.vocab_size), np.float32)
        groups = [list(range(len(seqs)))] if self.ragged_attention else group_by_query_length(seqs)
        if len(groups) == 1:
            return self._call(seqs)
        rows = {}
        for group in groups:
            part = [seqs[i] for i in group]
            ends = np.cumsum([s.num_logits for s in part])
            for i, chunk in zip(group, np.split(self._call(part), ends[:-1])):
                rows[i] = chunk
        return np.concatenate([rows[i] for i in range(len(seqs))])

    def _call(self, seqs: list[ScheduledSeq]) -> np.ndarray:
        """One graph call for ``seqs``; logits rows in their order."""
        kind = "decode" if "decode" in self.sessions else "prefill"
        bound = self._decode_bindings.get(kind)
        if bound is not None and all(s.num_new_tokens == 1 and s.num_logits == 1 for s in seqs):
            logits = bound.prepare(seqs, self.block_size)
            self._run_bound(kind, self._run_options)
            return logits
        inputs = build_step_inputs(seqs, self.block_size)
        if "decode" not in self.sessions or any(s.num_new_tokens != 1 for s in seqs):
            return self._run("prefill", inputs)
        logits = self._run("decode", inputs)
        keep = [s.num_logits > 0 for s in seqs]
        return logits if all(keep) else logits[keep]
