"""Episodes: one agent run, recorded as the ``episode-<id>`` stream of the log.

An ``EpisodeSession`` opens the stream (EpisodeStarted), sends each LLM call of the agent to the inference
consumers, appends the turn (TurnCompleted, with the engine's tokens) and only then hands the reply to the
agent; it records rewards and closes the stream (EpisodeFinished). ``EpisodeLLM`` is the session as the
agent sees it (``llm.chat``, ``llm.reward``, ``llm.openai()``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeGuard, TypeVar

import jsonschema
from pydantic import ValidationError

from pipeline.episodes.contexts import TurnContext, recorded_context, recorded_reply
from pipeline.episodes.fold import Episode, fold_episode
from pipeline.episodes.lineage import reply_changes, restored_call, schemas_by_name
from pipeline.episodes.openai_client import episode_openai_client
from pipeline.episodes.refusals import InvalidLLMCall, MaxTurnsExceeded
from pipeline.episodes.reply import ChatReply
from pipeline.errors import EpisodeExists, TurnstileError, WrongExpectedVersion, describe_validation_error
from pipeline.inference import InferenceError, LLMClient, PrefixUnknown
from pipeline.log import AppendResult, RecordedEvent, Store
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMRequest,
    LLMResponse,
    RewardAssigned,
    SamplingParams,
    Termination,
    TokenPrefix,
    ToolCall,
    ToolChoice,
    ToolSpec,
    TurnCompleted,
    TurnDelivered,
    TurnEdit,
    TurnReply,
    TurnRequest,
    default_sampling,
    new_uuid,
)

if TYPE_CHECKING:
    from openai import AsyncOpenAI

EPISODE_NAMESPACE: Final = uuid.UUID("6c1f4a57-1d0e-4a8e-9f55-3b8f0f5a7e21")
RUNNER_METADATA: Final = "runner"
RESTORED_KEPT: Final = 4096
"""Assistant messages whose form-restored copy is remembered (by identity: the gateway's parse memo hands
back the same objects for the history a client sends again, so each is restored once)."""
T = TypeVar("T")


def episode_stream(episode_id: str) -> str:
    return f"episode-{episode_id}"


def slot_episode_id(group_id: str, slot: int, attempt: int) -> str:
    """The id of attempt ``attempt`` at slot ``slot`` of a task group: the same on every runner, so a
    redelivered task finds the episodes its first runner left behind."""
    return uuid.uuid5(EPISODE_NAMESPACE, f"{group_id}/{slot}/{attempt}").hex


class EpisodeSession:
    """One episode's stream. ``await session.start()``, ``await session.chat(...)`` per LLM call,
    ``await session.reward(...)``, ``await session.finish(...)``."""

    def __init__(
        self,
        store: Store,
        llm: LLMClient,
        *,
        policy: str,
        task: Mapping[str, Any] | None = None,
        task_id: str = "",
        agent: str = "",
        episode_id: str | None = None,
        group_id: str | None = None,
        group_size: int = 1,
        sampling: SamplingParams | None = None,
        tags: Mapping[str, str] | None = None,
        retry_of: str | None = None,
        max_turns: int | None = None,
        runner_id: str | None = None,
    ) -> None:
        self.store = store
        self.client = llm
        self.episode_id = episode_id or new_uuid().hex
        self.stream = episode_stream(self.episode_id)
        self.max_turns = max_turns
        self.runner_id = runner_id
        self.started = EpisodeStarted(
            episode_id=self.episode_id,
            task=dict(task or {}),
            task_id=task_id,
            group_id=group_id,
            group_size=group_size,
            agent=agent,
            policy=policy,
            sampling=sampling or default_sampling(),
            tags=dict(tags or {}),
            retry_of=retry_of,
        )
        self.events: list[Event] = []
        self.turns: list[ChatReply] = []
        self.max_turns_hit = False
        self.llm_seconds = 0.0
        self._contexts: list[TurnContext] = []
        self._version = 0
        self._lock = asyncio.Lock()
        self._interrupted: frozenset[uuid.UUID] = frozenset()
        """The event ids of an append whose caller was cancelled in flight: it may land yet, or have landed
        (``_append``)."""
        self._started_at = time.monotonic()
        self._calls = 0
        self._sampling_defaults = self.started.sampling.model_dump()
        self._minted: dict[str, tuple[uuid.UUID, ToolCall]] = {}
        """Tool call id -> the turn that made it and the call as recorded (``pipeline.episodes.lineage``)."""
        self._restored: OrderedDict[int, tuple[ChatMessage, ChatMessage]] = OrderedDict()
        self._last_restore: tuple[list[ChatMessage], list[ChatMessage]] = ([], [])
        """The messages the latest call sent, and as restored (the next call's history, mostly)."""
        self._awaiting: set[uuid.UUID] = set()
        """Turns recorded as not yet delivered (``TurnCompleted.delivered`` False)."""
        self._delivered: list[uuid.UUID] = []
        """Turns handed to a live client since the last append, recorded with the next (``TurnDelivered``)."""
        self.shared = False
        """The stream is written by other sessions too (gateway replicas, ``from_log``): a lost append whose
        stream moved on by deliveries only is made again (``_may_append_again``)."""

    @classmethod
    def like(
        cls,
        started: EpisodeStarted,
        store: Store,
        llm: LLMClient,
        *,
        max_turns: int | None = None,
        runner_id: str | None = None,
    ) -> EpisodeSession:
        """A session (not started) for the episode ``started`` describes: its policy, task, agent, ids,
        group, sampling, tags and retry (a replica catching up, a rerun of the recording)."""
        return cls(
            store,
            llm,
            policy=started.policy,
            task=started.task,
            task_id=started.task_id,
            agent=started.agent,
            episode_id=started.episode_id,
            group_id=started.group_id,
            group_size=started.group_size,
            sampling=started.sampling,
            tags=started.tags,
            retry_of=started.retry_of,
            max_turns=max_turns,
            runner_id=runner_id,
        )

    @classmethod
    def from_log(
        cls,
        store: Store,
        llm: LLMClient,
        recorded: Sequence[RecordedEvent],
        *,
        max_turns: int | None = None,
        runner_id: str | None = None,
    ) -> EpisodeSession:
        """The session of an episode recorded elsewhere (another gateway replica), from its stream as read:
        what a call needs to continue it (its turns as conversations that later turns extend token-exactly,
        the tool calls it made, its version for the next append) is rebuilt from the events themselves."""
        if not recorded or not isinstance(recorded[0].event, EpisodeStarted):
            raise TurnstileError(
                f"{recorded[0].stream if recorded else 'the stream'} holds no EpisodeStarted"
            )
        started = recorded[0].event
        session = cls.like(started, store, llm, max_turns=max_turns, runner_id=runner_id)
        session.started = started
        session.shared = True
        session._started_at -= max(0.0, time.time() - recorded[0].recorded_at.timestamp())
        session._apply(recorded)
        return session

    async def refresh(self) -> None:
        """Catch up with what others appended to the stream since this session last wrote or read it (one
        read of the events after its version, usually none): gateway replicas serve one session in turns."""
        async with self._lock:
            self._apply(await self.store.read_stream(self.stream, after_version=self._version))

    def _apply(self, recorded: Sequence[RecordedEvent]) -> None:
        """Take in events recorded by another writer, in stream order, as if this session had written them."""
        by_id = {context.turn.turn_id: context for context in self._contexts}
        for record in recorded:
            if record.version <= self._version:
                continue
            self._version = record.version
            event = record.event
            if event is None:
                continue  # a type this reader does not know: kept in the log, nothing to continue from
            self.events.append(event)
            if isinstance(event, TurnDelivered):
                self._awaiting.difference_update(event.turn_ids)
                recorded_now = set(event.turn_ids)  # noted here and recorded by an interrupted append
                self._delivered = [turn_id for turn_id in self._delivered if turn_id not in recorded_now]
            elif isinstance(event, TurnCompleted):
                context = recorded_context(event, by_id.get(event.parent_turn_id or uuid.UUID(int=0)))
                by_id[event.turn_id] = context
                self._contexts.append(context)
                self.turns.append(recorded_reply(context))
                self._minted.update((call.id, (event.turn_id, call)) for call in event.reply.tool_calls)
                self._calls += 1
                if event.delivered is False:
                    self._awaiting.add(event.turn_id)

    def undelivered_turn(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> ChatReply | None:
        """The recorded turn, still awaiting delivery, whose conversation is exactly ``messages`` and
        ``tools``: a call retried after the gateway that recorded it stopped before handing the reply over
        (answered from this turn, not generated and recorded again)."""
        if not self._awaiting:
            return None
        for context, reply in zip(reversed(self._contexts), reversed(self.turns), strict=False):
            if (
                context.turn.turn_id in self._awaiting
                and context.tools == list(tools)
                and len(context.messages) == len(messages)
                and all(map(same_message, messages, context.messages))
            ):
                return reply
        return None

    @property
    def policy(self) -> str:
        return self.started.policy

    @property
    def finished(self) -> bool:
        return bool(self.events) and isinstance(self.events[-1], EpisodeFinished)

    def episode(self) -> Episode:
        return fold_episode(self.events)

    @property
    def llm(self) -> EpisodeLLM:
        return EpisodeLLM(self)

    async def start(self) -> None:
        self._started_at = time.monotonic()
        try:
            await self._append([self.started])
        except WrongExpectedVersion as error:  # the stream is taken: another episode has this id
            raise EpisodeExists(self.episode_id, self.stream, error.actual) from None

    async def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        tools: Sequence[ToolSpec | Mapping[str, Any]] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        tool_choice: ToolChoice | None = None,
        top_logprobs: int | None = None,
        listening: Callable[[], Awaitable[bool]] | None = None,
        train: bool | None = None,
        model: str | None = None,
        confirm_delivery: bool = False,
    ) -> ChatReply:
        """One LLM turn: the request goes to inference, the turn is recorded, then the reply returns.

        ``top_logprobs`` (0-20): the reply carries each completion token's text and bytes and its most
        likely alternatives (``ChatReply.token_logprobs``, ``top_logprobs``); they are not recorded.
        ``listening``: asked once the reply is generated; False records the turn as never delivered (the
        gateway's client disconnected). ``train`` False records the turn as not for training, True as asked
        for training, None leaves it to the materializer's lineage rule (``TurnCompleted.train``: side calls;
        see ``pipeline.materialize.lineages``). ``model``: the model name the client asked for, recorded.
        ``confirm_delivery``: the turn is recorded as not delivered, until ``mark_delivered`` says the reply
        reached a live client (the gateway: a reply is delivered only once it is handed over)."""
        if self.finished:
            raise TurnstileError(f"episode {self.episode_id} is finished; start a new episode")
        if self.max_turns is not None and self._calls >= self.max_turns:
            self.max_turns_hit = True
            raise MaxTurnsExceeded(self.max_turns)
        self._calls += 1
        request, parent, shared = self._request(messages, tools, sampling, tool_choice, top_logprobs)
        edit = self._edit_of(request) if parent is None and self._contexts else None
        began = time.monotonic()
        response = await self._call(request, parent)
        self.llm_seconds += time.monotonic() - began
        taken = response.prompt_prefix_tokens
        if taken not in (0, parent.length if parent is not None else 0):
            raise InferenceError(
                f"inference consumer {response.consumer_id} answered with a prompt prefix of {taken} tokens; "
                f"the request's was {parent.length if parent is not None else 0}"
            )
        delivered = None if listening is None or await listening() else False
        if confirm_delivery:
            delivered = False
        turn = turn_event(
            request,
            response,
            parent.turn if parent else None,
            shared,
            delivered=delivered,
            train=train,
            model=model,
            edit=edit,
        )
        if confirm_delivery:
            self._awaiting.add(turn.turn_id)
        await self._append([turn])
        self._minted.update((call.id, (turn.turn_id, call)) for call in response.tool_calls)
        context = TurnContext(
            turn=turn,
            messages=request.messages,
            tools=request.tools,
            reply=ChatMessage(
                role="assistant",
                content=response.text,
                tool_calls=response.tool_calls or None,
                reasoning_content=response.reasoning,
            ),
            parent=parent if taken else None,
            length=taken + len(response.prompt_token_ids) + len(response.completion_token_ids),
            tokens_key=response.tokens_key,
        )
        reply = ChatReply(
            turn_id=turn.turn_id,
            text=response.text,
            tool_calls=response.tool_calls,
            finish_reason=response.finish_reason,
            prompt_ids=context.prompt_ids,
            completion_token_ids=response.completion_token_ids,
            completion_logprobs=response.completion_logprobs,
            policy_version=response.policy_version,
            token_logprobs=response.token_logprobs,
            top_logprobs=response.top_logprobs,
            reasoning=response.reasoning,
            parent_turn_id=turn.parent_turn_id,
            prefix_tokens=taken,
            added_prompt_ids=response.prompt_token_ids,
        )
        self.turns.append(reply)
        self._contexts.append(context)
        return reply

    def mark_delivered(self, turn_ids: Sequence[uuid.UUID]) -> None:
        """The replies of ``turn_ids`` were handed to a live client: recorded (``TurnDelivered``) with the
        session's next append (its next turn, a reward or its end), so delivery costs no append of its own.
        Turns not awaiting delivery (delivered already, or not recorded so) are ignored."""
        for turn_id in turn_ids:
            if turn_id in self._awaiting:
                self._awaiting.discard(turn_id)
                self._delivered.append(turn_id)

    def conversation_of(self, turn_id: uuid.UUID) -> list[ChatMessage] | None:
        """A recorded turn of this session as a whole conversation: its messages, then its reply (what a
        turn that continues it begins with); None when the session recorded no such turn."""
        for context in reversed(self._contexts):
            if context.turn.turn_id == turn_id:
                return [*context.messages, context.reply]
        return None

    async def _call(self, request: LLMRequest, parent: TurnContext | None) -> LLMResponse:
        """Send the request: continuing a turn, by naming the tokens its consumer holds (only the new
        messages travel), else, or when that consumer does not hold them, with the tokens themselves."""
        if parent is None:
            return await self.client(request)
        count = len(parent.messages) + 1
        if parent.tokens_key is not None:
            held = request.model_copy(
                update={
                    "messages": request.messages[count:],
                    "tools": [],
                    "prefix": TokenPrefix(
                        key=parent.tokens_key, token_count=parent.length, message_count=count
                    ),
                }
            )
            try:
                return await self.client(held)
            except PrefixUnknown:
                pass  # evicted, another consumer, a restart: send everything
        whole = TokenPrefix(token_ids=parent.token_ids(), message_count=count)
        return await self.client(request.model_copy(update={"prefix": whole, "request_id": new_uuid()}))

    async def reward(
        self, value: float, turn_id: uuid.UUID | str | None = None, source: str = "agent"
    ) -> None:
        await self._append([self.reward_event(value, turn_id, source)])

    def reward_event(
        self, value: float, turn_id: uuid.UUID | str | None = None, source: str = "agent"
    ) -> RewardAssigned:
        """A reward for the episode or one of its turns, checked (``InvalidLLMCall``), not yet recorded."""
        if turn_id is not None and not isinstance(turn_id, uuid.UUID):
            try:
                turn_id = uuid.UUID(str(turn_id))
            except ValueError:
                raise InvalidLLMCall(f"reward for turn {turn_id!r}: not a turn id (a UUID)") from None
        if turn_id is not None and turn_id not in {turn.turn_id for turn in self.turns}:
            raise InvalidLLMCall(f"reward for turn {turn_id}: no such turn in episode {self.episode_id}")
        try:
            return RewardAssigned(turn_id=turn_id, value=value, source=source)
        except ValidationError as error:
            raise InvalidLLMCall(f"reward {value!r}: {describe_validation_error(error)}") from None

    async def finish(
        self,
        termination: Termination,
        *,
        error: str | None = None,
        metrics: Mapping[str, float] | None = None,
        rewards: Sequence[RewardAssigned] = (),
    ) -> None:
        """Close the stream, after ``rewards`` (``reward_event``s) in the same append: an episode's closing
        rewards and its end are recorded together (and an append less each episode). An append whose caller
        was cancelled in flight (a turn whose agent was cancelled) is either recorded before the end, which
        then follows it, or refused because the end came first; if it closed the stream already (a finish
        that was cancelled while appending), that one stands (``_append``)."""
        if self.finished:
            return
        # From the recorded events as they are, not the fold, which makes every turn whole (copies of each
        # prompt: ~8% of the runner's CPU in bench/episodes.py). A whole turn's prompt is the ids it takes
        # from its parent (prefix_tokens) and its own.
        turns = [event for event in self.events if isinstance(event, TurnCompleted)]
        summary = {
            "turns": float(len(turns)),
            "prompt_tokens": float(sum(t.prefix_tokens + len(t.prompt_token_ids) for t in turns)),
            "completion_tokens": float(sum(len(t.completion_token_ids) for t in turns)),
            "reward": sum(
                event.value for event in [*self.events, *rewards] if isinstance(event, RewardAssigned)
            ),
            "duration_s": round(time.monotonic() - self._started_at, 6),
            "llm_s": round(self.llm_seconds, 6),
        }
        summary.update(metrics or {})
        await self._append([*rewards, EpisodeFinished(termination=termination, metrics=summary, error=error)])

    def _request(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        tools: Sequence[ToolSpec | Mapping[str, Any]] | None,
        sampling: SamplingParams | Mapping[str, Any] | None,
        tool_choice: ToolChoice | None = None,
        top_logprobs: int | None = None,
    ) -> tuple[LLMRequest, TurnContext | None, int]:
        """The request, the recorded turn it continues (if any) and how many of its leading messages are
        that turn's conversation and reply (recorded there, not again)."""
        if isinstance(sampling, SamplingParams):
            sampling = sampling.model_dump()
        try:
            chosen = (  # the episode's own, validated when it started, unless the call changes it
                SamplingParams.model_validate({**self._sampling_defaults, **sampling})
                if sampling
                else self.started.sampling
            )
            request = self._new_request(messages, tools or [], chosen, tool_choice, top_logprobs)
        except ValidationError as error:
            raise InvalidLLMCall(
                f"llm.chat: {describe_validation_error(error)}; messages are OpenAI-style chat messages "
                "({'role': 'user', 'content': '...'}), tools OpenAI function tools, sampling keywords "
                f"are {', '.join(SamplingParams.model_fields)}"
            ) from None
        check_tool_schemas(request.tools)
        request = self._restore_form(request)
        parent = self._parent(request)
        shared = shared_messages(request.messages, [*parent.messages, parent.reply]) if parent else 0
        # Only what the turn records is checked: the shared messages are its parent's, checked then.
        for index, message in enumerate(request.messages[shared:], start=shared):
            if "\x00" in (message.content or ""):
                raise InvalidLLMCall(
                    f"llm.chat: messages.{index}.content holds a NUL character (\\x00), which the event log "
                    "(PostgreSQL jsonb) cannot store; remove or replace it"
                )
        return request, parent, shared

    def _new_request(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        tools: Sequence[ToolSpec | Mapping[str, Any]],
        sampling: SamplingParams,
        tool_choice: ToolChoice | None,
        top_logprobs: int | None,
    ) -> LLMRequest:
        """An ``LLMRequest``, validated once: parts that are models already (frozen, so valid; the agent's
        conversation is mostly the messages of earlier turns) are put together as they are, with no Python
        loop over the history; anything else (dicts, a top_logprobs to range-check) is validated."""
        if (
            messages
            and all_of(messages, ChatMessage)
            and all_of(tools, ToolSpec)
            and (tool_choice is None or type(tool_choice) is ToolChoice)
            and top_logprobs is None
        ):
            return LLMRequest.trusted(
                type="LLMRequest",
                schema_version=2,
                request_id=new_uuid(),
                policy=self.policy,
                episode_id=self.episode_id,
                messages=list(messages),
                tools=list(tools),
                sampling=sampling,
                prefix=None,
                tool_choice=tool_choice,
                top_logprobs=None,
            )
        return LLMRequest.model_validate(
            {
                "policy": self.policy,
                "episode_id": self.episode_id,
                "messages": list(messages),
                "tools": list(tools),
                "sampling": sampling,
                "tool_choice": tool_choice,
                "top_logprobs": top_logprobs,
            }
        )

    def _parent(self, request: LLMRequest) -> TurnContext | None:
        """The latest recorded turn whose conversation and reply begin this request's messages."""
        for context in reversed(self._contexts):
            count = len(context.messages)
            if (
                len(request.messages) > count
                and context.tools == request.tools
                and (  # the same objects, mostly: compared in C first
                    request.messages[:count] == context.messages
                    or all(map(same_message, request.messages[:count], context.messages))
                )
                and same_assistant_message(request.messages[count], context.reply)
            ):
                return context
        return None

    def _restore_form(self, request: LLMRequest) -> LLMRequest:
        """``request`` with every tool call this session made that came back changed in form only (schema
        defaults filled in, keys reordered, whitespace, number spelling) put back as recorded, so that the
        conversation continues its tokens (``pipeline.episodes.lineage``)."""
        if not self._minted:
            return request
        schemas: dict[str, Any] | None = None
        changed: list[ChatMessage] | None = None
        sent, restored_before = self._last_restore
        start = 0
        # The history the previous call sent (the same objects, mostly: compared in C) was restored then:
        # only what this call adds is looked at in Python.
        if sent and len(request.messages) >= len(sent) and request.messages[: len(sent)] == sent:
            start = len(sent)
            if restored_before is not sent:
                changed = [*restored_before, *request.messages[start:]]
        for index in range(start, len(request.messages)):
            message = request.messages[index]
            if not message.tool_calls:
                continue
            known = self._restored.get(id(message))
            if known is not None and known[0] is message:
                restored = known[1]
            else:
                if schemas is None:
                    schemas = schemas_by_name(request.tools)
                restored = self._restored_message(message, schemas)
                self._restored[id(message)] = (message, restored)
                if len(self._restored) > RESTORED_KEPT:
                    self._restored.popitem(last=False)
            if restored is not message:
                changed = changed if changed is not None else list(request.messages)
                changed[index] = restored
        self._last_restore = (request.messages, changed if changed is not None else request.messages)
        return request if changed is None else request.model_copy(update={"messages": changed})

    def _restored_message(self, message: ChatMessage, schemas: Mapping[str, Any]) -> ChatMessage:
        calls = message.tool_calls or []
        restored = []
        for call in calls:
            known = self._minted.get(call.id)
            same = restored_call(call, known[1], schemas) if known is not None else None
            restored.append(same if same is not None else call)
        if all(new is old for new, old in zip(restored, calls, strict=True)):
            return message
        return message.model_copy(update={"tool_calls": restored})

    def _edit_of(self, request: LLMRequest) -> TurnEdit | None:
        """The edit a new root carries: an earlier reply of this session sent back changed in substance (the
        latest turn whose conversation begins the request and whose reply comes back different, else any
        tool call this session made whose arguments came back different); None when there is none."""
        schemas = schemas_by_name(request.tools)
        sent = request.messages
        for context in reversed(self._contexts):
            count = len(context.messages)
            if (
                len(sent) > count
                and sent[count].role == "assistant"
                and (
                    sent[:count] == context.messages or all(map(same_message, sent[:count], context.messages))
                )
            ):
                changes = reply_changes(sent[count], context.reply, schemas)
                if changes:
                    return TurnEdit(turn_id=context.turn.turn_id, changes=changes)
                break
        edited: uuid.UUID | None = None
        changes = []
        for message in sent:
            for call in message.tool_calls or []:
                known = self._minted.get(call.id)
                if known is not None and (
                    found := reply_changes(
                        message.model_copy(update={"content": None, "tool_calls": [call]}),
                        ChatMessage(role="assistant", tool_calls=[known[1]]),
                        schemas,
                    )
                ):
                    edited = edited or known[0]
                    changes += found
        return TurnEdit(turn_id=edited, changes=changes) if edited is not None else None

    async def record_delivered(self) -> None:
        """Record the deliveries ``mark_delivered`` noted now, in an append of their own (gateway replicas:
        the session's next event may be written by another replica, which does not know of them)."""
        if self._delivered and not self.finished:
            await self._append([])

    async def _append(self, events: list[Event]) -> AppendResult | None:
        """Append ``events`` (after the deliveries noted since the last append) at the session's version,
        one append at a time.

        A caller cancelled while its append is in flight leaves the session unsure whether it landed: the
        store may still record it. The session's next append is then written at the version it knew; if the
        interrupted one landed first, that one is refused (``WrongExpectedVersion``), the session catches up
        with the log and writes it again after it; if this one lands first, the interrupted one is refused.
        Either way the stream stays whole, without a shielded task per append to carry one through a cancel
        (its cost: docs/benchmarks-gateway.md, "Appends in the caller's task")."""
        async with self._lock:
            caught_up = False
            while True:
                if caught_up and self.finished and events:  # closed by an interrupted finish, found since
                    return None
                written = (
                    [TurnDelivered(turn_ids=list(self._delivered)), *events] if self._delivered else events
                )
                if not written or (not events and self.finished):
                    return None  # deliveries only, and nothing left to record them in
                metadata = {RUNNER_METADATA: self.runner_id} if self.runner_id and not self._version else None
                try:
                    result = await self.store.append(self.stream, written, self._version, metadata=metadata)
                except asyncio.CancelledError:
                    self._interrupted = frozenset(event.event_id for event in written)
                    raise
                except WrongExpectedVersion:
                    if not await self._may_append_again(annotations_only=not events):
                        raise
                    caught_up = True
                    continue
                self._interrupted = frozenset()  # landed before an interrupted append, which is refused
                self._version = result.version
                self.events.extend(written)
                if isinstance(written[0], TurnDelivered):
                    del self._delivered[: len(written[0].turn_ids)]
                return result

    async def _may_append_again(self, *, annotations_only: bool) -> bool:
        """After a refused append: caught up with the stream, whether appending again at its new version is
        right. What moved may be this session's own append that was interrupted (``_interrupted``) and landed
        after all: taken in, and the write goes after it. Another gateway replica serving the session
        (``from_log``) may have recorded deliveries (``TurnDelivered``), which change no conversation: after
        them a turn is appended as it was. A delivery of this session's own (``annotations_only``) may go
        after anything but the end. Anything else (a turn, a reward, the end) moved the session on, and the
        write is refused."""
        interrupted, self._interrupted = self._interrupted, frozenset()
        if not self.shared and not interrupted:
            return False
        moved = await self.store.read_stream(self.stream, after_version=self._version)
        ours = bool(moved) and {record.event_id for record in moved} <= interrupted
        if not ours and not self.shared:
            return False
        self._apply(moved)
        if ours:
            return True
        if annotations_only:
            return not self.finished
        return bool(moved) and all(isinstance(record.event, TurnDelivered) for record in moved)


def all_of(items: Sequence[object], kind: type[T]) -> TypeGuard[Sequence[T]]:
    """Whether every item is exactly a ``kind`` (a set of their types: no Python loop over a history)."""
    return {*map(type, items)} <= {kind}


def turn_event(
    request: LLMRequest,
    response: LLMResponse,
    parent: TurnCompleted | None,
    shared: int,
    *,
    delivered: bool | None = None,
    train: bool | None = None,
    model: str | None = None,
    edit: TurnEdit | None = None,
) -> TurnCompleted:
    """The ``TurnCompleted`` of ``request`` answered by ``response``, continuing ``parent`` (whose
    conversation and reply are the request's first ``shared`` messages; ``response.prompt_prefix_tokens``
    ids are its tokens).

    Put together from parts validated already (the request when the call was made, the reply when it came
    off the wire), not validated again: a second validation of the token arrays would cost more than the
    rest of the turn's bookkeeping. What ``TurnCompleted``'s own checks would add is checked here; the rest
    holds by construction (tests/unit/test_session_logic.py compares this with the validated event field by
    field)."""
    if len(response.completion_logprobs) != len(response.completion_token_ids):
        raise InferenceError(
            f"inference consumer {response.consumer_id} answered {len(response.completion_logprobs)} "
            f"completion_logprobs for {len(response.completion_token_ids)} completion_token_ids: one "
            "logprob per completion token"
        )
    tools_from_parent = parent is not None and bool(request.tools)
    return TurnCompleted.trusted(
        type="TurnCompleted",
        schema_version=2,
        event_id=new_uuid(),
        turn_id=new_uuid(),
        parent_turn_id=parent.turn_id if parent else None,
        prefix_messages=shared,
        prefix_tokens=response.prompt_prefix_tokens,
        tools_from_parent=tools_from_parent,
        request=TurnRequest.trusted(
            messages=request.messages[shared:],
            tools=[] if tools_from_parent else request.tools,
            sampling=request.sampling,
            tool_choice=request.tool_choice,
        ),
        reply=TurnReply.trusted(
            text=response.text,
            tool_calls=response.tool_calls,
            finish_reason=response.finish_reason,
            reasoning=response.reasoning,
        ),
        prompt_token_ids=response.prompt_token_ids,
        completion_token_ids=response.completion_token_ids,
        completion_logprobs=response.completion_logprobs,
        policy_version=response.policy_version,
        engine_id=response.consumer_id,
        timings=response.timings,
        prefix_break=response.prefix_break,
        render_drift=response.render_drift,
        chat_template=response.chat_template,
        delivered=delivered,
        train=train,
        model=model,
        edit=edit,
    )


def shared_messages(sent: Sequence[ChatMessage], conversation: Sequence[ChatMessage]) -> int:
    """How many leading messages of ``sent`` are exactly the parent's ``conversation`` (its messages and
    reply): a turn records the rest. A reply sent back without its reasoning is recorded as it was sent."""
    limit = min(len(conversation), len(sent) - 1)  # a turn adds at least one message
    if sent[:limit] == conversation[:limit]:  # the usual case, compared in C (the same objects, mostly)
        return limit
    shared = 0
    while shared < limit and (sent[shared] is conversation[shared] or sent[shared] == conversation[shared]):
        shared += 1
    return shared


def same_message(sent: ChatMessage, recorded: ChatMessage) -> bool:
    """Whether an earlier message came back unchanged; an assistant's reasoning may be sent back or dropped
    (clients differ), as the continuation uses the recorded tokens either way."""
    if sent is recorded or sent == recorded:
        return True
    if sent.role == recorded.role == "assistant":
        return sent.model_copy(update={"reasoning_content": None}) == recorded.model_copy(
            update={"reasoning_content": None}
        )
    return sent == recorded


def same_assistant_message(sent: ChatMessage, reply: ChatMessage) -> bool:
    """Whether the agent sent back the reply it got (``content`` None and "" are the same)."""

    def calls(message: ChatMessage) -> list[tuple[str, str, str]]:
        return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]

    return (
        sent.role == "assistant"
        and (sent.content or "") == (reply.content or "")
        and calls(sent) == calls(reply)
    )


