"""One conversation, one lineage: telling a reply sent back changed in form from one changed in substance.

Clients do not always send the model's output back as they got it. Claude Code fills in the tool schema's
defaults (its ``Edit`` call comes back with ``"replace_all": false`` added), the Vercel AI SDK re-serializes
arguments (``{"cmd":"ls"}`` for ``{"cmd": "ls"}``), others reorder keys or write ``1.0`` for ``1``. None of
that changes what the tool does, so the session restores the text the model wrote and the next turn
continues the recorded tokens. Anything else (another command, other text) is an edit: the turn that
carries it cannot continue tokens the policy never wrote, so it starts a lineage of its own and records
what changed (``TurnEdit``).

Pure functions; ``EpisodeSession`` applies them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from pipeline.dialects import same_json
from schemas import ChatMessage, ToolCall, ToolSpec

SHOWN: Final = 80
"""Characters of a changed value shown in an edit's description."""


def with_defaults(value: object, schema: object) -> object:
    """``value`` with the ``default`` of every property ``schema`` declares and ``value`` lacks, nested
    objects and the items of arrays included (what a client that validates arguments against the schema
    sends back: Claude Code's ``MultiEdit`` edits each get ``"replace_all": false``)."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, list):
        items = schema.get("items")
        return [with_defaults(item, items) for item in value] if isinstance(items, dict) else value
    if not isinstance(value, dict):
        return value
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return value
    filled = dict(value)
    for name, spec in properties.items():
        if not isinstance(spec, dict):
            continue
        if name not in filled and "default" in spec:
            filled[name] = spec["default"]
        elif name in filled:
            filled[name] = with_defaults(filled[name], spec)
    return filled


def parsed(text: str) -> tuple[bool, Any]:
    """``(True, value)`` for JSON text, ``(False, None)`` for text that is not JSON."""
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def same_in_form(sent: str, recorded: str, schema: object) -> bool:
    """Whether arguments ``sent`` back are the ``recorded`` ones in another form: the same JSON once the
    tool schema's defaults are filled in on both sides (whitespace, key order, number spelling aside)."""
    if sent == recorded:
        return True
    ok_sent, sent_value = parsed(sent)
    ok_recorded, recorded_value = parsed(recorded)
    if not (ok_sent and ok_recorded):
        return False
    return same_json(with_defaults(sent_value, schema), with_defaults(recorded_value, schema))


def schemas_by_name(tools: list[ToolSpec]) -> dict[str, dict[str, Any]]:
    return {tool.function.name: tool.function.parameters for tool in tools}


def restored_call(call: ToolCall, recorded: ToolCall, schemas: Mapping[str, object]) -> ToolCall | None:
    """``recorded`` when ``call`` is it sent back changed in form only, else None."""
    if call.function.name != recorded.function.name:
        return None
    if call.function.arguments == recorded.function.arguments:
        return recorded
    schema = schemas.get(call.function.name)
    return recorded if same_in_form(call.function.arguments, recorded.function.arguments, schema) else None


def _shown(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return repr(text if len(text) <= SHOWN else text[: SHOWN - 1] + "…")


def argument_changes(sent: str, recorded: str, schema: object, where: str) -> list[str]:
    """What differs between recorded and sent arguments, one sentence per changed key."""
    ok_sent, sent_value = parsed(sent)
    ok_recorded, recorded_value = parsed(recorded)
    if not (ok_sent and ok_recorded and isinstance(sent_value, dict) and isinstance(recorded_value, dict)):
        return [f"{where}: arguments {_shown(recorded)} -> {_shown(sent)}"]
    sent_value = with_defaults(sent_value, schema)
    recorded_value = with_defaults(recorded_value, schema)
    assert isinstance(sent_value, dict)
    assert isinstance(recorded_value, dict)
    changes = []
    for key in sorted(recorded_value.keys() | sent_value.keys()):
        if key not in sent_value:
            changes.append(f"{where}: {key} removed (was {_shown(recorded_value[key])})")
        elif key not in recorded_value:
            changes.append(f"{where}: {key} added ({_shown(sent_value[key])})")
        elif not same_json(sent_value[key], recorded_value[key]):
            changes.append(f"{where}: {key} {_shown(recorded_value[key])} -> {_shown(sent_value[key])}")
    return changes


def call_changes(sent: ToolCall, recorded: ToolCall, schemas: Mapping[str, object]) -> list[str]:
    """What a client changed in substance in a tool call it sent back (empty: nothing, or form only)."""
    where = f"tool call {recorded.id} ({recorded.function.name})"
    if sent.function.name != recorded.function.name:
        return [f"{where}: tool {recorded.function.name!r} -> {sent.function.name!r}"]
    if restored_call(sent, recorded, schemas) is not None:
        return []
    return argument_changes(
        sent.function.arguments, recorded.function.arguments, schemas.get(recorded.function.name), where
    )


def reply_changes(sent: ChatMessage, recorded: ChatMessage, schemas: Mapping[str, object]) -> list[str]:
    """What a client changed in a reply it sent back: its text, its tool calls (by id) and their arguments."""
    changes = []
    if (sent.content or "").strip() != (recorded.content or "").strip():
        changes.append(f"text {_shown(recorded.content or '')} -> {_shown(sent.content or '')}")
    recorded_calls = {call.id: call for call in recorded.tool_calls or []}
    sent_calls = {call.id: call for call in sent.tool_calls or []}
    for call_id, call in recorded_calls.items():
        if call_id not in sent_calls:
            changes.append(f"tool call {call_id} ({call.function.name}) removed")
        else:
            changes += call_changes(sent_calls[call_id], call, schemas)
    changes += [
        f"tool call {call_id} ({call.function.name}) added" for call_id, call in sent_calls.items()
        if call_id not in recorded_calls
    ]  # fmt: skip
    return changes
