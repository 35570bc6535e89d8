"""API-key check shared by the transports (HTTP here; the gRPC interceptor can call the same)."""

from __future__ import annotations

import hmac

from service.errors import Unauthenticated
from service.settings import Settings


def check_api_key(settings: Settings, authorization: str | None, x_api_key: str | None) -> None:
    """Raise ``Unauthenticated`` unless no key is configured or the caller presents it.

    The key may come as ``Authorization: Bearer KEY`` or as ``X-API-Key: KEY``.
    """
    expected = settings.api_key
    if not expected:
        return
    presented: list[str] = []
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            presented.append(token.strip())
    if x_api_key:
        presented.append(x_api_key.strip())
    if not presented:
        raise Unauthenticated("an API key is required: send 'Authorization: Bearer KEY' or 'X-API-Key: KEY'")
    if not any(hmac.compare_digest(p.encode(), expected.encode()) for p in presented):
        raise Unauthenticated("the API key is not valid")
