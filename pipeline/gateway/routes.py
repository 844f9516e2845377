"""The gateway's routes, one ``APIRouter`` per resource: the chat routes of each dialect, Anthropic's token
count, the models, a session's own key, the admin's sessions and the health check."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.dialects import (
    ANTHROPIC,
    DIALECTS,
    OPENAI,
    Dialect,
    count_tokens_estimate,
    model_object,
)
from pipeline.gateway.http import (
    PROMPT_IDS_HEADER,
    Handover,
    client_gone,
    json_answer,
    json_body,
    parse_spec,
    respond,
    retry_keys,
    trained,
    wire_response,
)
from pipeline.gateway.http_error import GatewayError
from pipeline.gateway.openapi import (
    ANTHROPIC_COUNT_TOKENS,
    ANTHROPIC_MESSAGES,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    model_schema,
    openapi_body,
)
from pipeline.gateway.service import EndSpec, Gateway, RewardSpec, SessionSpec, describe
from pipeline.gateway.sessions import SessionEntry

REQUEST_SCHEMAS: Final = {
    "openai": OPENAI_CHAT,
    "anthropic": ANTHROPIC_MESSAGES,
    "responses": OPENAI_RESPONSES,
}
"""The request body of each dialect's chat route in ``/openapi.json``, by ``Dialect.name``."""


