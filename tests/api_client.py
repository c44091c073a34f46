"""Django's AsyncClient with an API key on every request (its `headers=` argument reaches only
synchronous requests: the async client puts the default headers outside the ASGI scope's headers)."""

from __future__ import annotations

from django.test import AsyncClient


class KeyedAsyncClient(AsyncClient):
    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__()
        self._key_headers = dict(headers)

    def generic(self, *args, headers=None, **kwargs):
        return super().generic(*args, headers={**self._key_headers, **(headers or {})}, **kwargs)
