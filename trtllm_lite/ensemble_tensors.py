"""The tensors of the TensorRT-LLM Triton ensemble, and their conversion to and from ours.

A client written for TensorRT-LLM on Triton Inference Server (model ``ensemble`` of
``triton_backend/all_models/inflight_batcher_llm``) sends named tensors such as
``text_input`` (BYTES), ``max_tokens`` (INT32) and ``stream`` (BOOL), and reads
``text_output`` (BYTES). This module holds that table (:data:`INPUTS`, :data:`OUTPUTS`) and
converts between it and trtllm-lite's request/response objects, on numpy arrays only, so
both the KServe v2 gRPC servicer (``trtllm_lite.serving.kserve``) and the Triton
Python-backend model reuse it:

* :func:`parse_inputs`: ``{name: np.ndarray}`` -> :class:`EnsembleRequest` (prompt,
  ``SamplingParams`` keyword arguments in vLLM names, stream flag, output options).
* :func:`make_outputs`: generated text (and counts, timings) -> ``{name: np.ndarray}``.
* :func:`serialize_bytes_tensor` / :func:`deserialize_bytes_tensor`: the KServe v2 BYTES
  wire format (each element a 4-byte little-endian length, then the bytes).

Shapes: the ensemble is configured with ``max_batch_size > 0``, so clients send a leading
batch dimension (``text_input`` of shape ``[1, 1]``); without one (``[1]``) works too. One
request carries one prompt: a batch of more than one is refused (send separate requests;
our scheduler batches them inflight anyway).

Semantics follow the TensorRT-LLM backend: a non-streamed ``text_output`` starts with the
prompt unless ``exclude_input_in_output`` is true; streamed responses carry only new text.
``stop_words`` / ``bad_words`` elements are whole strings (empty ones are ignored, as the
ensemble's examples send ``""``); stop strings end the output before the match (vLLM's rule).
``end_id`` is an extra stop token (EOS still stops). ``beam_width`` must be 1 and
``length_penalty`` (beam search only) is accepted and unused; ``pad_id`` is unused.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of the ensemble.

    ``datatype`` is the KServe v2 name (``BYTES``, ``BOOL``, ``INT32``, ``INT64``,
    ``UINT64``, ``FP32``); ``dims`` the per-request shape without the batch dimension
    (``-1``: any length); ``param`` the vLLM ``SamplingParams`` name it maps to, if any.
    """

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = True
    param: str | None = None
    description: str = ""


def _i(name, param=None, desc="", dtype="INT32"):
    return TensorSpec(name, dtype, (1,), True, param, desc)


def _f(name, param=None, desc=""):
    return TensorSpec(name, "FP32", (1,), True, param, desc)


def _b(name, desc=""):
    return TensorSpec(name, "BOOL", (1,), True, None, desc)


#: Inputs, as the TensorRT-LLM ensemble's ``config.pbtxt`` names and types them.
INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "BYTES", (1,), False, None, "the prompt (UTF-8)"),
    TensorSpec("max_tokens", "INT32", (1,), False, "max_tokens", "most output tokens"),
    _i("num_return_sequences", "n", "number of sequences to return"),
    TensorSpec("bad_words", "BYTES", (-1,), True, "bad_words", "strings never to generate"),
    TensorSpec("stop_words", "BYTES", (-1,), True, "stop", "strings that end the output"),
    _b("exclude_input_in_output", "non-streamed text_output without the prompt"),
    _i("end_id", None, "an extra stop token id"),
    _i("pad_id", None, "unused (outputs are not padded)"),
    _i("top_k", "top_k", "keep the k most likely tokens (0: all)"),
    _f("top_p", "top_p", "nucleus sampling threshold"),
    _f("temperature", "temperature", "0: greedy"),
    _f("length_penalty", None, "beam search only: unused"),
    _f("repetition_penalty", "repetition_penalty"),
    _i("min_tokens", "min_tokens", "no stop before this many output tokens"),
    _f("presence_penalty", "presence_penalty"),
    _f("frequency_penalty", "frequency_penalty"),
    _i("seed", "seed", "per-request random seed", dtype="UINT64"),
    _b("return_log_probs", "fill cum_log_probs and output_log_probs"),
    _b("return_num_input_tokens", "fill num_input_tokens"),
    _b("return_num_output_tokens", "fill num_output_tokens"),
    _b("return_perf_metrics", "fill arrival/first-scheduled/first-token/last-token times"),
    _i("beam_width", None, "must be 1"),
    _b("stream", "one response per new piece of text (decoupled)"),
    TensorSpec("embedding_bias_words", "BYTES", (-1,), True, None, "words whose logits are biased"),
    TensorSpec("embedding_bias_weights", "FP32", (-1,), True, None, "bias per word (logit_bias)"),
    TensorSpec("cache_salt", "BYTES", (1,), True, None,
               "prefix-cache isolation key (vLLM's cache_salt): cached blocks are shared only "
               "between requests with the same salt"),
)