class EpisodeLLM:
    """The ``llm`` an agent gets: bound to its episode, every call recorded."""

    def __init__(self, session: EpisodeSession) -> None:
        self._session = session

    @property
    def episode_id(self) -> str:
        return self._session.episode_id

    @property
    def turns(self) -> list[ChatReply]:
        return self._session.turns

    async def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        tools: Sequence[ToolSpec | Mapping[str, Any]] | None = None,
        *,
        train: bool | None = None,
        **sampling: Any,
    ) -> ChatReply:
        """``await llm.chat(messages, tools=None, temperature=..., max_tokens=...)``; ``train=False``: a side
        call, recorded but not for training; ``True``: trained even where the lineage rule would call it a
        side call; None: the rule decides (``pipeline.materialize.lineages``)."""
        return await self._session.chat(messages, tools, sampling, train=train)

    async def reward(self, value: float, turn_id: uuid.UUID | str | None = None) -> None:
        """Record a reward now (for a turn, or the episode), besides what ``run`` returns."""
        await self._session.reward(value, turn_id)

    def openai(self) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` whose chat completions go through this episode, in process."""
        session = self._session
        return episode_openai_client(
            session.chat,
            episode_id=session.episode_id,
            policy=session.policy,
            defaults=session.started.sampling,
        )


def check_tool_schemas(tools: Sequence[ToolSpec]) -> None:
    """``InvalidLLMCall`` naming the tool whose ``parameters`` is not a valid JSON Schema (Draft 2020-12,
    what OpenAI and Anthropic take): it would be recorded, rendered into the prompt and trained on."""
    for index, tool in enumerate(tools):
        problem = _tool_problem(tool)
        if problem is not None:
            raise InvalidLLMCall(
                f"llm.chat: tools[{index}].function.parameters ({tool.function.name!r}) is not a valid JSON "
                f"Schema: {problem}",
                field=f"tools[{index}].function.parameters",
            )


_CHECKED: OrderedDict[int, tuple[ToolSpec, str | None]] = OrderedDict()
"""Tools checked lately, by identity: the gateway hands back the same objects for the tools a session
sends again (``ParseMemo``), so a call with ~20 large tools costs lookups, not a JSON dump of each schema."""
CHECKED_KEPT: Final = 4096


def _tool_problem(tool: ToolSpec) -> str | None:
    known = _CHECKED.get(id(tool))
    if known is not None and known[0] is tool:  # the tool is held here, so its id is not reused
        return known[1]
    problem = _schema_problem(json.dumps(tool.function.parameters, sort_keys=True))
    _CHECKED[id(tool)] = (tool, problem)
    if len(_CHECKED) > CHECKED_KEPT:
        _CHECKED.popitem(last=False)
    return problem


@functools.lru_cache(maxsize=4096)
def _schema_problem(schema: str) -> str | None:
    # Agents send the same tools on every call (Claude Code: ~20 large schemas): each is checked once.
    try:
        jsonschema.Draft202012Validator.check_schema(json.loads(schema))
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path) or "the top level"
        return f"at {where}: {error.message}"
    return None
