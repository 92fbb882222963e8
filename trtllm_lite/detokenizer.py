"""Incremental detokenization, one per sequence.

Built on ``tokenizers.decoders.DecodeStream``: it holds tokens back until they form valid
UTF-8 (never half a character) and keeps leading spaces. The stream is primed with the
prompt's last tokens so the first output token decodes in context (SentencePiece
tokenizers drop a leading space at the start of a text otherwise).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from .tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a sequence's output tokens into text deltas; joined deltas are the text."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        try:
            self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        except TypeError:  # older tokenizers: no priming
            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Feed one token; return the new text (maybe empty while a character is incomplete)."""
        return self.stream.step(self.tokenizer.hf, int(token_id)) or ""