#: Outputs. ``text_output`` always; the others when asked for by the ``return_*`` flags.
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES", (-1,), False, None, "generated text (UTF-8)"),
    TensorSpec("cum_log_probs", "FP32", (-1,), True, None, "sum of output token log-probs"),
    TensorSpec("output_log_probs", "FP32", (-1, -1), True, None, "log-prob of each output token"),
    TensorSpec("num_input_tokens", "INT32", (1,), True, None, "prompt tokens"),
    TensorSpec("num_output_tokens", "INT32", (1,), True, None, "output tokens so far"),
    TensorSpec("arrival_time_ns", "INT64", (1,), True, None, "monotonic clock, ns"),
    TensorSpec("first_scheduled_time_ns", "INT64", (1,), True, None, "monotonic clock, ns"),
    TensorSpec("first_token_time_ns", "INT64", (1,), True, None, "monotonic clock, ns"),
    TensorSpec("last_token_time_ns", "INT64", (1,), True, None, "monotonic clock, ns"),
)

#: TensorRT-LLM's ``sequence_index``: on every response of a request of ``num_return_sequences``
#: > 1, which sequence its text belongs to (streamed responses interleave them).
SEQUENCE_INDEX = TensorSpec("sequence_index", "INT32", (1,), True, None, "which returned sequence (0-based)")

INPUTS_BY_NAME = {t.name: t for t in INPUTS}
OUTPUTS_BY_NAME = {t.name: t for t in OUTPUTS + (SEQUENCE_INDEX,)}


def sequence_index_tensor(request: "EnsembleRequest", index: int) -> np.ndarray:
    """``sequence_index`` of one response: ``[1, 1]`` int32 (``[1]`` without a batch dimension)."""
    return np.array([index], np.int32).reshape((1, 1) if request.batched else (1,))

#: ``SamplingParams`` field -> the input tensor that sets it, to name in errors.
PARAM_TENSORS: dict[str, str] = {
    **{t.param: t.name for t in INPUTS if t.param is not None},
    "stop_token_ids": "end_id", "logit_bias": "embedding_bias_weights", "logprobs": "return_log_probs",
    "prompt": "text_input",     # the engine's prompt errors ("prompt has 5000 tokens, more than ...")
}


def name_tensor_in_error(message: str) -> str:
    """A validation message that starts with a ``SamplingParams`` field name (``"n must be an
    integer >= 1, got 0"``), as ``SamplingParams`` and the engine word them, prefixed with the
    tensor the client sent (``"input tensor 'num_return_sequences': n must be ..."``); other
    messages unchanged."""
    field_name = message.split(" ", 1)[0]
    tensor = PARAM_TENSORS.get(field_name)
    if tensor is None or " " not in message:
        return message
    return f"input tensor {tensor!r}: {message}"


#: KServe v2 datatype -> Triton ``config.pbtxt`` data type.
CONFIG_DATA_TYPE = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32",
                    "INT64": "TYPE_INT64", "UINT64": "TYPE_UINT64", "FP32": "TYPE_FP32"}
#: KServe v2 datatype -> numpy dtype (BYTES: object arrays of ``bytes``).
NUMPY_DTYPE = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64,
               "UINT64": np.uint64, "FP32": np.float32}


