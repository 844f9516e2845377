"""An episode as a transcript for the terminal: messages turn by turn, tokens shaded by logprob."""

from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.style import Style
from rich.text import Text

from pipeline.errors import ConfigError
from pipeline.replay.lookup import ReplayedEpisode, mean_logprob, turn_values
from schemas import (
    ChatMessage,
    TurnCompleted,
)

SEPARATOR: Final = " · "
ROLE_STYLES: Final = {"system": "dim", "user": "bold cyan", "assistant": "bold green", "tool": "magenta"}


def short_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:.4g}"


def _indented(text: str) -> str:
    return text.replace("\n", "\n    ")


def _message_text(message: ChatMessage, *, label: str | None = None) -> Text:
    role = label or message.role
    if message.role == "tool":
        role = f"tool {message.name or ''}".rstrip() + (
            f" ({message.tool_call_id})" if message.tool_call_id else ""
        )
    text = Text.assemble((f"{role}:", ROLE_STYLES.get(message.role, "")))
    if message.content or not message.tool_calls:
        text.append(" " + _indented(message.content or ""))
    for call in message.tool_calls or []:
        text.append("\n  ↳ tool call ", style="yellow")
        text.append(f"{call.function.name} {call.function.arguments}", style="yellow")
        text.append(f" (id {call.id})", style="dim")
    return text


def probability_style(logprob: float) -> Style:
    """Green for likely tokens through yellow to red for unlikely ones (by probability)."""
    p = min(1.0, max(0.0, math.exp(logprob)))
    red = round(255 * min(1.0, 2 * (1 - p)))
    green = round(200 * min(1.0, 2 * p))
    return Style(color="black", bgcolor=f"rgb({red},{green},0)")


def token_text(token_ids: Sequence[int], logprobs: Sequence[float], tokenizer: Any | None = None) -> Text:
    """Completion tokens shaded by logprob: ids separated by spaces, or, with a tokenizer, decoded texts."""
    text = Text()
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        if tokenizer is None:
            if position:
                text.append(" ")
            text.append(str(token_id), style=probability_style(logprob))
        else:
            piece = str(tokenizer.decode([token_id])).replace("\n", "\\n").replace("\t", "\\t")
            text.append(piece or "∅", style=probability_style(logprob))
    return text


def load_tokenizer(directory: Path) -> Any:
    """A local Hugging Face tokenizer (e.g. from ``turnstile model init-tiny``), for ``--tokens --model``."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            "--model needs the transformers package: pip install 'turnstile-rl[torch]'"
        ) from None
    if not directory.is_dir():
        raise ConfigError(f"--model {str(directory)!r} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"--model {str(directory)!r}: no tokenizer could be loaded there ({error})"
        ) from None


def _new_messages(turn: TurnCompleted, by_id: Mapping[uuid.UUID, TurnCompleted]) -> list[ChatMessage]:
    """The messages this turn added to its parent's conversation and reply (all of them for a root)."""
    parent = by_id.get(turn.parent_turn_id) if turn.parent_turn_id else None
    if parent is None:
        return list(turn.request.messages)
    return list(turn.request.messages[len(parent.request.messages) + 1 :])


def clock_time(moment: dt.datetime | None) -> str:
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S") if moment else "?"


