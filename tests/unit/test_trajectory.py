"""The materialization math, checked against numbers worked out by hand."""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import replace

import pytest

from pipeline.materialize.trajectory import (
    Sample,
    Turn,
    apply_staleness,
    children,
    concat_samples,
    discounted_rewards,
    group_advantages,
    individual_samples,
    monte_carlo_returns,
    parents,
)
from schemas import ChatMessage, TurnCompleted, TurnReply, TurnRequest


def make(
    index: int,
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    logprobs: Sequence[float] | None = None,
    reward: float = 0.0,
    version: int = 0,
    episode: str = "e1",
) -> Turn:
    return Turn(
        turn_id=uuid.uuid4(),
        episode_id=episode,
        index=index,
        prompt_token_ids=tuple(prompt),
        completion_token_ids=tuple(completion),
        completion_logprobs=tuple(logprobs) if logprobs is not None else (-0.5,) * len(completion),
        policy_version=version,
        reward=reward,
    )


def event(text: str, prompt: list[int], completion: list[int]) -> TurnCompleted:
    return TurnCompleted(
        request=TurnRequest(messages=[ChatMessage(role="user", content=text)]),
        reply=TurnReply(text="ok", finish_reason="stop"),
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-0.25] * len(completion),
        policy_version=3,
        engine_id="test-engine",
    )


def sample(version: int) -> Sample:
    return Sample(
        sample_id=f"s{version}",
        episode_id="e1",
        turn_ids=(uuid.uuid4(),),
        input_ids=(1, 2),
        loss_mask=(0, 1),
        logprobs=(0.0, -0.5),
        policy_version=version,
        reward=1.0,
    )


# --- turns ---------------------------------------------------------------------------------------------


def test_turn_from_event_keeps_the_engine_tokens() -> None:
    completed = event("hi", [1, 2, 3], [4, 5])
    turn = Turn.from_event(completed, episode_id="e9", index=2, reward=0.5)
    assert turn.turn_id == completed.turn_id
    assert (turn.episode_id, turn.index, turn.policy_version, turn.reward) == ("e9", 2, 3, 0.5)
    assert turn.prompt_token_ids == (1, 2, 3)
    assert turn.completion_token_ids == (4, 5)
    assert turn.completion_logprobs == (-0.25, -0.25)


def test_turn_refuses_a_logprob_per_token_mismatch() -> None:
    with pytest.raises(ValueError, match="1 logprobs for 2 completion tokens"):
        make(0, [1], [2, 3], logprobs=[-0.5])


# --- tree ----------------------------------------------------------------------------------------------


def test_parents_follow_tokens_not_text_and_branch() -> None:
    # The messages' text says nothing of the relation; only the tokens do.
    root = Turn.from_event(event("solve x", [1, 2, 3], [4, 5]), episode_id="e1", index=0)
    left = Turn.from_event(event("unrelated words", [1, 2, 3, 4, 5, 6], [7]), episode_id="e1", index=1)
    right = Turn.from_event(event("other words", [1, 2, 3, 4, 5, 8, 9], [10]), episode_id="e1", index=2)
    tree = parents([root, left, right])
    assert tree == {root.turn_id: None, left.turn_id: root.turn_id, right.turn_id: root.turn_id}
    assert children(tree) == {
        root.turn_id: (left.turn_id, right.turn_id),
        left.turn_id: (),
        right.turn_id: (),
    }


def test_text_prefix_without_token_prefix_is_a_new_root() -> None:
    # The second request repeats the first conversation in text, but its tokens were re-made (5 became 55).
    first = Turn.from_event(event("hello", [1, 2, 3], [4, 5]), episode_id="e1", index=0)
    second = Turn.from_event(event("hello", [1, 2, 3, 4, 55, 6], [7]), episode_id="e1", index=1)
    assert parents([first, second]) == {first.turn_id: None, second.turn_id: None}


def test_parent_is_the_longest_prefix() -> None:
    # Both a ([1]+[2]) and b ([1,2,3]+[4]) start c's prompt; b's 4 tokens beat a's 2.
    a = make(0, [1], [2])
    b = make(1, [1, 2, 3], [4])
    c = make(2, [1, 2, 3, 4, 5], [6])
    assert parents([c, a, b]) == {a.turn_id: None, b.turn_id: a.turn_id, c.turn_id: b.turn_id}


