"""Fuzzing one conversation, one lineage: a tool call the model made comes back re-serialized the ways clients
do it (schema defaults filled in, nested ones too, keys reordered, other whitespace, ``1`` written ``1.0``,
``1e0`` or with an exponent, ``/`` escaped) and the next turn
must continue it; any change in substance (another value, a key removed, a default given another value) must
be recorded as an edit of that turn, naming the key, and start a lineage of its own. Through the gateway's
chat completions and messages routes, as clients send them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.episodes.lineage import same_json
from pipeline.gateway import create_gateway
from pipeline.log import InMemoryStore
from schemas import TurnCompleted
from tests.support.captured import ADMIN, ScriptedLLM

KEYS = ["command", "path", "count", "flag", "items", "options"]
DEFAULTED = ["replace_all", "timeout", "mode"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False, width=32).filter(lambda x: abs(x) < 1e12),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def exchanges(draw: st.DrawFn) -> dict[str, Any]:
    """Recorded arguments, the tool's schema, and the arguments as the client sends them back."""
    recorded = draw(st.dictionaries(st.sampled_from(KEYS), values, min_size=1, max_size=4))
    defaults = draw(st.dictionaries(st.sampled_from(DEFAULTED), scalars, max_size=3))
    schema = {
        "type": "object",
        "properties": {
            **{key: {} for key in recorded},
            **{key: {"default": value} for key, value in defaults.items()},
        },
    }
    if draw(st.booleans()):  # an array of objects whose items' schema has a default (Claude Code's MultiEdit)
        recorded["edits"] = [{"old": text} for text in draw(st.lists(st.text(max_size=5), max_size=3))]
        schema["properties"]["edits"] = NESTED
    sent = dict(recorded)
    for key in draw(st.lists(st.sampled_from(sorted(defaults)), unique=True)) if defaults else []:
        sent[key] = defaults[key]  # a default filled in: form only
    if "edits" in sent:  # the items' default filled in on some of them: form only
        sent["edits"] = [
            {**edit, "replace_all": False} if draw(st.booleans()) else edit for edit in sent["edits"]
        ]
    change = draw(st.sampled_from(["none", "none", "value", "removed", "default"]))
    changed_key = None
    if change == "value":
        changed_key = draw(st.sampled_from(sorted(recorded)))
        sent[changed_key] = {"changed": sent[changed_key]}
    elif change == "removed" and len(recorded) > 1:
        changed_key = draw(st.sampled_from(sorted(recorded)))
        del sent[changed_key]
    elif change == "default" and defaults:
        changed_key = draw(st.sampled_from(sorted(defaults)))
        sent[changed_key] = ["not", "the", "default", defaults[changed_key]]
    order = draw(st.permutations(sorted(sent)))
    sent = {key: as_floats(sent[key], draw(st.booleans())) for key in order}
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    indent = draw(st.sampled_from([None, 1, "\t"]))
    spelling = draw(st.sampled_from(["json", "json", "fraction", "exponent"]))
    if spelling == "json":
        text = json.dumps(sent, separators=separators, indent=indent, ensure_ascii=draw(st.booleans()))
    else:
        text = spelled(sent, spelling)
    return {"recorded": recorded, "schema": schema, "sent": sent, "sent_text": text, "changed": changed_key}


NESTED = {
    "type": "array",
    "items": {"type": "object", "properties": {"old": {}, "replace_all": {"default": False}}},
}


