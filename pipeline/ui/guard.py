"""A key in front of the episode browser where it shares a port with others (mounted in the gateway, whose
port agents reach): every request must carry the key, as the password of HTTP Basic (which a browser asks
for and remembers) or as ``Authorization: Bearer``. Served alone, ``turnstile ui`` listens on loopback."""

from __future__ import annotations

import base64
import binascii
import hmac
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

REALM = "turnstile episode browser (password: the admin key)"


def _presented(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() != b"authorization":
            continue
        scheme, _, credentials = value.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer":
            return credentials.strip()
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return None
            return decoded.partition(":")[2]
    return None


class KeyGuard:
    """ASGI middleware: 401 with a Basic challenge unless the request carries ``key``."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        presented = _presented(list(scope.get("headers", [])))
        if presented is not None and hmac.compare_digest(presented.encode(), self.key):
            await self.app(scope, receive, send)
            return
        body = b"the episode browser needs the admin key (HTTP Basic: any user name, the key as password)\n"
        headers: list[Any] = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"www-authenticate", f'Basic realm="{REALM}"'.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
