"""``trtllm-lite build``: checkpoint -> engine directory (graphs, weights, tokenizer, manifest)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import onnx

from trtllm_lite.engine_dir import ENGINE_FORMAT_VERSION, MANIFEST, check_kv_cache_dtype_name, sha256_file

from .export_onnx import export_graphs
from .fused_ops import fuse_decoder_layers, use_float_linears
from .draft import keep_first_layers
from .loaders import load_model
from .paged_attention import with_kv_write_in_op, without_attention_metadata
from .quantize import QUANTIZATIONS, W8A8, quantize_model
from .rotation import down_block, rotate_activations
from .compile_tensorrt import (KV_WRITE, PRECISIONS, ProfileLimits, check_kv_cache_dtype, compile_engine,
                               import_tensorrt)

BACKENDS = ("onnxruntime", "tensorrt", "tensorrt-rtx")
DTYPES = {"onnxruntime": ("float32",), **PRECISIONS}  # what each backend builds


@dataclass
class BuildConfig:
    """Build-time limits, in the TensorRT-LLM habit (``max_batch_size`` ~ ``max_num_seqs``).

    ``max_num_batched_tokens``: tokens one step may compute (the token budget);
    ``max_seq_len``: prompt + output tokens of one sequence; ``block_size``: tokens per KV block.

    Quantization (:mod:`builder.quantize`): ``quantization`` ``none`` / ``int8`` / ``int4``
    (weight-only, MatMulNBits) / ``w8a8`` (int8 weights per channel and activations per
    token, ONNX Runtime's integer GEMM: faster batched steps, changes results;
    ``activation_planes`` 2, the default: ~15-bit activations, only the weights' rounding
    changes results; or 1, classic W8A8: faster, changes them more); ``quant_block_size``
    weights per scale (not w8a8); ``quant_symmetric`` (else an integer
    zero point per block); ``quantize_lm_head`` (``None``: only when the GGUF stores the
    lm_head / tied embedding quantized, mapped exactly; ``False``: float32; ``True``:
    always); ``accuracy_level``: MatMulNBits' compute precision (0: float32 activations,
    the default; 4: int8 activations, faster, changes results; the runtime can switch).

    ``rotate_activations`` (:mod:`builder.rotation`, the Llama family, ``none`` or ``w8a8``,
    onnxruntime backend): the residual stream and the down projections' inputs rotated so that
    per-token int8 activations lose less; ``None``: on for the Llama family's w8a8, else off
    (recorded in the manifest as chosen). The tied embedding /
    lm_head become two tensors.

    ``kv_cache_dtype``: the KV pools' element type, ``"float32"`` (default) or ``"float16"``
    (half the bytes per block; K/V rounded to float16 when stored, attention still computed
    in float32; onnxruntime backend only: the TensorRT backends' pools follow ``dtype``).
    """

    backend: str = "onnxruntime"
    dtype: str = "float32"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_seq_len: int = 2048
    draft_layers: int | None = None
    quantization: str = "none"
    quant_block_size: int = 32
    quant_symmetric: bool = True
    quantize_lm_head: bool | None = None
    accuracy_level: int | None = None
    kv_cache_dtype: str = "float32"
    activation_planes: int | None = None
    rotate_activations: bool | None = None

    def validate(self, max_positions: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad option; ``max_positions`` (the model's
        ``max_position_embeddings``; ``None`` before the model is loaded) bounds ``max_seq_len``."""
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r} is not built here; choose from {BACKENDS}")
        try:
            check_kv_cache_dtype_name(self.kv_cache_dtype)
        except ValueError as e:
            raise ValueError(f"--kv-cache-dtype: {e}") from None
        if self.backend in KV_WRITE:   # (before --dtype: the KV cache option is the one to drop)
            check_kv_cache_dtype(self.backend, self.kv_cache_dtype, self.dtype)
        if self.rotate_activations and (self.quantization not in ("none", W8A8) or self.backend != "onnxruntime"):
            raise ValueError(f"--rotate-activations: only --quantization none or w8a8 on the onnxruntime backend "
                             f"(got --quantization {self.quantization}, --backend {self.backend}): it rotates "
                             "float weights, and the w8a8 activations are what it is for")
        if self.dtype not in DTYPES[self.backend]:
            raise ValueError(f"--dtype {self.dtype!r}: the {self.backend} backend builds "
                             f"{' or '.join(DTYPES[self.backend])}")
        if self.backend in KV_WRITE and self.quantization != "none":
            raise ValueError(f"--quantization {self.quantization!r}: the {self.backend} backend "
                             "builds unquantized weights (MatMulNBits and MatMulIntegerToFloat are ONNX Runtime's ops)")
        if self.backend in KV_WRITE:
            import_tensorrt(self.backend)  # fail before exporting when the package is missing
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2 (one prompt token and one output token), "
                             f"got {self.max_seq_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:   # the runtime's (and vLLM's) check, at build time
            raise ValueError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                             f"--max-num-seqs ({self.max_num_seqs}): a decode step holds one token per sequence")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization!r}: choose from {QUANTIZATIONS}")
        if self.quant_block_size < 16 or self.quant_block_size & (self.quant_block_size - 1):
            raise ValueError(f"--quant-block-size must be a power of two >= 16, got {self.quant_block_size}")
        if self.activation_planes is not None and self.quantization != W8A8:
            raise ValueError(f"--activation-planes {self.activation_planes}: only --quantization w8a8 "
                             "quantizes activations")
        if self.quantization == W8A8 and self.activation_planes is None:
            self.activation_planes = 2
        if self.quantization == W8A8 and self.activation_planes not in (1, 2):
            raise ValueError(f"--activation-planes must be 1 or 2, got {self.activation_planes}")
        if self.quantization == W8A8 and (self.quant_block_size != 32 or not self.quant_symmetric):
            raise ValueError("--quant-block-size / --quant-asymmetric: w8a8 weights take one symmetric "
                             "scale per output channel, no blocks")
        if self.quantization == W8A8 and self.accuracy_level not in (None, 0):
            raise ValueError(f"--accuracy-level {self.accuracy_level}: it sets MatMulNBits' precision "
                             "(--quantization int8 / int4); w8a8 always takes int8 activations")
        if self.quantization == "none" and self.quantize_lm_head:   # (QA: accepted and recorded, no effect)
            raise ValueError("--quantize-lm-head: --quantization none quantizes nothing; "
                             "add --quantization int8, int4 or w8a8")
        if self.draft_layers is not None and self.draft_layers < 1:   # (QA: 0 built the whole model)
            raise ValueError(f"--draft-layers must be >= 1, got {self.draft_layers}")
        if self.quantization == "none" and self.accuracy_level not in (None, 0):   # (QA: accepted, no effect)
            raise ValueError(f"--accuracy-level {self.accuracy_level}: it sets MatMulNBits' precision "
                             "(--quantization int8 / int4); an unquantized engine has none")
        if self.accuracy_level is None:
            self.accuracy_level = 0
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"--accuracy-level must be in 0..4, got {self.accuracy_level}")
        if max_positions is not None and self.max_seq_len > max_positions:
            raise ValueError(f"--max-seq-len {self.max_seq_len} exceeds the model's "
                             f"max_position_embeddings ({max_positions})")


