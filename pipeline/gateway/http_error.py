"""The gateway's error answer: a wire API request error with HTTP headers (``Retry-After``)."""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.dialects import RequestError


class GatewayError(RequestError):
    """An HTTP error answer: its status, message, the request field it names, a code and extra headers; the
    dialect of the route renders it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, param=param, status=status, code=code)
        self.headers = dict(headers or {})
