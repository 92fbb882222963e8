"""Sampling parameters from a front end's request: vLLM names in, a ``SamplingParams`` out.

Every front end (our gRPC API, KServe v2 / the TensorRT-LLM ensemble tensors, the OpenAI
HTTP API, the Triton Python backend) collects the values a client set under their vLLM names
and calls :func:`make_sampling_params`. It passes only the fields the installed
``SamplingParams`` has (found by dataclass introspection), so the front ends carry the full
vLLM set while the runtime grows into it. A field the runtime lacks is accepted when the
client sent its neutral value (``n=1``, ``presence_penalty=0``...) and refused otherwise,
so no request is silently served with a parameter ignored.

This module imports nothing from gRPC or HTTP; the Triton Python backend can use it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..sampling_params import SamplingParams

#: The vLLM sampling fields every front end accepts, in the order of the ``.proto``.
SAMPLING_FIELDS = (
    "n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "logprobs", "prompt_logprobs",
    "skip_special_tokens", "logit_bias", "bad_words",
)

#: Values that mean "off" for fields the runtime may not have yet.
_NEUTRAL: dict[str, Any] = {
    "n": 1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "min_tokens": 0, "stop": [], "include_stop_str_in_output": False,
    "logit_bias": {}, "bad_words": [], "stop_token_ids": [],
}


def supported_fields() -> frozenset[str]:
    """Names of the fields the installed ``SamplingParams`` accepts."""
    return frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def make_sampling_params(values: Mapping[str, Any]) -> SamplingParams:
    """Build a ``SamplingParams`` from ``values`` (vLLM names; ``None`` means "not set").

    Raises:
        ValueError: a value is out of range (from ``SamplingParams``, naming the field), a
            name is unknown, or a field this runtime does not support yet was set to a
            non-neutral value (the message names it).
    """
    fields = supported_fields()
    kwargs = {}
    for name, value in values.items():
        if value is None:
            continue
        if name in fields:
            kwargs[name] = value
        elif name in _NEUTRAL and _is_neutral(value, _NEUTRAL[name]):
            continue
        elif name in SAMPLING_FIELDS:
            raise ValueError(f"{name} is not supported by this runtime yet (got {value!r})")
        else:
            raise ValueError(f"unknown sampling parameter {name!r}")
    try:
        return SamplingParams(**kwargs)
    except TypeError as e:  # a value of the wrong type that the dataclass did not check
        raise ValueError(str(e)) from None


def _is_neutral(value: Any, neutral: Any) -> bool:
    if isinstance(neutral, (list, dict)):
        return not value
    return value == neutral
