"""trtllm-lite: a compiled-graph LLM inference runtime (paged KV cache, inflight batching).

The public API is ``LLM`` and ``SamplingParams`` (offline), and ``AsyncLLM`` (streaming).
"""
from .async_llm import AsyncLLM
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
