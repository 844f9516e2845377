"""The HTTP gateway: OpenAI- and Anthropic-compatible routes (one set per dialect in
``pipeline.dialects``) over episode sessions, session keys and admission, and the HTTP server it runs on."""

from pipeline.gateway.app import create_gateway, gateway_of
from pipeline.gateway.http_error import GatewayError
from pipeline.gateway.limits import MAX_BODY_BYTES, READ_TIMEOUT, BoundedRequests, check_http_limits
from pipeline.gateway.metrics import RequestMetrics
from pipeline.gateway.server import HttpServer, serving_http
from pipeline.gateway.service import EndSpec, Gateway, RewardSpec, SessionSpec
from pipeline.gateway.sessions import SessionEntry, SessionRegistry, key_digest
from pipeline.gateway.shared import SharedSessions

__all__ = [
    "MAX_BODY_BYTES",
    "READ_TIMEOUT",
    "BoundedRequests",
    "EndSpec",
    "Gateway",
    "GatewayError",
    "HttpServer",
    "RequestMetrics",
    "RewardSpec",
    "SessionEntry",
    "SessionRegistry",
    "SessionSpec",
    "SharedSessions",
    "check_http_limits",
    "create_gateway",
    "gateway_of",
    "key_digest",
    "serving_http",
]
