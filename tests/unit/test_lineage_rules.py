"""The pure rules of one conversation, one lineage: form-only changes (``pipeline.episodes.lineage``) and the
materializer's side calls and root reasons (``pipeline.materialize.lineages``), on hand-made cases."""

from __future__ import annotations

from pipeline.episodes.lineage import reply_changes, same_in_form, with_defaults
from pipeline.materialize.lineages import TurnFacts, root_reasons, side_roots, side_turns
from schemas import ChatMessage, FunctionCall, ToolCall

MULTI_EDIT = {
    "type": "object",
    "properties": {
        "file_path": {"type": "string"},
        "edits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"old": {}, "new": {}, "replace_all": {"default": False}},
            },
        },
        "options": {"type": "object", "properties": {"dry_run": {"default": False}}},
    },
}


def test_defaults_are_filled_in_nested_objects_and_array_items() -> None:
    given = {"file_path": "a", "edits": [{"old": "x", "new": "y"}], "options": {}}
    assert with_defaults(given, MULTI_EDIT) == {
        "file_path": "a",
        "edits": [{"old": "x", "new": "y", "replace_all": False}],
        "options": {"dry_run": False},
    }


def test_form_only_changes_are_the_same_and_changes_of_substance_are_not() -> None:
    recorded = '{"file_path": "a", "edits": [{"old": "x", "new": "y"}], "options": {"n": 1}}'
    same = '{"edits":[{"replace_all":false,"new":"y","old":"x"}],"options":{"n":1.0},"file_path":"a"}'
    assert same_in_form(same, recorded, MULTI_EDIT)
    assert not same_in_form(same.replace('"y"', '"z"'), recorded, MULTI_EDIT)
    assert not same_in_form(
        same.replace("false", "true"), recorded, MULTI_EDIT
    )  # a default given another value
    assert not same_in_form(same.replace("1.0", "true"), recorded, MULTI_EDIT)  # true is not 1
    assert not same_in_form("not json", recorded, MULTI_EDIT)


def test_an_edited_reply_is_described_key_by_key() -> None:
    def reply(text: str, arguments: str) -> ChatMessage:
        call = ToolCall(id="c1", function=FunctionCall(name="Bash", arguments=arguments))
        return ChatMessage(role="assistant", content=text, tool_calls=[call])

    schemas = {"Bash": {"properties": {"background": {"default": False}}}}
    recorded = reply("Run it.", '{"command": "ls"}')
    assert reply_changes(reply("Run it. ", '{"background":false,"command":"ls"}'), recorded, schemas) == []
    changes = reply_changes(reply("Run this.", '{"command": "ls -la", "cwd": "/"}'), recorded, schemas)
    assert changes == [
        "text 'Run it.' -> 'Run this.'",
        "tool call c1 (Bash): command 'ls' -> 'ls -la'",
        "tool call c1 (Bash): cwd added ('/')",
    ]


def facts(
    index: int, *, tools: bool = True, model: str | None = "big", train: bool | None = None
) -> TurnFacts:
    return TurnFacts(f"t{index}", index, tools, model, train, edited=False, prefix_break=False)


def test_side_calls_are_roots_without_tools_beside_tools_or_of_another_model() -> None:
    turns = [
        facts(0, tools=False, model="small"),  # a topic check before the loop
        facts(1),
        facts(2),
        facts(3, tools=False),  # a title
        facts(4, model="small"),  # a small model with tools
        facts(5, tools=False, train=True),  # asked for training
        facts(6, model="small"),  # under the small model's root: its lineage
    ]
    tree = {"t0": None, "t1": None, "t2": "t1", "t3": None, "t4": None, "t5": None, "t6": "t4"}
    assert side_roots(turns, tree) == {"t0", "t3", "t4"}
    assert side_turns(turns, tree) == {"t0", "t3", "t4", "t6"}
    reasons = root_reasons(turns, tree, side_roots(turns, tree))
    assert reasons == {
        "t0": "side call",
        "t1": "first call",
        "t3": "side call",
        "t4": "side call",
        "t5": "new conversation",
    }


def test_an_episode_without_tools_has_no_side_calls_by_the_rule() -> None:
    turns = [facts(0, tools=False), facts(1, tools=False)]
    assert side_roots(turns, {"t0": None, "t1": None}) == set()