def test_equal_prefixes_go_to_the_latest_turn() -> None:
    # A retried call with the same tokens: both qualify with 2 tokens, the later one (index 1) wins.
    first = make(0, [1], [2])
    retry = make(1, [1], [2])
    child = make(2, [1, 2, 3], [4])
    assert parents([first, retry, child])[child.turn_id] == retry.turn_id


def test_parents_stay_within_an_episode_and_the_past() -> None:
    elsewhere = make(0, [1], [2], episode="e0")
    later = make(5, [1], [2])
    early = make(1, [1, 2, 3], [4])
    assert parents([elsewhere, later, early])[early.turn_id] is None


# --- discounting ---------------------------------------------------------------------------------------


def chain(rewards: Sequence[float]) -> list[Turn]:
    """Turn k's prompt is all tokens so far; its completion is token 100 + k."""
    turns: list[Turn] = []
    tokens = [1]
    for k, reward in enumerate(rewards):
        turns.append(make(k, tokens, [100 + k], reward=reward))
        tokens = [*tokens, 100 + k, 200 + k]
    return turns


def test_discount_on_a_chain() -> None:
    a, b, c = chain([0.5, 0.0, 1.0])
    values = discounted_rewards([a, b, c], parents([a, b, c]), 0.9)
    assert values[c.turn_id] == pytest.approx(1.0)  # leaf: own reward
    assert values[b.turn_id] == pytest.approx(0.9)  # 0.0 + 0.9 * 1.0
    assert values[a.turn_id] == pytest.approx(1.31)  # 0.5 + 0.9 * 0.9 = 0.5 + 0.81
    assert list(values) == [a.turn_id, b.turn_id, c.turn_id]


def test_discount_on_a_chain_matches_monte_carlo_returns() -> None:
    turns = chain([0.5, 0.0, 1.0])
    values = discounted_rewards(turns, parents(turns), 0.9)
    assert list(values.values()) == pytest.approx(monte_carlo_returns([0.5, 0.0, 1.0], 0.9))


def test_discount_averages_the_children_at_a_branch() -> None:
    a = make(0, [1], [2], reward=0.2)
    b = make(1, [1, 2, 3], [4], reward=1.0)
    c = make(2, [1, 2, 5], [6], reward=0.0)
    d = make(3, [1, 2, 5, 6, 7], [8], reward=0.5)
    tree = parents([a, b, c, d])
    assert children(tree)[a.turn_id] == (b.turn_id, c.turn_id)
    values = discounted_rewards([a, b, c, d], tree, 0.9)
    assert values[d.turn_id] == pytest.approx(0.5)  # leaf
    assert values[c.turn_id] == pytest.approx(0.45)  # 0.0 + 0.9 * 0.5
    assert values[b.turn_id] == pytest.approx(1.0)  # leaf
    assert values[a.turn_id] == pytest.approx(0.8525)  # 0.2 + 0.9 * (1.0 + 0.45) / 2 = 0.2 + 0.6525


def test_monte_carlo_returns() -> None:
    assert monte_carlo_returns([1.0, 0.0, 2.0], 0.5) == pytest.approx([1.5, 1.0, 2.0])  # 2; 0+.5*2; 1+.5*1
    assert monte_carlo_returns([1.0, 0.0, 2.0], 0.0) == [1.0, 0.0, 2.0]  # gamma 0: each own reward
    assert monte_carlo_returns([], 0.9) == []


# --- samples -------------------------------------------------------------------------------------------


def test_individual_samples_mask_the_prompt() -> None:
    a = make(0, [1, 2], [3, 4], logprobs=[-0.25, -0.5], version=4)
    b = make(1, [1, 2, 3, 4, 9], [5], logprobs=[-0.125], version=5)
    values = {a.turn_id: 0.9, b.turn_id: 1.0}
    first, second = individual_samples([a, b], values)
    assert first.sample_id == str(a.turn_id)
    assert first.turn_ids == (a.turn_id,)
    assert first.input_ids == (1, 2, 3, 4)
    assert first.loss_mask == (0, 0, 1, 1)
    assert first.logprobs == (0.0, 0.0, -0.25, -0.5)
    assert (first.policy_version, first.reward, first.advantage, first.stale) == (4, 0.9, 0.0, False)
    assert second.input_ids == (1, 2, 3, 4, 9, 5)
    assert second.loss_mask == (0, 0, 0, 0, 0, 1)  # a's completion is b's prompt here: not trained twice
    assert (second.policy_version, second.reward) == (5, 1.0)


