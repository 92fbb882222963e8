"""OpenAI API request bodies (pydantic) and their mapping to trtllm-lite's request values,
with vLLM's extra sampling fields (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ...). Unknown fields are ignored, as vLLM and OpenAI's own
servers tolerate the extras client libraries send, and their names logged (vLLM too); known
ones are checked by
``SamplingParams`` (a bad value is a 400 naming the field).
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sampling_params import MAX_LOGPROBS


STOP_FORMS = "must be a string or a list of strings"
CONTENT_FORMS = ("must be a string or a list of content parts, each an object such as "
                 "{\"type\": \"text\", \"text\": \"...\"}")   # a chat message's content
CONTENT_PART_FORM = "a content part must be an object such as {\"type\": \"text\", \"text\": \"...\"}"
PROMPT_FORMS = ("must be a string, a list of strings, a list of token ids (integers) or a list of lists "
                "of token ids")   # a completion prompt's accepted forms, for errors


class _NullIsDefault(BaseModel):
    """A body whose fields named in ``null_is_default`` take their default when sent as JSON
    null, as OpenAI's and vLLM's servers take ``"stream": null`` (QA, session 42: a 400)."""

    null_is_default: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        if isinstance(data, dict) and cls.null_is_default:
            return {k: v for k, v in data.items() if not (v is None and k in cls.null_is_default)}
        return data


# strict: a wrong JSON type is a 400 naming the field (true is not 1, "yes" is not true)
class StreamOptions(_NullIsDefault):
    model_config = ConfigDict(extra="allow", strict=True)   # (unknown fields: logged, ignored)
    null_is_default: ClassVar[tuple[str, ...]] = ("include_usage", "continuous_usage_stats")
    include_usage: bool = False
    continuous_usage_stats: bool = False


#: Request fields that constrain what may be generated (OpenAI's legacy function calling,
#: vLLM's guided decoding): refused, not ignored, as ``tools`` and a non-text ``response_format``
#: are; ``function_call`` "none" / "auto" ask for nothing and are accepted.
CONSTRAINING_EXTRAS = ("functions", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                       "structured_outputs")


class _Sampling(_NullIsDefault):
    """Fields shared by completions and chat completions."""

    null_is_default: ClassVar[tuple[str, ...]] = ("n", "stream")

    #: fields outside the route's declared ones that it reads (refused or accepted), so not
    #: logged as ignored (QA: an accepted ``function_call: "auto"`` was)
    checked_extras: ClassVar[tuple[str, ...]] = CONSTRAINING_EXTRAS + ("response_format",)

    model_config = ConfigDict(extra="allow", strict=True)   # (unknown fields: logged, ignored)

    model: str | None = None
    cache_salt: str | None = None       # vLLM: prefix-cache blocks shared only within a salt
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # never generated; bounded and checked as gRPC's (the engine's)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None

    def common_values(self) -> dict[str, Any]:
        """Sampling values under vLLM names (None = not set). ``prompt_logprobs`` above 0 with
        ``stream`` is refused, as vLLM does: a streamed answer has nowhere to carry them."""
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs > 0:
            raise ValueError(f"prompt_logprobs ({self.prompt_logprobs}) is not available with stream=true "
                             "(as in vLLM): a streamed answer does not carry them")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) other than n ({self.n}) is not supported")
        options = self.stream_options   # (an empty object, as vLLM takes it, asks for nothing)
        if options is not None and (options.model_fields_set or options.model_extra) and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        extra = self.model_extra or {}
        for name in CONSTRAINING_EXTRAS:   # ignoring them would give unconstrained text as if obeyed
            if extra.get(name) is not None:
                raise ValueError(f"{name} is not supported (there is no structured output or tool calling)")
        form = extra.get("response_format")   # (chat declares it; a completion gets vLLM's extra)
        if form is not None and not (isinstance(form, dict) and form.get("type") == "text"):
            raise ValueError("response_format: only {'type': 'text'} is supported")
        bias = None
        if self.logit_bias:
            # canonical decimal only: int() also takes " 5", "-0", "+5", "0_5" and "٥"
            key = next((k for k in self.logit_bias if not re.fullmatch(r"0|[1-9][0-9]*", k)), None)
            if key is not None:
                raise ValueError(f"logit_bias keys must be token ids as decimal digits (\"5\", no sign, "
                                 f"space or leading zero), got {key!r}")
            key = next((k for k in self.logit_bias if len(k) > 19), None)   # (QA: int() refuses 4300+ digits)
            if key is not None:
                raise ValueError(f"logit_bias token id {key[:24]}... ({len(key)} digits) is outside the vocabulary")
            bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, stop=stop, seed=self.seed,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    logit_bias=bias, top_k=self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
                    min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids, bad_words=self.bad_words,
                    include_stop_str_in_output=self.include_stop_str_in_output,
                    skip_special_tokens=self.skip_special_tokens, prompt_logprobs=self.prompt_logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    null_is_default: ClassVar[tuple[str, ...]] = ("n", "stream", "echo")

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16   # absent: 16 (OpenAI's legacy default); null: see sampling_values
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list:
        """The prompts of the batch: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the answer is the prompt alone (with its logprobs when
        ``logprobs`` is sent), as OpenAI's legacy API and vLLM give it, to score a text."""
        return self.echo and self.max_tokens == 0

    def sampling_values(self, room: int | None = None) -> dict[str, Any]:
        """Sampling values for one prompt. ``max_tokens`` absent is 16 (OpenAI's legacy
        default, and vLLM's); sent as null it is ``room``, the tokens left in ``max_model_len``
        after this prompt (at least 1; whether the prompt leaves room is the engine's check), as
        vLLM does. With ``echo``, ``logprobs`` asks for the prompt's logprobs too (unless
        ``prompt_logprobs`` is sent), as vLLM does: the echoed tokens carry theirs.

        Raises:
            ValueError: a field is unsupported or out of range (the message names it).
        """
        if self.suffix:
            raise ValueError("suffix is not supported")
        max_tokens = self.max_tokens if self.max_tokens is not None or room is None else max(room, 1)
        if self.echo_only:   # one token is generated, then left out of the answer
            check_min_tokens(self.min_tokens, 0, "max_tokens")   # (QA, session 42: taken)
            max_tokens = 1
        elif max_tokens is not None:   # absent: the default 16; null: what the prompt leaves
            check_min_tokens(self.min_tokens, max_tokens, "max_tokens" if self.max_tokens is not None else None,
                             default="max_tokens" not in self.model_fields_set)
        values = dict(self.common_values(), max_tokens=max_tokens, logprobs=self.logprobs)
        if self.echo and values["prompt_logprobs"] is None:   # echo + logprobs: the prompt's too (vLLM)
            values["prompt_logprobs"] = self.logprobs
        return values


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"messages: content of type {part.type!r} is not supported (text only)")
            if part.text is None:
                raise ValueError("messages: a content part of type 'text' needs a 'text' string")
            parts.append(part.text)
        return "\n".join(parts)   # as vLLM joins a message's text parts (string content format)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    #: vLLM's chat-template extras, refused when they would change the prompt: ignoring them
    #: answered as if obeyed (QA: continue_final_message gave "" / stop)
    TEMPLATE_EXTRAS: ClassVar[tuple[str, ...]] = ("chat_template", "chat_template_kwargs",
                                                  "continue_final_message", "echo")
    checked_extras: ClassVar[tuple[str, ...]] = CONSTRAINING_EXTRAS + ("function_call",) + TEMPLATE_EXTRAS

    null_is_default: ClassVar[tuple[str, ...]] = ("n", "stream", "logprobs", "add_generation_prompt")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def sampling_values(self, room: int) -> dict[str, Any]:
        """``room``: tokens left in ``max_model_len`` after the prompt (the default max_tokens,
        as vLLM does). ``max_completion_tokens`` wins over ``max_tokens``, but each one sent
        must be an integer >= 1, as OpenAI checks every field it receives; whether it fits
        after the prompt is the engine's check (``Scheduler.check_room``).

        Raises:
            ValueError: a field is unsupported or out of range (the message names it).
        """
        if self.tools:
            raise ValueError("tools are not supported")
        extra = self.model_extra or {}
        for name in self.TEMPLATE_EXTRAS:   # None, false, {} and "" change nothing
            if extra.get(name):
                raise ValueError(f"{name} is not supported (the engine's own chat template renders "
                                 f"the messages, with add_generation_prompt)")
        function_call = (self.model_extra or {}).get("function_call")   # (the legacy tool_choice)
        if function_call not in (None, "none", "auto"):
            raise ValueError(f"function_call {function_call!r} needs functions, which are not supported "
                             f"(only 'none' or 'auto', which give text)")
        if self.tool_choice not in (None, "none", "auto"):   # a tool call asked for: none can come
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools, which are not supported "
                             f"(only 'none' or 'auto', which give text)")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        for name in ("max_tokens", "max_completion_tokens"):   # errors name the field as sent
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        sent = ("max_completion_tokens" if self.max_completion_tokens is not None
                else "max_tokens" if self.max_tokens is not None else None)
        check_min_tokens(self.min_tokens, max_tokens if max_tokens is not None else max(room, 1), sent)
        return dict(self.common_values(), max_tokens=max_tokens if max_tokens is not None else max(room, 1),
                    logprobs=(self.top_logprobs or 0) if self.logprobs else None)

    def message_dicts(self) -> list[dict[str, str]]:
        return message_dicts(self.messages)