def spelled(value: Any, spelling: str) -> str:
    """``value`` as JSON text whose numbers are spelled another way than Python writes them (``2.0`` or
    ``2e0`` for ``2``, ``1.5000000000000000e+00`` for ``1.5``) and whose slashes are escaped (``\\/``), as
    other JSON writers may: the same value."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return f"{value}.0" if spelling == "fraction" else f"{value}e0"
    if isinstance(value, float):
        return f"{value:.17e}"
    if isinstance(value, str):
        return json.dumps(value).replace("/", "\\/")
    if isinstance(value, list):
        return "[" + ",".join(spelled(item, spelling) for item in value) + "]"
    return "{" + ",".join(f"{json.dumps(key)}:{spelled(item, spelling)}" for key, item in value.items()) + "}"


def as_floats(value: Any, floats: bool) -> Any:
    """``value`` with its integers written as floats (``1.0``), as a client with one number type may."""
    if not floats:
        return value
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return float(value) if abs(value) < 2**53 else value
    if isinstance(value, list):
        return [as_floats(item, floats) for item in value]
    if isinstance(value, dict):
        return {key: as_floats(item, floats) for key, item in value.items()}
    return value


STORE = InMemoryStore()
LLM = ScriptedLLM([])
APP = create_gateway(STORE, LLM, admin_key="admin-key", policy_default="main", idle_timeout=None)


async def two_turns(exchange: dict[str, Any], route: str) -> list[TurnCompleted]:
    """A tool call with the recorded arguments, then the call that sends it back as ``exchange`` says."""
    model_text = json.dumps(exchange["recorded"])  # as the model wrote it
    LLM.replies[:] = [
        {"text": "", "tool_calls": [{"id": "call_f1", "name": "tool", "arguments": model_text}]},
        {"text": "done"},
    ]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=APP), base_url="http://gateway") as client:
        session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
        key = {"Authorization": f"Bearer {session['api_key']}", "x-api-key": session["api_key"]}
        task = {"role": "user", "content": "use the tool"}
        if route == "/v1/chat/completions":
            tools = [{"type": "function", "function": {"name": "tool", "parameters": exchange["schema"]}}]
            call = {"id": "call_f1", "type": "function"}
            call["function"] = {"name": "tool", "arguments": exchange["sent_text"]}
            history = [
                task,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_f1", "content": "ok"},
            ]
            bodies = [{"model": "m", "messages": [task], "tools": tools}]
            bodies.append({"model": "m", "messages": history, "tools": tools})
        else:
            tools = [{"name": "tool", "input_schema": exchange["schema"]}]
            use = {"type": "tool_use", "id": "call_f1", "name": "tool", "input": exchange["sent"]}
            result = {"type": "tool_result", "tool_use_id": "call_f1", "content": "ok"}
            history = [task, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
            bodies = [{"model": "m", "max_tokens": 8, "messages": messages, "tools": tools} for messages in
                      ([task], history)]  # fmt: skip
        for body in bodies:
            answered = await client.post(route, json=body, headers=key)
            assert answered.status_code == 200, answered.text
    records = await STORE.read_stream(f"episode-{session['session_id']}")
    return [r.event for r in records if isinstance(r.event, TurnCompleted)]


def check(exchange: dict[str, Any], route: str) -> None:
    first, second = asyncio.run(two_turns(exchange, route))
    if exchange["changed"] is None:
        assert second.parent_turn_id == first.turn_id, (exchange, second.edit)
        assert second.edit is None
        # what the turn records of the history holds the arguments as the model wrote them
        calls = [c for m in second.request.messages for c in m.tool_calls or []]
        assert all(c.function.arguments == json.dumps(exchange["recorded"]) for c in calls)
    else:
        assert second.parent_turn_id is None  # the model never wrote this: a lineage of its own
        assert second.edit is not None
        assert second.edit.turn_id == first.turn_id
        assert any(exchange["changed"] in change for change in second.edit.changes), second.edit.changes
        # every key the edit names did change (a default filled in, another form, is never named)
        given_defaults = {
            k: v["default"] for k, v in exchange["schema"]["properties"].items() if "default" in v
        }
        recorded = {**given_defaults, **exchange["recorded"]}
        sent = {**given_defaults, **exchange["sent"]}
        for change in second.edit.changes:
            named = change.split(": ", 1)[1].split(" ", 1)[0]
            assert named not in sent or named not in recorded or not same_json(sent[named], recorded[named])


FUZZ = settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@FUZZ
@given(exchange=exchanges())
def test_chat_completions_arguments_sent_back_in_another_form_never_split_a_lineage(
    exchange: dict[str, Any],
) -> None:
    check(exchange, "/v1/chat/completions")


@FUZZ
@given(exchange=exchanges())
def test_messages_tool_use_input_sent_back_in_another_form_never_splits_a_lineage(
    exchange: dict[str, Any],
) -> None:
    check(exchange, "/v1/messages")
