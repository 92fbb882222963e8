"""Incremental detokenization on hand-made token sequences (byte-level BPE and SentencePiece)."""
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from trtllm_lite.detokenizer import IncrementalDetokenizer
from trtllm_lite.stop_strings import find_stop, held_back
from trtllm_lite.tokenizer import Tokenizer, bytes_to_unicode


def byte_level_tokenizer(tmp_path, extra_tokens):
    """A byte-level BPE tokenizer: all 256 byte tokens plus the given multi-byte tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for t in extra_tokens:
        vocab["".join(byte_chars[b] for b in t)] = len(vocab)
    assert set(alphabet) <= set(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(str(tmp_path)), vocab, byte_chars


def stream(tok, prompt, ids):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    return [d.step(t) for t in ids]


@pytest.mark.parametrize("text,splits", [("😀", [2, 2]), ("😀", [1, 3]), ("中", [2, 1])])
def test_split_multibyte_character_never_half_emitted(tmp_path, text, splits):
    data = text.encode()
    pieces, at = [], 0
    for n in splits:
        pieces.append(data[at:at + n])
        at += n
    tok, vocab, chars = byte_level_tokenizer(tmp_path, [p for p in pieces if len(p) > 1] + [b"Hi"])
    ids = [vocab["".join(chars[b] for b in p)] for p in pieces]
    deltas = stream(tok, [vocab["".join(chars[b] for b in b"Hi")]], ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)          # held until the character completes
    assert "".join(deltas) == text
    assert "\ufffd" not in "".join(deltas)


def test_byte_level_keeps_leading_spaces_token_by_token(tmp_path):
    tok, vocab, chars = byte_level_tokenizer(tmp_path, [b"Hello", b" world", b" foo"])
    ids = [vocab["".join(chars[b] for b in w)] for w in (b"Hello", b" world", b" foo")]
    assert stream(tok, [vocab[chars[ord("x")]]], ids) == ["Hello", " world", " foo"]


def test_sentencepiece_keeps_leading_space_after_prompt(tmp_path):
    vocab = {"<unk>": 0, "▁Say": 1, "▁Hello": 2, "▁world": 3, "▁foo": 4, ":": 5}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer(str(tmp_path))
    deltas = stream(t, [1, 5], [2, 3, 4])
    assert deltas == [" Hello", " world", " foo"]
    full = t.decode([1, 5, 2, 3, 4])
    assert full.endswith("".join(deltas))


def test_stop_string_search_and_hold_back():
    assert find_stop("abc STOP", 3, ["STOP"]) == (4, "STOP")
    assert find_stop("abc ST", 2, ["STOP"]) is None
    assert find_stop("xxENDyyEND", 3, ["END"]) == (7, "END")     # only newly completed ones
    assert held_back("hello ST", ["STOP"]) == 2
    assert held_back("hello S", ["STOP", "SO"]) == 1
    assert held_back("hello", ["STOP"]) == 0


def sentencepiece_tokenizer(tmp_path) -> Tokenizer:
    """A SentencePiece-style BPE with byte fallback: "\u2581" for spaces, ``<0xNN>`` byte tokens,
    ids 259-261 three words, decoded as transformers decodes a GGUF's llama tokenizer."""
    from tokenizers import AddedToken

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "▁Hello": 259, "▁world": 260, "▁foo": 261}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(str(tmp_path))


def test_token_bytes_are_each_tokens_own_bytes(tmp_path):
    """OpenAI's logprob ``bytes`` (and the token text the HTTP server derives from them): a
    SentencePiece word keeps its leading space, which decoding it alone strips (QA); a byte
    token is its byte; a byte-level BPE token holding part of a character is its own bytes; a
    special token is its text."""
    (tmp_path / "spm").mkdir()
    (tmp_path / "bpe").mkdir()
    t = sentencepiece_tokenizer(tmp_path / "spm")
    assert t.token_bytes(260) == b" world" and t.decode([260]) == "world"
    assert t.token_bytes(3 + 0xE2) == b"\xe2" and t.token_bytes(1) == b"<s>"
    b, _, _ = byte_level_tokenizer(tmp_path / "bpe", [])
    emoji = "\U0001F600".encode()
    ids = b.encode("\U0001F600", add_special_tokens=False)
    assert b"".join(b.token_bytes(i) for i in ids) == emoji and len(ids) > 1


def test_byte_fallback_token_that_is_not_utf8_then_a_word_does_not_raise(tmp_path):
    """QA: ``DecodeStream`` raised "Invalid prefix encountered while decoding stream" on a
    SentencePiece byte-fallback token that does not complete a character followed by a word
    (Llama 2 / Mistral tokenizers; a model can emit it), which ended the request, and the
    build's compile check with a traceback. The words still come out, each once."""
    t = sentencepiece_tokenizer(tmp_path)
    for prompt, ids in (([1, 259], [3 + 0x41, 3 + 0xE2, 260, 261]), ([1, 2, 3], [3 + 0xE2, 260, 261]),
                        ([1, 259], [3 + 0x41, 3 + 0xFF, 3 + 0x80, 260, 3 + 0x42, 261])):
        text = "".join(stream(t, prompt, ids))
        assert text.count("world") == 1 and text.count("foo") == 1 and text.endswith(" foo"), (ids, text)


def test_prompt_ending_inside_a_character_does_not_repeat_the_prompt(tmp_path):
    """Token-id prompts can end inside a UTF-8 character: its remaining bytes come out first.
    The stream was primed with the partial character and its first delta repeated the prompt's
    text ("Hi 日本" for "本" after a prompt ending in 日's first byte; QA). Now the character,
    finished by the output, comes out once, and nothing of the prompt before it."""
    tok, _, _ = byte_level_tokenizer(tmp_path, [])
    data = "Hi \u65e5\u672c".encode()           # byte tokens: each id is its byte
    for cut in (4, 5):                           # inside 日 (3 bytes, from index 3)
        d = IncrementalDetokenizer(tok, list(data[:cut]), skip_special_tokens=True)
        assert "".join(d.step(b) for b in data[cut:]) == "\u65e5\u672c"
    d = IncrementalDetokenizer(tok, list(data[:3]), skip_special_tokens=True)   # on a boundary
    assert "".join(d.step(b) for b in data[3:]) == "\u65e5\u672c"


def test_context_window_starting_inside_a_character_garbles_nothing(tmp_path):
    """The stream is primed with the prompt's last few tokens; where they began inside a
    character (an emoji's byte tokens), its stray bytes decoded as U+FFFD and a byte-fallback
    decoder turned the output's byte tokens into U+FFFD too ("é" came out as six; QA). The
    window now starts on a character's first byte."""
    t = sentencepiece_tokenizer(tmp_path)
    as_bytes = lambda text: [3 + b for b in text.encode()]  # noqa: E731 - byte-fallback ids
    prompt = [1, 259] + as_bytes("\U0001F600!")
    output = as_bytes("\u00e9") + [260] + as_bytes("\u65e5") + [261]
    assert "".join(stream(t, prompt, output)) == "\u00e9 world\u65e5 foo"
    (tmp_path / "bpe").mkdir()
    b, _, _ = byte_level_tokenizer(tmp_path / "bpe", [])
    data = "\n\u00fc\u8a9e\uc5b4".encode()       # the window's first tokens continue 語
    assert "".join(stream(b, list(data[:-1]), list(data[-1:]))) == "\uc5b4"
