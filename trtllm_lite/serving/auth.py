"""The API key check shared by the gRPC and HTTP front ends."""
from __future__ import annotations

import hmac


def bearer_token(authorization: str) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` header value, or None when the
    value uses another scheme. The scheme name is case-insensitive (RFC 7235 section 2.1:
    ``bearer KEY`` is the same header as ``Bearer KEY``)."""
    scheme, _, token = authorization.partition(" ")
    return token if scheme.lower() == "bearer" else None


def key_matches(candidate: str | None, api_key: str) -> bool:
    """Whether ``candidate`` is ``api_key``, compared in constant time (``hmac.compare_digest``)."""
    return candidate is not None and hmac.compare_digest(candidate.encode(), api_key.encode())