def chat_router(gateway: Gateway) -> APIRouter:
    """The chat routes, one set per wire API (``pipeline.dialects.DIALECTS``): chat completions, responses,
    messages."""
    router = APIRouter()

    def chat_route(dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
        async def chat(request: Request) -> Response:
            async def answer() -> Response:
                entry = await gateway.session_of(request)
                call = dialect.parse(
                    await json_body(request),
                    defaults=entry.session.started.sampling,
                    known_arguments=entry.tool_arguments,
                    memo=entry.memo(dialect.name),
                )
                call = dataclasses.replace(
                    call,
                    whole_prompt_ids=request.headers.get(PROMPT_IDS_HEADER, "").strip().lower() == "whole",
                    train=trained(request, entry, call.model),
                )

                async def listening() -> bool:
                    return not client_gone(request.receive)

                keys = retry_keys(request, await request.body())
                result = await gateway.answer(entry, call, keys, listening)
                reply = wire_response(dialect.render(call, result, model=entry.session.policy))

                def settle(handed: bool) -> None:
                    gateway.delivered(entry, result, handed=handed)

                return Handover(reply, settle)

            return await respond(dialect, answer)

        return chat

    for dialect in DIALECTS:
        for index, path in enumerate(dialect.paths):
            router.add_api_route(
                path,
                chat_route(dialect),
                methods=["POST"],
                include_in_schema=index == 0,
                openapi_extra=openapi_body(REQUEST_SCHEMAS[dialect.name]),
            )

    async def count_tokens(request: Request) -> Response:
        async def answer() -> Response:
            await gateway.session_of(request)
            return JSONResponse({"input_tokens": count_tokens_estimate(await json_body(request))})

        return await respond(ANTHROPIC, answer)

    for index, path in enumerate(("/v1/messages/count_tokens", "/v1/v1/messages/count_tokens")):
        router.add_api_route(
            path,
            count_tokens,
            methods=["POST"],
            include_in_schema=index == 0,
            openapi_extra=openapi_body(ANTHROPIC_COUNT_TOKENS),
        )
    return router


def models_router(gateway: Gateway) -> APIRouter:
    """OpenAI's model listing: each policy is a model."""
    router = APIRouter()

    async def models(request: Request) -> Response:
        async def answer() -> Response:
            return JSONResponse(
                {"object": "list", "data": [model_object(m) for m in await _models_of(gateway, request)]}
            )

        return await respond(OPENAI, answer)

    async def model(request: Request, name: str) -> Response:
        async def answer() -> Response:
            if name not in await _models_of(gateway, request):
                raise GatewayError(
                    404, f"The model {name!r} does not exist", param="model", code="model_not_found"
                )
            return JSONResponse(model_object(name))

        return await respond(OPENAI, answer)

    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/models/{name}", model, methods=["GET"])
    return router


def session_router(gateway: Gateway) -> APIRouter:
    """The session's own key: its description, its reward and its end."""
    router = APIRouter()

    async def own_session(request: Request) -> Response:
        async def answer() -> Response:
            return json_answer(describe(await gateway.session_of(request)))

        return await respond(OPENAI, answer)

    async def own_reward(request: Request) -> Response:
        async def answer() -> Response:
            entry = await gateway.session_of(request)
            return json_answer(await gateway.reward(entry, parse_spec(RewardSpec, await json_body(request))))

        return await respond(OPENAI, answer)

    async def own_end(request: Request) -> Response:
        async def answer() -> Response:
            entry = await gateway.session_of(request)
            return json_answer(
                await gateway.end(entry, parse_spec(EndSpec, await json_body(request, empty={})))
            )

        return await respond(OPENAI, answer)

    router.add_api_route("/v1/session", own_session, methods=["GET"])
    reward_body, end_body = (
        openapi_body(model_schema(RewardSpec)),
        openapi_body(model_schema(EndSpec), required=False),
    )
    router.add_api_route("/v1/session/reward", own_reward, methods=["POST"], openapi_extra=reward_body)
    router.add_api_route("/v1/session/end", own_end, methods=["POST"], openapi_extra=end_body)
    return router


def admin_router(gateway: Gateway) -> APIRouter:
    """The admin's sessions: start, list, describe, reward, end."""
    router = APIRouter()

    reward_body, end_body = (
        openapi_body(model_schema(RewardSpec)),
        openapi_body(model_schema(EndSpec), required=False),
    )

    async def create_session(request: Request) -> Response:
        async def answer() -> Response:
            gateway.require_admin(request)
            spec = parse_spec(SessionSpec, await json_body(request, empty={}))
            session, api_key = await gateway.start_session(spec)
            base_url = gateway.public_url or str(request.base_url).rstrip("/")
            body = {
                "session_id": session.episode_id,
                "api_key": api_key,
                "base_url": f"{base_url}/v1",
                "policy": session.policy,
            }
            return JSONResponse(body, status_code=201)

        return await respond(OPENAI, answer)

    async def admin_entry(request: Request, session_id: str) -> SessionEntry:
        gateway.require_admin(request)
        return await gateway.session_by_id(session_id)

    async def admin_session(request: Request, session_id: str) -> Response:
        async def answer() -> Response:
            return json_answer(describe(await admin_entry(request, session_id)))

        return await respond(OPENAI, answer)

    async def admin_reward(request: Request, session_id: str) -> Response:
        async def answer() -> Response:
            entry = await admin_entry(request, session_id)
            return json_answer(await gateway.reward(entry, parse_spec(RewardSpec, await json_body(request))))

        return await respond(OPENAI, answer)

    async def admin_end(request: Request, session_id: str) -> Response:
        async def answer() -> Response:
            entry = await admin_entry(request, session_id)
            return json_answer(
                await gateway.end(entry, parse_spec(EndSpec, await json_body(request, empty={})))
            )

        return await respond(OPENAI, answer)

    async def admin_sessions(request: Request) -> Response:
        async def answer() -> Response:
            gateway.require_admin(request)
            return JSONResponse({"data": [describe(entry) for entry in gateway.registry.entries()]})

        return await respond(OPENAI, answer)

    session_body = openapi_body(model_schema(SessionSpec), required=False)
    router.add_api_route("/admin/sessions", create_session, methods=["POST"], openapi_extra=session_body)
    router.add_api_route("/admin/sessions", admin_sessions, methods=["GET"])
    router.add_api_route("/admin/sessions/{session_id}", admin_session, methods=["GET"])
    router.add_api_route(
        "/admin/sessions/{session_id}/reward", admin_reward, methods=["POST"], openapi_extra=reward_body
    )
    router.add_api_route(
        "/admin/sessions/{session_id}/end", admin_end, methods=["POST"], openapi_extra=end_body
    )
    return router


def health_router() -> APIRouter:
    """``GET /health``."""
    router = APIRouter()

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    router.add_api_route("/health", health, methods=["GET"])
    return router


async def _models_of(gateway: Gateway, request: Request) -> list[str]:
    if gateway.is_admin(request):
        policies = {entry.session.policy for entry in gateway.registry.entries()}
        return sorted(policies | ({gateway.policy_default} if gateway.policy_default else set()))
    return [(await gateway.session_of(request)).session.policy]