# -- the KServe v2 BYTES wire format -------------------------------------------------------
def serialize_bytes_tensor(array: np.ndarray) -> bytes:
    """Flatten ``array`` (``str`` or ``bytes`` elements, C order) into KServe v2 BYTES wire
    form: per element a 4-byte little-endian length, then its bytes (``str`` as UTF-8)."""
    parts = []
    for item in np.asarray(array, dtype=object).reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes_tensor(raw: bytes, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Inverse of :func:`serialize_bytes_tensor`: an object array of ``bytes``.

    Raises:
        ValueError: the buffer is truncated, or its element count does not match ``shape``.
    """
    items, offset, raw = [], 0, memoryview(raw)
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise ValueError("BYTES tensor is truncated (a length prefix is cut)")
        (n,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + n > len(raw):
            raise ValueError("BYTES tensor is truncated (an element is shorter than its length)")
        items.append(bytes(raw[offset:offset + n]))
        offset += n
    out = np.empty(len(items), dtype=object)
    out[:] = items
    if shape is not None:
        needed = math.prod(shape)   # (Python ints: numpy's int64 product wraps past 2^63)
        if needed != len(items):
            raise ValueError(f"BYTES tensor holds {len(items)} elements, its shape {list(shape)} "
                             f"needs {needed}")
        out = out.reshape(shape)
    return out


# -- request ---------------------------------------------------------------------------------
@dataclass
class EnsembleRequest:
    """What an ensemble request asks for, in trtllm-lite terms.

    ``sampling`` holds ``SamplingParams`` keyword arguments under vLLM names (pass it to
    ``trtllm_lite.serving.params.make_sampling_params``); ``batched`` is whether the inputs
    had a leading batch dimension, so outputs get one too.
    """

    prompt: str
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    exclude_input_in_output: bool = False
    return_log_probs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_perf_metrics: bool = False
    batched: bool = True
    cache_salt: str | None = None


def parse_inputs(inputs: Mapping[str, np.ndarray], encode: Callable[[str], list[int]] | None = None,
                 check_words: Callable[[list[str], str], None] | None = None) -> EnsembleRequest:
    """Read an ensemble request from named numpy arrays.

    Args:
        inputs: tensor name -> array. BYTES tensors are object arrays of ``bytes`` (or
            ``str``); every scalar tensor holds exactly one element (shape ``[1]`` or ``[1, 1]``).
        encode: text -> token ids without special tokens; needed only for
            ``embedding_bias_words`` (each word's tokens get its weight, as TensorRT-LLM does).
        check_words: ``(words, tensor name)``, called before ``encode`` tokenizes a tensor's
            words; raises ``ValueError`` to refuse them unread (a server bounds their length:
            ``LLMEngine.check_words_length``).

    Returns:
        The request; ``sampling`` maps to ``SamplingParams`` (``stop_words`` -> ``stop``,
        ``num_return_sequences`` -> ``n``, ``end_id`` -> ``stop_token_ids``,
        ``return_log_probs`` -> ``logprobs=1``); ``cache_salt`` goes with the request (an
        empty salt is refused by the engine, naming ``cache_salt``).

    Raises:
        ValueError: an unknown tensor, a missing required one, a batch of more than one,
            a value of the wrong kind (e.g. a float ``max_tokens``), ``beam_width`` != 1,
            an empty or non-UTF-8 ``text_input``, or words ``check_words`` refuses. The message names the
            tensor.
    """
    unknown = sorted(set(inputs) - set(INPUTS_BY_NAME))
    if unknown:
        raise ValueError(f"unknown input tensor {unknown[0]!r}; known: {', '.join(INPUTS_BY_NAME)}")
    for spec in INPUTS:
        if not spec.optional and spec.name not in inputs:
            raise ValueError(f"input tensor {spec.name!r} is required")
    text = np.asarray(inputs["text_input"])
    req = EnsembleRequest(prompt=_text(_scalar("text_input", text)), batched=text.ndim >= 2)
    if not req.prompt:
        raise ValueError("input tensor 'text_input' is empty: the prompt needs at least one token")
    flags = ("stream", "exclude_input_in_output", "return_log_probs", "return_num_input_tokens",
             "return_num_output_tokens", "return_perf_metrics")
    for name in flags:
        if name in inputs:
            setattr(req, name, _bool(name, inputs[name]))
    s = req.sampling
    for name, value in inputs.items():
        spec = INPUTS_BY_NAME[name]
        if spec.param is None or spec.datatype == "BYTES":
            continue
        s[spec.param] = _float(name, value) if spec.datatype == "FP32" else _int(name, value)
    for name in ("stop_words", "bad_words"):
        if name in inputs:
            words = [w for w in (_text(x, name) for x in _batch_one(name, inputs[name])) if w]
            if words:
                s[INPUTS_BY_NAME[name].param] = words
    if "end_id" in inputs:
        s["stop_token_ids"] = [_int("end_id", inputs["end_id"])]
    if "cache_salt" in inputs:
        req.cache_salt = _text(_scalar("cache_salt", np.asarray(inputs["cache_salt"])), "cache_salt")
    if "beam_width" in inputs and _int("beam_width", inputs["beam_width"]) != 1:
        raise ValueError("beam_width must be 1 (beam search is not supported)")
    if req.return_log_probs:
        s["logprobs"] = 1
    if "embedding_bias_words" in inputs or "embedding_bias_weights" in inputs:
        s["logit_bias"] = _logit_bias(inputs, encode, check_words)
    return req


def _batch_one(name: str, array) -> np.ndarray:
    """The elements of a batch of one (any leading 1-dims dropped), flattened."""
    a = np.asarray(array)
    if a.ndim >= 2 and a.shape[0] != 1:
        raise ValueError(f"input tensor {name!r} has a batch of {a.shape[0]}; "
                         "send one prompt per request")
    return a.reshape(-1)


def _scalar(name: str, array):
    flat = _batch_one(name, array)
    if flat.size != 1:
        raise ValueError(f"input tensor {name!r} must hold one element, got shape {list(np.shape(array))}")
    return flat[0]


def _text(value, name: str = "text_input") -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, bytearray)):   # bytes(an integer) would be that many NULs
        raise ValueError(f"input tensor {name!r} must be BYTES (UTF-8 text), got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"input tensor {name!r} must be UTF-8 text") from None


def _bool(name: str, array) -> bool:
    v = _scalar(name, array)
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"input tensor {name!r} must be BOOL, got {type(v).__name__}")
    return bool(v)


def _int(name: str, array) -> int:
    v = _scalar(name, array)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"input tensor {name!r} must be an integer ({INPUTS_BY_NAME[name].datatype}), "
                         f"got {np.asarray(array).dtype}")
    return int(v)


def _float(name: str, array) -> float:
    v = _scalar(name, array)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"input tensor {name!r} must be a number (FP32), got {np.asarray(array).dtype}")
    return float(v)


def _logit_bias(inputs, encode, check_words) -> dict[int, float]:
    if "embedding_bias_words" not in inputs or "embedding_bias_weights" not in inputs:
        raise ValueError("embedding_bias_words and embedding_bias_weights must be sent together")
    words = [_text(w, "embedding_bias_words") for w in _batch_one("embedding_bias_words",
                                                                   inputs["embedding_bias_words"])]
    weights = _batch_one("embedding_bias_weights", inputs["embedding_bias_weights"]).astype(np.float64)
    if len(words) != len(weights):
        raise ValueError(f"embedding_bias_words has {len(words)} words but embedding_bias_weights "
                         f"{len(weights)} weights")
    if words and encode is None:
        raise ValueError("embedding_bias_words needs the engine's tokenizer")
    if check_words is not None:
        check_words(words, "embedding_bias_words")
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights.tolist()):
        for token in encode(word) if word else []:
            bias[token] = bias.get(token, 0.0) + weight
    return bias


# -- response --------------------------------------------------------------------------------
def make_outputs(request: EnsembleRequest, text: str | Sequence[str], *, num_input_tokens: int = 0,
                 num_output_tokens: int = 0, token_logprobs: list[float] | None = None,
                 times_ns: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Output tensors for one response.

    Args:
        request: the parsed request (decides the batch dimension and optional outputs).
        text: the text to send: a delta when streaming; otherwise the whole output, to
            which the prompt is prepended here unless ``exclude_input_in_output``. A list
            holds one text per returned sequence (``num_return_sequences``).
        num_input_tokens, num_output_tokens: token counts (sent when asked for).
        token_logprobs: the log-prob of each output token in this response (sent when
            ``return_log_probs``; ``cum_log_probs`` is their sum).
        times_ns: ``arrival_time_ns``, ``first_scheduled_time_ns``, ``first_token_time_ns``,
            ``last_token_time_ns`` (sent when ``return_perf_metrics``).

    Returns:
        ``{name: array}`` with the ensemble's dtypes; ``text_output`` is an object array of
        UTF-8 ``bytes`` of shape ``[1, k]`` for k texts (``[k]`` if the request had no batch
        dimension).
    """
    texts = [text] if isinstance(text, str) else list(text)
    if not request.stream and not request.exclude_input_in_output:
        texts = [request.prompt + t for t in texts]
    lead = (1,) if request.batched else ()
    encoded = np.empty(len(texts), dtype=object)
    encoded[:] = [t.encode("utf-8") for t in texts]
    out = {"text_output": encoded.reshape(lead + (len(texts),))}
    if request.return_log_probs:
        lp = np.asarray(token_logprobs or [], dtype=np.float32)
        out["output_log_probs"] = lp.reshape(lead + (1, lp.size))
        out["cum_log_probs"] = np.array([lp.sum(dtype=np.float32)], np.float32).reshape(lead + (1,))
    if request.return_num_input_tokens:
        out["num_input_tokens"] = np.array([num_input_tokens], np.int32).reshape(lead + (1,))
    if request.return_num_output_tokens:
        out["num_output_tokens"] = np.array([num_output_tokens], np.int32).reshape(lead + (1,))
    if request.return_perf_metrics:
        for name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                     "last_token_time_ns"):
            value = (times_ns or {}).get(name, 0)
            out[name] = np.array([value], np.int64).reshape(lead + (1,))
    return out