def _log(msg: str) -> None:
    print(f"[build] {msg}", file=sys.stderr, flush=True)


def builder_revision() -> str:
    """The first 16 hex digits of the sha256 of this package's Python sources (every
    ``builder/*.py``, by name): an engine built by other builder code has other graphs, though
    its build options are the same (``tools/bench_core.ensure_engine`` rebuilds it)."""
    import hashlib

    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(here) if n.endswith(".py")):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"builder": builder_revision()}
    for pkg in ("trtllm-lite", "onnx", "onnxruntime", "numpy", "gguf", "transformers", "torch"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def build_engine(model: str, output: str, build_config: BuildConfig | None = None) -> str:
    """Build an engine directory from ``model`` (short name, GGUF file or HF directory).

    ``build_config.kv_cache_dtype`` (``"float32"``, the default, or ``"float16"``) is the KV
    pools' type, recorded in the manifest as ``build["kv_cache_dtype"]``; on the TensorRT
    backends the pools take ``dtype`` and ``kv_cache_dtype`` may only be float32 or ``dtype``.

    Returns the engine directory. Raises ``FileNotFoundError`` for an unknown model,
    ``UnsupportedModelError`` for an unsupported architecture or missing tensor, and
    ``ValueError`` for bad build options (an unknown ``kv_cache_dtype``, or on a TensorRT
    backend one other than float32 or ``dtype``, before the model is loaded).
    """
    bc = build_config or BuildConfig()
    bc.validate()   # the options alone, before loading the model (seconds)
    if os.path.isdir(model) and os.path.isdir(output) and os.path.samefile(model, output):
        # (QA: the build wrote its graphs among the checkpoint's files, then failed copying the tokenizer)
        raise ValueError(f"--output {output!r} is the --model directory: write the engine elsewhere")
    t0 = time.time()
    _log(f"loading {model}")
    loaded = load_model(model)
    if bc.draft_layers:
        loaded = keep_first_layers(loaded, bc.draft_layers)
    if bc.rotate_activations is None:   # the default: the Llama family's w8a8
        bc.rotate_activations = bc.quantization == W8A8 and loaded.config.family == "llama"
    if bc.rotate_activations:
        loaded = rotate_activations(loaded)
        _log(f"rotated the residual stream and the down projections' inputs (block {down_block(loaded.config.intermediate_size)})")
    cfg = loaded.config
    outside = [i for i in cfg.eos_token_ids if not 0 <= i < cfg.vocab_size]
    if outside:   # (QA: GPT-2's default 50256 in a smaller vocabulary broke min_tokens at run time)
        _log(f"end-of-sequence ids {outside} are outside the vocabulary ({cfg.vocab_size} tokens): dropped")
        cfg.eos_token_ids = [i for i in cfg.eos_token_ids if 0 <= i < cfg.vocab_size]
    if bc.max_seq_len > cfg.max_position_embeddings:   # (QA: capped without a word)
        _log(f"max_seq_len {bc.max_seq_len} capped at the model's max_position_embeddings "
             f"({cfg.max_position_embeddings})")
        bc.max_seq_len = cfg.max_position_embeddings
    bc.validate(cfg.max_position_embeddings)
    _log(f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
         f"{cfg.num_heads}/{cfg.num_kv_heads} kv, {cfg.num_parameters / 1e6:.1f} M parameters "
         f"({time.time() - t0:.1f} s)")
    try:
        os.makedirs(output, exist_ok=True)
        with tempfile.TemporaryFile(dir=output):   # writable (root's os.access says so of /proc)
            pass
    except OSError as e:   # (QA: the bare OSError named neither the option nor why)
        raise ValueError(f"--output {output!r}: cannot write the engine directory there ({e.strerror})") from None
    # engine.json is written last: a build stopped part way over an older engine leaves no
    # manifest, so the directory reads as unfinished ("engine.json is missing"), not as the old engine
    _remove_previous_build(output)
    # first, in seconds: a tokenizer that cannot be converted fails the build before any graph is written
    tokenizer_files = loaded.tokenizer_saver(output) if loaded.tokenizer_saver else []
    _log(f"tokenizer files: {tokenizer_files or 'none (token-id prompts only)'}")
    quantized = quantize_model(loaded, bc.quantization, bc.quant_block_size, bc.quant_symmetric,
                               bc.quantize_lm_head, bc.accuracy_level, log=_log,
                               activation_planes=bc.activation_planes or 2)
    if quantized:   # record what "auto" chose
        bc.quantize_lm_head = ("embed.weight" if cfg.tie_word_embeddings else "lm_head.weight") in quantized
    graphs, store = export_graphs(cfg, loaded.weights, bc.max_seq_len, quantized, bc.accuracy_level,
                                  KV_WRITE.get(bc.backend, "runtime"),
                                  ort_ops=bc.backend == "onnxruntime",
                                  # (TensorRT: the float32 graph's pools become --dtype with the network)
                                  kv_cache_dtype="float32" if bc.backend in KV_WRITE else bc.kv_cache_dtype)
    _log(f"exported prefill and decode graphs ({len(graphs['decode'].graph.node)} nodes each)")

    def progress(done, total):
        if done == total or done % 50 == 0:
            _log(f"writing weights {done}/{total}")

    kernel_models, float_linear_models = {}, {}
    if bc.backend == "onnxruntime":   # for sessions with trtllm-lite's kernels (no attention metadata; the op stores the K/V)
        for kind, graph in graphs.items():
            kernel_models[f"{kind}.kernels.onnx"] = fuse_decoder_layers(
                with_kv_write_in_op(without_attention_metadata(graph)))
            if not quantized:   # float32 linears as FloatLinear (their panels join the weights)
                # (only where every one is: the runner holds these graphs' weights itself, and a
                # Gemm left over would keep a prepacked copy beside it)
                model, replaced, left = use_float_linears(kernel_models[f"{kind}.kernels.onnx"], store)
                if replaced and not left:
                    float_linear_models[f"{kind}.kernels.float_linear.onnx"] = fuse_decoder_layers(model)
        if float_linear_models:
            _log(f"float32 linears as FloatLinear in {sorted(float_linear_models)} (their weights also "
                 f"stored in 32-row panels)")
    weight_table = store.write(os.path.join(output, store.filename), progress)
    variants = _accuracy_variants(graphs, bc.accuracy_level) if quantized and bc.quantization != W8A8 else {}
    for kind, graph in graphs.items():
        onnx.save(graph, os.path.join(output, f"{kind}.onnx"))
        onnx.checker.check_model(os.path.join(output, f"{kind}.onnx"))
    for level, files in variants.items():
        for kind, file in files.items():
            onnx.save(_set_accuracy_level(graphs[kind], level), os.path.join(output, file))
    for file, model in {**kernel_models, **float_linear_models}.items():
        onnx.save(model, os.path.join(output, file))
        onnx.checker.check_model(os.path.join(output, file))
    kernel_graphs = {file.split(".")[0]: file for file in kernel_models}
    float_linear_graphs = {file.split(".")[0]: file for file in float_linear_models}
    tensorrt = None
    if bc.backend in KV_WRITE:
        limits = ProfileLimits(bc.max_num_seqs, bc.max_num_batched_tokens, bc.max_seq_len, bc.block_size)
        tensorrt = compile_engine(output, bc.backend, bc.dtype, limits, (cfg.num_kv_heads, cfg.head_dim),
                                  cfg.num_layers, log=_log, kv_cache_dtype=bc.kv_cache_dtype)

    manifest = {
        "format_version": ENGINE_FORMAT_VERSION,
        "model": cfg.to_dict(),
        "build": asdict(bc),
        "source": {"path": os.path.abspath(loaded.source), "format": loaded.source_format},
        "graphs": {kind: {"file": f"{kind}.onnx",
                          "inputs": [i.name for i in g.graph.input],
                          "outputs": [o.name for o in g.graph.output]} for kind, g in graphs.items()},
        "weights": {"file": store.filename, "tensors": weight_table},
        "quantization": {"method": bc.quantization, "weights": {n: q.source for n, q in quantized.items()}},
        "graph_variants": {"accuracy_level": {str(k): v for k, v in variants.items()},
                           "custom_kernels": kernel_graphs,
                           "float_linear_kernels": float_linear_graphs},
        # each graph file's weights (the runtime's own copy, without prepacking, holds only these)
        "graph_weights": {file: sorted(_external_weights(model)) for file, model in
                          [*((f"{kind}.onnx", g) for kind, g in graphs.items()),
                           *kernel_models.items(), *float_linear_models.items()]},
        "tokenizer": {"files": tokenizer_files},
        "files": {},
        "versions": _versions(),
    }
    if tensorrt is not None:
        manifest["tensorrt"] = tensorrt
    for name in sorted(build_outputs(manifest)):   # the files this build wrote
        manifest["files"][name] = sha256_file(os.path.join(output, name))
    with open(os.path.join(output, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    if bc.backend == "onnxruntime":
        _compile_check(output)
    _log(f"engine ready in {output} ({time.time() - t0:.1f} s)")
    return output


def _external_weights(model) -> set[str]:
    """The names of ``model``'s initializers stored in the weights file."""
    from onnx import TensorProto

    return {i.name for i in model.graph.initializer if i.data_location == TensorProto.EXTERNAL}


def build_outputs(manifest: dict) -> set[str]:
    """The files a build writes beside ``engine.json``, as its manifest names them: the graphs
    and their variants, the weights, the tokenizer's files, a TensorRT plan and its typed graph."""
    names = {g.get("file") for g in manifest.get("graphs", {}).values()}
    variants = manifest.get("graph_variants", {})
    for files in [*variants.get("accuracy_level", {}).values(), variants.get("custom_kernels") or {},
                  variants.get("float_linear_kernels") or {}]:
        names.update(files.values())
    names.add(manifest.get("weights", {}).get("file"))
    names.update(manifest.get("tokenizer", {}).get("files", []))
    if "tensorrt" in manifest:
        names.update({manifest["tensorrt"].get("plan"), manifest["tensorrt"].get("graph")})
    return {n for n in names if isinstance(n, str) and n and os.path.basename(n) == n}


def _remove_previous_build(output: str) -> None:
    """Delete what an earlier build wrote here (:func:`build_outputs` of its manifest) and the
    manifest, so that a rebuild with other options (another backend, no quantization) leaves
    none of it behind; other files (the user's own) are kept. An unreadable manifest removes
    only itself."""
    manifest_path = os.path.join(output, MANIFEST)
    if not os.path.isfile(manifest_path):
        return
    try:
        with open(manifest_path, encoding="utf-8") as f:
            outputs = build_outputs(json.load(f))
    except (OSError, ValueError, AttributeError, TypeError):
        outputs = set()
    for name in outputs:
        if os.path.isfile(os.path.join(output, name)):
            os.remove(os.path.join(output, name))
    os.remove(manifest_path)


ACCURACY_LEVELS = (0, 4)  # float32 activations; int8 activations


def _accuracy_variants(graphs: dict, built_level: int) -> dict[int, dict[str, str]]:
    """Graph files for the MatMulNBits accuracy levels other than the built one."""
    return {level: {kind: f"{kind}.acc{level}.onnx" for kind in graphs}
            for level in ACCURACY_LEVELS if level != built_level}


def _set_accuracy_level(graph: onnx.ModelProto, level: int) -> onnx.ModelProto:
    """A copy of ``graph`` whose MatMulNBits nodes have ``accuracy_level = level``; at a level
    other than 0, ``QuantizedLinear`` nodes (whose kernel computes at float32) are first
    replaced by their function bodies (MatMulNBits [+ AddBlockOffsets])."""
    from onnx import inliner

    from .fused_ops import QUANTIZED_LINEAR_OP_TYPES
    from .paged_attention import DOMAIN

    out = onnx.ModelProto()
    out.CopyFrom(graph)
    ops = [(DOMAIN, op) for op in QUANTIZED_LINEAR_OP_TYPES]
    if level != 0 and any((n.domain, n.op_type) in ops for n in out.graph.node):
        out = inliner.inline_selected_functions(out, ops)
        kept = [f for f in out.functions if (f.domain, f.name) not in ops]
        del out.functions[:]
        out.functions.extend(kept)
    for node in out.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level
    return out


def _compile_check(output: str) -> None:
    """The onnxruntime backend 'compiles' by loading the engine and running a few steps that
    take each of the attention op's kernels (a lone prompt, decodes, prompts of different
    lengths together), so a kernel that refuses the model's shapes fails the build.

    Raises:
        onnxruntime's error: a graph does not load or a step does not run.
    """
    from trtllm_lite import LLM, SamplingParams

    llm = LLM(output, num_kv_blocks=16, verify_checksums=False)
    # prompt + output fit an engine of any max_seq_len >= 2 (BuildConfig.validate)
    max_tokens = min(2, llm.engine.max_model_len - 1)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    vocab = llm.engine.model_config["vocab_size"]    # ids kept inside a tiny test vocabulary

    def prompts(*ids):
        return [[t % vocab for t in p[:llm.engine.max_model_len - max_tokens]] for p in ids]

    llm.generate(prompts((1, 2, 3)), greedy)
    llm.generate(prompts((1, 2), (3, 4, 5, 6, 7)), greedy)