def test_concat_trains_only_the_model_tokens_of_a_tool_conversation() -> None:
    # a: prompt [1,2], says [3,4]; tool output [50,51]; b says [5]; user message [60]; c says [6,7].
    a = make(0, [1, 2], [3, 4], logprobs=[-0.25, -0.5], version=7, reward=0.0)
    b = make(1, [1, 2, 3, 4, 50, 51], [5], logprobs=[-0.125], version=6, reward=0.0)
    c = make(2, [1, 2, 3, 4, 50, 51, 5, 60], [6, 7], logprobs=[-1.0, -2.0], version=8, reward=1.0)
    tree = parents([a, b, c])
    values = discounted_rewards([a, b, c], tree, 0.9)
    [path] = concat_samples([a, b, c], tree, values)
    assert path.sample_id == f"{c.turn_id}:path"
    assert path.turn_ids == (a.turn_id, b.turn_id, c.turn_id)
    assert path.input_ids == (1, 2, 3, 4, 50, 51, 5, 60, 6, 7)
    assert path.loss_mask == (0, 0, 1, 1, 0, 0, 1, 0, 1, 1)
    assert path.logprobs == (0.0, 0.0, -0.25, -0.5, 0.0, 0.0, -0.125, 0.0, -1.0, -2.0)
    assert path.policy_version == 6  # min(7, 6, 8)
    assert path.reward == pytest.approx(0.81)  # the first turn's value: 0 + 0.9 * (0 + 0.9 * 1.0)


def test_concat_gives_one_sample_per_leaf_and_roots_a_non_prefix_turn() -> None:
    a = make(0, [1], [2], reward=0.2)
    b = make(1, [1, 2, 3], [4], reward=1.0)
    c = make(2, [1, 2, 5], [6], reward=0.0)
    fresh = make(3, [9, 9], [8], reward=0.5)  # starts over: no earlier turn is its prefix
    turns = [a, b, c, fresh]
    tree = parents(turns)
    values = discounted_rewards(turns, tree, 0.9)
    left, right, alone = concat_samples(turns, tree, values)
    assert left.turn_ids == (a.turn_id, b.turn_id)
    assert left.loss_mask == (0, 1, 0, 1)  # [1] prompt, [2] a's, [3] glue, [4] b's
    assert right.turn_ids == (a.turn_id, c.turn_id)
    assert right.input_ids == (1, 2, 5, 6)
    # Both share a's value: 0.2 + 0.9 * (1.0 + 0.0) / 2 = 0.2 + 0.45
    assert left.reward == right.reward == pytest.approx(0.65)
    assert alone.turn_ids == (fresh.turn_id,)
    assert (alone.input_ids, alone.loss_mask, alone.reward) == ((9, 9, 8), (0, 0, 1), 0.5)


def test_concat_refuses_parents_that_are_not_token_prefixes() -> None:
    a = make(0, [1], [2])
    b = make(1, [7, 8], [9])
    values = {a.turn_id: 0.0, b.turn_id: 0.0}
    with pytest.raises(ValueError, match="token for token"):
        concat_samples([a, b], {a.turn_id: None, b.turn_id: a.turn_id}, values)


# --- advantages and staleness --------------------------------------------------------------------------


def test_grpo_advantages_use_the_population_std() -> None:
    # mean = 1/4 = 0.25; deviations 0.75, -0.25 x3; variance = (0.5625 + 3 * 0.0625) / 4 = 0.1875;
    # std = sqrt(0.1875) = sqrt(3) / 4 = 0.4330; 0.75 / 0.4330 = sqrt(3); -0.25 / 0.4330 = -1 / sqrt(3).
    # (The n - 1 std would be sqrt(0.25) = 0.5, giving 1.5 and -0.5.)
    advantages = group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0)
    low = -1 / math.sqrt(3)
    assert advantages == pytest.approx([math.sqrt(3), low, low, low])
    with_eps = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert with_eps[0] == pytest.approx(0.75 / (math.sqrt(0.1875) + 1e-6), abs=1e-12)
    assert with_eps[0] < math.sqrt(3)


def test_mean_advantages_only_subtract_the_mean() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 0.0], mode="mean") == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_advantages_of_tiny_or_uniform_groups_are_zero() -> None:
    assert group_advantages([]) == []
    assert group_advantages([0.7]) == [0.0]
    assert group_advantages([0.7], mode="mean") == [0.0]
    assert group_advantages([2.0, 2.0, 2.0]) == [0.0, 0.0, 0.0]  # (2 - 2) / (0 + eps)


