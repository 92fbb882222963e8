"""argparse types shared by the command-line tools: a bad value is an argparse error that
names the flag (``argument --num-threads: must be an integer >= 1, got 0``), exit status 2."""
from __future__ import annotations

import argparse
import json


def at_least(minimum: float, kind: type = int, strict: bool = False, maximum: float | None = None):
    """A type that reads ``kind`` (int or float) and refuses values below ``minimum`` (with
    ``strict``: at or below it, e.g. a timeout of 0 s), above ``maximum``, and, for floats,
    infinities."""
    noun = "an integer" if kind is int else "a finite number"
    bound = (f"> {minimum}" if strict else f">= {minimum}") + ("" if maximum is None else f" and <= {maximum}")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}") from None
        above = value > minimum if strict else value >= minimum      # NaN fails both
        if not above or value == float("inf") or maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be {noun} {bound}, got {text}")
        return value
    return parse


def non_empty(text: str) -> str:
    """A string type that refuses ''."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def port_number(text: str) -> int:
    """A TCP port, 0 (pick a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} out of range 0-65535")
    return port


def json_object(text: str) -> dict:
    """A JSON object (``--speculative-config '{"method": "ngram"}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
