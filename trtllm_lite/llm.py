"""``LLM``: the offline (synchronous) Python API, in the vLLM habit."""
from __future__ import annotations

import numbers

import numpy as np

from .core.llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Load an engine and generate from batches of prompts with inflight batching.

    ``LLM(engine_dir, **options)``; options as :class:`~trtllm_lite.core.llm_engine.LLMEngine`,
    with ``offline=True`` by default (vLLM's LLM class likewise takes a larger token budget
    than its server).
    """

    def __init__(self, engine_dir: str, **options):
        options.setdefault("offline", True)
        self.engine = LLMEngine(engine_dir, **options)

    @property
    def tokenizer(self):
        """The engine's :class:`~trtllm_lite.tokenizer.Tokenizer` (from its engine directory)."""
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for ``prompts``: a str, a list of token ids, vLLM's dict forms
        ``{"prompt": str}`` and ``{"prompt_token_ids": [int, ...]}``, or a list of any of these.

        ``cache_salt`` (vLLM's name): prefix-cache blocks are shared only between requests
        with the same salt (e.g. one per tenant), so timing cannot reveal another's prompt.

        Returns one cumulative :class:`RequestOutput` per prompt, in input order. Every prompt
        is validated before any runs; a bad one raises ``ValueError`` / ``TypeError`` naming
        the problem and nothing is queued.
        """
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:   # one prompt's token ids
            prompts = [prompts.tolist()]
        if not isinstance(prompts, (str, list, tuple, dict)):
            raise TypeError(f"prompts must be a str, a list of token ids, a dict with 'prompt' or "
                            f"'prompt_token_ids', or a list of these; got {type(prompts).__name__}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        requests = [self.engine.make_request(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, sampling_params)]
        added = []
        try:
            for request in requests:
                self.engine.add(request)
                added.append(request)
            while any(not r.finished for r in requests):
                self.engine.step()
        except BaseException:
            for request in added:
                self.engine.abort(request.request_id)
            raise
        return [self.engine.final_output(r) for r in requests]

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, *, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (list of ``{"role", "content"}``; a content may
        be a string or OpenAI's text parts, which are joined) or a list of them, through the
        model's chat template (``cache_salt`` as in :meth:`generate`).

        Raises:
            TypeError: ``messages`` is not a list.
            ValueError: ``messages`` or a conversation is empty, a message lacks a string
                ``role`` or ``content`` (or text parts), the engine has no tokenizer or chat
                template, or as :meth:`generate` raises for the rendered prompts and
                ``sampling_params``.
        """
        if not isinstance(messages, list):   # (one message dict: KeyError 0, QA 25)
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts (one conversation) "
                            f"or a list of such lists, got {type(messages).__name__}")
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        conversations = [[_text_parts_joined(m) for m in c] if isinstance(c, list) else c for c in conversations]
        prompts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt)
                   if self.engine.tokenizer else _no_tokenizer() for c in conversations]
        ids = [self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(ids, sampling_params, cache_salt=cache_salt)
        for out, prompt in zip(outs, prompts):
            out.prompt = prompt
        return outs


def _text_parts_joined(message):
    """``message`` with OpenAI's content parts (``[{"type": "text", "text": ...}, ...]``)
    joined into one string with ``"\n"``, as the HTTP server (and vLLM) reads them; other
    messages as they are.

    Raises:
        ValueError: a part that is not ``{"type": "text", "text": str}``.
    """
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise ValueError("messages: content parts must be {'type': 'text', 'text': str} (text only)")
    return dict(message, content="\n".join(p["text"] for p in content))


def _no_tokenizer():
    raise ValueError("this engine has no tokenizer, so it cannot apply a chat template")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
