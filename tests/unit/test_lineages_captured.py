"""One conversation, one lineage, on request sequences modelled on what the pinned agent CLIs send
(``tests/support/fixtures/captured``): each conversation is one lineage, side calls and subagents are
lineages of their own, side calls are not trained, and a real edit is recorded with what changed."""

from __future__ import annotations

import itertools

import pytest

from pipeline.materialize import MaterializerConfig
from tests.support.captured import fixture, replay

CAPTURED = [
    "claude_code_edits",
    "claude_code_subagent",
    "claude_code_edited_command",
    "opencode_title",
    "codex_resume",
]


@pytest.mark.parametrize("name", CAPTURED)
async def test_a_captured_session_has_one_lineage_per_conversation_and_the_expected_side_lineages(
    name: str,
) -> None:
    captured = fixture(name)
    replayed = await replay(captured)
    expect = captured["expect"]
    assert replayed.groups() == expect["lineages"]
    assert replayed.reasons() == expect["reasons"]
    assert replayed.trained() == expect["trained"]
    assert all(turn.delivered for turn in replayed.lineages)  # every reply reached the (live) client
    for turn in replayed.turns:
        assert turn.prefix_tokens == 0 or turn.parent_turn_id is not None


async def test_claude_codes_tool_calls_sent_back_with_schema_defaults_continue_the_recorded_tokens() -> None:
    replayed = await replay(fixture("claude_code_edits"))
    main = replayed.turns[1:]
    whole = {}
    for turn in replayed.turns:
        taken = whole[turn.parent_turn_id][: turn.prefix_tokens] if turn.prefix_tokens else []
        whole[turn.turn_id] = [*taken, *turn.prompt_token_ids, *turn.completion_token_ids]
    for parent, child in itertools.pairwise(main):
        assert child.parent_turn_id == parent.turn_id
        assert child.edit is None
        # the child's prompt is the parent's prompt and completion, then what it adds (token-exact)
        assert whole[child.turn_id][: len(whole[parent.turn_id])] == whole[parent.turn_id]
    # the recorded history holds the arguments as the model wrote them, not as Claude Code sent them back
    sent_back = main[1].request.messages  # what turn 2 adds: none of turn 1's reply is repeated
    assert all(m.role != "assistant" for m in sent_back)


async def test_a_system_message_mid_session_extends_the_prompt_where_it_stands() -> None:
    replayed = await replay(fixture("claude_code_edits"))
    third = replayed.turns[3]  # the call that carries <total_tokens>
    assert [m.role for m in third.request.messages] == ["tool", "system"]
    assert third.request.messages[1].content == "<total_tokens>1961034 tokens left</total_tokens>"
    assert third.parent_turn_id == replayed.turns[2].turn_id  # it continues the turn before it
    assert "<total_tokens>" not in (replayed.turns[1].request.messages[0].content or "")


async def test_a_changed_command_is_recorded_as_an_edit_saying_what_changed() -> None:
    captured = fixture("claude_code_edited_command")
    replayed = await replay(captured)
    first, second = replayed.turns
    assert second.edit is not None
    assert second.edit.turn_id == first.turn_id
    described = " ".join(second.edit.changes)
    for mention in captured["expect"]["edit_mentions"]:
        assert mention in described
    assert "run_in_background" not in described  # a default filled in is no change
    assert replayed.lineages[1].edit == second.edit.changes


async def test_side_calls_are_trained_when_the_materializer_is_told_to() -> None:
    replayed = await replay(fixture("opencode_title"), MaterializerConfig(side_calls="train"))
    assert replayed.trained() == [True, True, True, True]
    assert replayed.reasons()[1] == "new conversation"


async def test_a_side_call_asked_for_training_is_trained() -> None:
    captured = fixture("opencode_title")
    captured["calls"][1]["headers"] = {"x-turnstile-train": "true"}
    replayed = await replay(captured)
    assert replayed.trained() == [True, True, True, True]
