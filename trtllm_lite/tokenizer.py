"""The engine's tokenizer: HF ``tokenizer.json`` through the ``tokenizers`` library, and the
model's chat template rendered with jinja2 the way transformers renders it."""
from __future__ import annotations

import functools
import json
import os
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def check_unicode(text: str, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` if ``text`` is not valid Unicode: a lone surrogate,
    which JSON's ``"\\ud800"`` escape decodes to, cannot be encoded, tokenized or matched."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text ({e.reason} at character {e.start})") from None


class Tokenizer:
    """Encode prompts, decode tokens and apply the chat template of an engine directory.

    Raises:
        FileNotFoundError: the engine has no ``tokenizer.json`` (token-id prompts still work).
    """

    def __init__(self, directory: str):
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{directory} has no tokenizer.json; pass prompts as token ids")
        self.hf = HFTokenizer.from_file(path)
        config = {}
        if os.path.exists(os.path.join(directory, "tokenizer_config.json")):
            with open(os.path.join(directory, "tokenizer_config.json")) as f:
                config = json.load(f)
        self.config = config
        self.chat_template = config.get("chat_template")
        template_file = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(template_file):
            with open(template_file) as f:
                self.chat_template = f.read()
        self.special_tokens = {k: self._token_str(config.get(k))
                               for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.eos_token_id = self.hf.token_to_id(self.special_tokens["eos_token"] or "") \
            if self.special_tokens["eos_token"] else None
        # the most characters of text one token can stand for, bounded from above: a vocabulary
        # entry's length in its own alphabet (byte-level: one character per byte, never fewer
        # than the text's characters), times 4 for normalizers that shrink text (NFC
        # composition, collapsed whitespace)
        self.max_chars_per_token = 4 * max((len(t) for t in self.hf.get_vocab(with_added_tokens=True)), default=1)

    @staticmethod
    def _token_str(value) -> str | None:
        if isinstance(value, dict):
            return value.get("content")
        return value

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True, name: str = "prompt",
               max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``.

        ``max_tokens``: text longer than that many tokens could cover
        (``max_tokens * max_chars_per_token`` characters) is refused before it is tokenized, so
        a many-megabyte prompt costs no tokenizing time (the caller checks the exact count).

        Tokenizing releases the GIL (the tokenizers library's ``encode_batch``; its ``encode``
        holds it: 200k CJK characters, ~0.7 s, stopped every other Python thread that long), so
        a server that calls this from a worker thread keeps its event loop running.

        Raises:
            ValueError: ``text`` is not valid Unicode (e.g. a lone surrogate from JSON's
                ``"\ud800"``), or is too long for ``max_tokens``; the message names ``name``.
        """
        if max_tokens is not None and len(text) > max_tokens * self.max_chars_per_token:
            raise ValueError(f"{name} has {len(text)} characters: more than {max_tokens} tokens can hold "
                             f"(at most {self.max_chars_per_token} characters a token)")
        try:
            return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:   # checked only here: a valid prompt is not encoded twice
            check_unicode(text, name)
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for (OpenAI's logprob ``bytes``): exact for a
        byte-level BPE token (GPT-2's byte alphabet) or a byte-fallback ``<0xNN>`` token, even
        where the token holds only part of a character (whose decoded text is U+FFFD); a
        SentencePiece token with its leading space (which decoding it alone strips); else its
        decoded text's bytes."""
        added = self._added_tokens.get(token_id)
        if added is not None:
            return added.encode()
        piece = self.hf.id_to_token(token_id)
        if piece is not None and self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if piece is not None and self._metaspace:   # SentencePiece: "\u2581" stands for a space
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8", "replace")

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens (those ``skip_special_tokens`` leaves out of a text)."""
        return frozenset(i for i, t in self._added_tokens_decoder.items() if t.special)

    @functools.cached_property
    def _added_tokens(self) -> dict[int, str]:
        return {i: t.content for i, t in self._added_tokens_decoder.items()}

    @functools.cached_property
    def _added_tokens_decoder(self) -> dict:
        return self.hf.get_added_tokens_decoder()

    @functools.cached_property
    def _decoder_json(self) -> str:
        """The decoder's JSON (its own state: ~36 us, where the whole tokenizer's took ~58 ms)."""
        decoder = self.hf.decoder
        return json.dumps(json.loads(decoder.__getstate__()), ensure_ascii=False) if decoder is not None else "null"

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps GPT-2's byte alphabet back to bytes (ByteLevel, alone or in
        a Sequence)."""
        return '"ByteLevel"' in self._decoder_json

    @functools.cached_property
    def _metaspace(self) -> bool:
        """Whether the decoder turns SentencePiece's "\u2581" into spaces (Metaspace, or a
        Replace step: what transformers makes of a GGUF's llama tokenizer)."""
        return "\u2581" in self._decoder_json

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's template.

        Raises:
            ValueError: the engine has no chat template, a message is malformed or not valid
                Unicode (naming ``messages[i].content`` and the character), or the template
                rejects the messages.
        """
        if not self.chat_template:
            raise ValueError("this engine's tokenizer has no chat template")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if not messages:   # (QA 25: an empty conversation was rendered and generated from)
            raise ValueError("messages is empty")
        for i, m in enumerate(messages):   # (a None or int content failed inside the template)
            for key in ("role", "content"):
                if not isinstance(m[key], str):
                    raise ValueError(f"messages[{i}].{key} must be a string, got {type(m[key]).__name__}")
                # here, not when the rendered text is tokenized: the error's character offset is
                # then the message's own, not the templated text's
                check_unicode(m[key], f"messages[{i}].{key}")
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet (Radford et al. 2019, its ``encoder.py``): each byte's
    printable stand-in character, the bytes that print as themselves first."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
