"""Episodes: a session records each LLM turn before the agent sees it; the fold of an episode's events, the
agent contract and run loop, the environment interface and runner leases."""

from pipeline.episodes.agent import Agent, AgentResult, FunctionAgent, RewardFunction, run_episode
from pipeline.episodes.environment import AgentEnvironment, TimeStep
from pipeline.episodes.fold import (
    Episode,
    EpisodeOutcome,
    UnfoldableTurn,
    expand_turn,
    expand_turns,
    fold_episode,
    turn_delta,
    whole_events,
)
from pipeline.episodes.leases import (
    RunnerLease,
    close_abandoned_episodes,
    find_abandoned_episodes,
    new_runner_id,
    recover_abandoned_episodes,
)
from pipeline.episodes.openai_client import chat_result, episode_openai_client, wanted_detail
from pipeline.episodes.refusals import InvalidLLMCall, MaxTurnsExceeded
from pipeline.episodes.reply import ChatReply
from pipeline.episodes.session import (
    RUNNER_METADATA,
    EpisodeLLM,
    EpisodeSession,
    episode_stream,
    same_assistant_message,
    slot_episode_id,
)

__all__ = [
    "RUNNER_METADATA",
    "Agent",
    "AgentEnvironment",
    "AgentResult",
    "ChatReply",
    "Episode",
    "EpisodeLLM",
    "EpisodeOutcome",
    "EpisodeSession",
    "FunctionAgent",
    "InvalidLLMCall",
    "MaxTurnsExceeded",
    "RewardFunction",
    "RunnerLease",
    "TimeStep",
    "UnfoldableTurn",
    "chat_result",
    "close_abandoned_episodes",
    "episode_openai_client",
    "episode_stream",
    "expand_turn",
    "expand_turns",
    "find_abandoned_episodes",
    "fold_episode",
    "new_runner_id",
    "recover_abandoned_episodes",
    "run_episode",
    "same_assistant_message",
    "slot_episode_id",
    "turn_delta",
    "wanted_detail",
    "whole_events",
]