def render_transcript(
    replayed: ReplayedEpisode, *, discount: float = 1.0, tokens: bool = False, tokenizer: Any | None = None
) -> RenderableType:
    """A readable transcript: the episode's header, then each turn's new messages, reply and numbers."""
    episode = replayed.episode
    started = episode.started
    values = turn_values(episode, discount)
    parts: list[RenderableType] = []
    parts.append(Text.assemble(("Episode ", "bold"), (episode.episode_id, "bold")))
    about = [f"task {started.task_id or '-'}", f"agent {started.agent or '-'}", f"policy {started.policy}"]
    if started.group_id:
        about.append(f"group {started.group_id} ({started.group_size})")
    if started.retry_of:
        about.append(f"retry of {started.retry_of}")
    sampling = started.sampling.model_dump(exclude_defaults=True)
    if sampling:
        about.append(f"sampling {json.dumps(sampling)}")
    if started.tags:
        about.append(f"tags {json.dumps(started.tags)}")
    parts.append(Text(SEPARATOR.join(about)))
    status = [f"started {clock_time(replayed.recorded_at(started))}", replayed.status]
    duration = episode.finished.metrics.get("duration_s") if episode.finished is not None else None
    if duration is not None:
        status[-1] += f" after {duration:.2f} s"
    status.append(f"{len(episode.turns)} turn{'' if len(episode.turns) == 1 else 's'}")
    if episode.rewards:
        sources = ", ".join(sorted({reward.source for reward in episode.rewards}))
        status.append(f"reward {short_number(episode.total_reward)} ({sources})")
    parts.append(Text(SEPARATOR.join(status)))
    by_id = {turn.turn_id: turn for turn in episode.turns}
    index_of = {turn.turn_id: index + 1 for index, turn in enumerate(episode.turns)}
    delivered_later = replayed.delivered_later
    shown_tools: list[Any] = []
    for index, turn in enumerate(episode.turns):
        title = [f"Turn {index + 1} of {replayed.recorded_turns}", str(turn.turn_id)[:8]]
        parent_index = index_of.get(turn.parent_turn_id) if turn.parent_turn_id else None
        if parent_index is not None:
            title.append(f"continues turn {parent_index}")
        if turn.prefix_break:
            title.append("prefix break")
        if turn.edit is not None:
            edited = index_of.get(turn.edit.turn_id)
            title.append(f"edit of turn {edited}" if edited else "edit")
        if turn.delivered is False and turn.turn_id not in delivered_later:
            title.append("not delivered")
        if turn.model:
            title.append(f"model {turn.model}")
        parts.append(Rule(SEPARATOR.join(title), align="left"))
        if turn.edit is not None:
            for change in turn.edit.changes:
                parts.append(Text(f"edited: {change}", style="yellow"))
        for message in _new_messages(turn, by_id):
            parts.append(_message_text(message))
        if turn.request.tools != shown_tools:
            names = ", ".join(tool.function.name for tool in turn.request.tools) or "none"
            parts.append(Text(f"tools: {names}", style="dim"))
            shown_tools = list(turn.request.tools)
        reply = ChatMessage(
            role="assistant", content=turn.reply.text, tool_calls=turn.reply.tool_calls or None
        )
        parts.append(_message_text(reply, label="reply"))
        if tokens:
            parts.append(Text("completion tokens: ", style="dim") + token_text(
                turn.completion_token_ids, turn.completion_logprobs, tokenizer
            ))  # fmt: skip
        mean = mean_logprob(turn)
        returned = "?" if values.returns is None else short_number(round(values.returns[index], 6))
        timings = turn.timings
        numbers = [
            f"finish {turn.reply.finish_reason}",
            f"tokens {len(turn.prompt_token_ids)} prompt + {len(turn.completion_token_ids)} completion",
            f"mean logprob {'-' if mean is None else f'{mean:.3f}'}",
            f"reward {short_number(values.rewards[index])}",
            f"return {returned}",
        ]
        engine = [
            f"policy v{turn.policy_version}",
            f"consumer {turn.engine_id}",
            f"{timings.total_ms:.1f} ms (queued {timings.queued_ms:.1f}, "
            f"first token {timings.first_token_ms:.1f})",
        ]
        if timings.restarted_ms:
            engine.append(f"restarted after {timings.restarted_ms:.1f} ms on an older version")
        parts.append(Text(SEPARATOR.join(numbers), style="dim"))
        parts.append(Text(SEPARATOR.join(engine), style="dim"))
    if tokens:
        legend = Text("shading: probability 1 ", style="dim")
        for probability in (1.0, 0.75, 0.5, 0.25, 0.0):
            legend.append("  ", style=probability_style(math.log(probability) if probability else -100.0))
        parts.append(legend + Text(" 0", style="dim"))
    if episode.finished is not None and episode.finished.error:
        parts.append(Rule("error", align="left", style="red"))
        parts.append(Text(episode.finished.error.rstrip(), style="red"))
    return Group(*parts)