def test_staleness_drops_samples_older_than_the_window() -> None:
    samples = [sample(5), sample(3), sample(2)]
    kept = apply_staleness(samples, 5, 2, "drop")  # oldest allowed: 5 - 2 = 3
    assert [s.policy_version for s in kept] == [5, 3]


def test_staleness_flags_samples_older_than_the_window() -> None:
    samples = [sample(5), sample(3), sample(2)]
    flagged = apply_staleness(samples, 5, 2, "flag")
    assert [(s.policy_version, s.stale) for s in flagged] == [(5, False), (3, False), (2, True)]
    assert samples[2].stale is False  # the input is left as it was


def test_staleness_refuses_a_negative_window() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        apply_staleness([sample(1)], 1, -1, "drop")


# --- edges ---------------------------------------------------------------------------------------------


def test_empty_input_gives_empty_output() -> None:
    assert parents([]) == {}
    assert children({}) == {}
    assert discounted_rewards([], {}, 0.9) == {}
    assert individual_samples([], {}) == []
    assert concat_samples([], {}, {}) == []
    assert apply_staleness([], 3, 0, "flag") == []


def test_a_single_turn_is_a_root_leaf_and_one_sample_each_way() -> None:
    only = make(0, [1, 2], [3], logprobs=[-0.5], reward=0.4, version=2)
    tree = parents([only])
    assert tree == {only.turn_id: None}
    values = discounted_rewards([only], tree, 0.9)
    assert values == {only.turn_id: pytest.approx(0.4)}  # no child: 0.4 + 0.9 * 0
    [single] = individual_samples([only], values)
    [path] = concat_samples([only], tree, values)
    assert single.sample_id != path.sample_id
    for made in (single, path):
        assert (made.input_ids, made.loss_mask, made.logprobs) == ((1, 2, 3), (0, 0, 1), (0.0, 0.0, -0.5))
        assert made.policy_version == 2
        assert made.reward == pytest.approx(0.4)


def test_a_group_of_two_is_compared_within_itself() -> None:
    # rewards 1 and 0: mean 0.5, population std 0.5, so GRPO gives +-0.5 / (0.5 + 1e-6) and "mean" gives +-0.5
    assert group_advantages([1.0, 0.0]) == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)])
    assert group_advantages([1.0, 0.0], mode="mean") == [0.5, -0.5]
    assert group_advantages([0.7]) == [0.0]
    with pytest.raises(ValueError, match="unknown advantage mode 'best'"):
        group_advantages([1.0, 0.0], mode="best")  # type: ignore[arg-type]


def test_samples_carry_their_episode_and_the_oldest_policy_version_of_their_path() -> None:
    first = make(0, [1, 2], [3, 4], version=2, episode="ep-7")
    second = make(1, [1, 2, 3, 4, 5], [6], version=3, episode="ep-7")
    tree = parents([first, second])
    values = {first.turn_id: 1.0, second.turn_id: 1.0}
    assert [s.episode_id for s in individual_samples([first, second], values)] == ["ep-7", "ep-7"]
    (path,) = concat_samples([first, second], tree, values)
    assert (path.episode_id, path.policy_version) == ("ep-7", 2)


def test_a_named_parent_is_taken_unless_a_longer_earlier_turn_also_begins_the_prompt() -> None:
    """``Turn.extends`` (a recorded delta's parent) spares the token comparisons with shorter turns; the tree
    is still the token-level one: a longer earlier turn that begins the prompt wins over the named one."""
    root = make(0, [1, 2], [3])
    side = make(1, [1, 2, 3, 4], [5])  # extends root; its tokens begin `later`'s prompt
    later = replace(make(2, [1, 2, 3, 4, 5, 6], [7]), extends=root.turn_id)
    chained = replace(make(3, [1, 2, 3, 4, 5, 6, 7, 8], [9]), extends=later.turn_id)
    tree = parents([root, side, later, chained])
    assert tree == {root.turn_id: None, side.turn_id: root.turn_id, later.turn_id: side.turn_id,
                    chained.turn_id: later.turn_id}  # fmt: skip
    # the same turns without names give the same tree, token by token
    plain = [replace(t, extends=None) for t in (root, side, later, chained)]
    assert parents(plain) == tree