def check_min_tokens(min_tokens, max_tokens: int, sent: str | None, default: bool = False) -> None:
    """Refuse ``min_tokens`` above the ``max_tokens`` in effect, naming where that came from:
    the field ``sent``, OpenAI's legacy default (``default``: completions' 16), or, with neither,
    the tokens left in ``max_model_len`` after the prompt (QA, session 42: the message named a
    ``max_tokens`` the client never sent, and no number). A ``min_tokens`` that is not an integer
    is ``SamplingParams``' to refuse."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens <= max_tokens:
        return
    if default:
        where = f"max_tokens ({max_tokens}, the default)"
    elif sent:
        where = f"{sent} ({max_tokens})"
    else:
        where = f"the {max_tokens} tokens left after the prompt (max_model_len)"
    raise ValueError(f"min_tokens ({min_tokens}) exceeds {where}")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template takes them (``{"role", "content"}``, content as text).
    Raises ``ValueError`` for a message without content (an assistant's may have none) or
    with a part that is not text."""
    for i, m in enumerate(messages):
        if (m.content is None or m.content == []) and m.role != "assistant":   # no parts: none either
            raise ValueError(f"messages: message {i} (role {m.role!r}) has no content")
    return [{"role": m.role, "content": m.text()} for m in messages]


class TokenizeRequest(_NullIsDefault):
    model_config = ConfigDict(extra="allow", strict=True)   # (unknown fields: logged, ignored)
    null_is_default: ClassVar[tuple[str, ...]] = ("add_special_tokens", "add_generation_prompt")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_NullIsDefault):
    model_config = ConfigDict(extra="allow", strict=True)   # (unknown fields: logged, ignored)
    null_is_default: ClassVar[tuple[str, ...]] = ("skip_special_tokens",)
    model: str | None = None
    tokens: list[int]
    # special tokens kept by default, as vLLM's /detokenize (tokenizer.decode) keeps them, so
    # /tokenize's ids of a chat come back with their template's markers
    skip_special_tokens: bool = False


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable",
               504: "timeout_error"}


def error_type(status: int) -> str:
    """The OpenAI error type for an HTTP status: :data:`ERROR_TYPES`, else
    ``invalid_request_error`` for any other 4xx (405, 413, 422, ...) and
    ``internal_server_error`` for any other 5xx."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "internal_server_error"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


FinishReason = Literal["stop", "length", "abort"]


# every request field name: what an error's location path may name (pydantic also puts the
# union member it tried, e.g. "str", in the path; those are not parameters)
FIELD_NAMES = frozenset().union(*(m.model_fields for m in (
    StreamOptions, CompletionRequest, ContentPart, ChatMessage, ChatCompletionRequest,
    TokenizeRequest, DetokenizeRequest)))
