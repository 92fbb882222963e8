"""The API key check shared by the gRPC and HTTP front ends."""
from __future__ import annotations

import hmac


def bearer_token(authorization: str) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` header value, or None when the
    value uses another scheme. The scheme name is case-insensitive and one or more spaces
    follow it (RFC 7235 section 2.1: ``bearer  KEY`` is the same header as ``Bearer KEY``)."""
    scheme, _, token = authorization.partition(" ")
    return token.lstrip(" ") if scheme.lower() == "bearer" else None


def key_matches(candidate: str | None, api_key: str) -> bool:
    """Whether ``candidate`` is ``api_key``, compared in constant time (``hmac.compare_digest``)."""
    return candidate is not None and hmac.compare_digest(candidate.encode(), api_key.encode())


def key_is_sendable(api_key: str) -> bool:
    """Whether clients can send ``api_key``: printable ASCII without spaces, what gRPC metadata
    values may hold (and an HTTP header carries unchanged). A key read from the environment with
    a byte that is not UTF-8 (a surrogate-escaped str) failed every call with a 500 (QA 24)."""
    return bool(api_key) and all("!" <= c <= "~" for c in api_key)
