"""Incremental detokenization, one per sequence.

Built on ``tokenizers.decoders.DecodeStream``: it holds tokens back until they form valid
UTF-8 (never half a character) and keeps leading spaces. The stream is primed with the
prompt's last tokens so the first output token decodes in context (SentencePiece
tokenizers drop a leading space at the start of a text otherwise).
"""
from __future__ import annotations

import codecs
import os

from tokenizers.decoders import DecodeStream

from .tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a sequence's output tokens into text deltas; joined deltas are the text."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.context = self._window(list(prompt_token_ids))
        self.output_ids: list[int] = []
        self.pending = 0           # output_ids[pending:]: tokens whose text was not returned yet
        # a prompt that ends inside a character (token ids: QA) primes the stream up to that
        # character, then steps the tokens holding its first bytes: primed with them, the first
        # delta repeated the prompt's text; stepped, the character comes out once completed
        whole = len(self.context) - self._tokens_of_incomplete_tail(self.context)
        self.stream = self._new_stream(self.context[:whole])
        try:
            for token in self.context[whole:]:
                self.stream.step(tokenizer.hf, token)
        except Exception:  # noqa: BLE001 - (as in step) the partial character is dropped
            self.stream = self._new_stream(self.context[:whole])

    def _window(self, ids: list[int]) -> list[int]:
        """The last ~PROMPT_CONTEXT_TOKENS of ``ids``, starting on a character's first byte: a
        window that starts inside a character decodes its stray bytes as U+FFFD, and byte-fallback
        decoders then garble every byte token after them (QA: an output's "é" came out as six
        U+FFFD). Reaches back up to as many tokens again for that start, else starts after it."""
        start, earliest = max(0, len(ids) - PROMPT_CONTEXT_TOKENS), max(0, len(ids) - 2 * PROMPT_CONTEXT_TOKENS)
        while start > earliest and self._continues_a_character(ids[start]):
            start -= 1
        while start < len(ids) and self._continues_a_character(ids[start]):
            start += 1
        return ids[start:]

    def _continues_a_character(self, token_id: int) -> bool:
        data = self.tokenizer.token_bytes(token_id)
        return bool(data) and data[0] & 0xC0 == 0x80

    def _tokens_of_incomplete_tail(self, ids: list[int]) -> int:
        """How many of the last ``ids`` hold the first bytes of a UTF-8 character that their
        text ends inside (0 when it ends on a whole character)."""
        pieces = [self.tokenizer.token_bytes(t) for t in ids]
        missing = _incomplete_utf8_tail(b"".join(pieces))
        count = 0
        while missing > 0 and count < len(pieces):
            count += 1
            missing -= len(pieces[-count])
        return count

    def _new_stream(self, ids: list[int]) -> DecodeStream:
        try:
            return DecodeStream(ids=ids, skip_special_tokens=self.skip_special_tokens)
        except TypeError:  # older tokenizers: no priming
            return DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Feed one token; return the new text (maybe empty while a character is incomplete)."""
        self.output_ids.append(int(token_id))
        try:
            delta = self.stream.step(self.tokenizer.hf, int(token_id)) or ""
        except Exception:   # noqa: BLE001 - tokenizers raises a bare Exception
            # DecodeStream refuses a byte-fallback token that is not valid UTF-8 followed by another
            # token ("Invalid prefix encountered while decoding stream"; QA: a SentencePiece
            # tokenizer's <0xE2> then '\u2581word' ended the request, and the build's compile check):
            # the tokens not returned yet decoded after their context, and a stream primed afresh
            delta = self._decode_pending()
            self.stream = self._new_stream(self._window(self.context + self.output_ids))
        if delta:
            self.pending = len(self.output_ids)
        return delta

    def _decode_pending(self) -> str:
        hf, skip = self.tokenizer.hf, self.skip_special_tokens
        before = self._window(self.context + self.output_ids[:self.pending])
        new = self.output_ids[self.pending:]
        base = hf.decode(before, skip_special_tokens=skip)
        full = hf.decode(before + new, skip_special_tokens=skip)
        # (past the common start: where invalid bytes end the context, its replacement characters
        # may differ in number once more bytes follow)
        return full[len(os.path.commonprefix([base, full])):]


def _incomplete_utf8_tail(data: bytes) -> int:
    """Bytes at the end of ``data`` that begin a UTF-8 character without finishing it (0-3):
    what Python's incremental UTF-8 decoder holds back for more input."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)
    return len(decoder.getstate()[0])
