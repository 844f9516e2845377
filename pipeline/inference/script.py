"""A scripted policy: which reply a request gets, as data (rules matched on the request).

End-to-end tests of agent CLIs need a policy that does something on purpose (ask the agent to run a shell
command, then give a final answer), yet still returns what an engine returns. The torch backend does the
second part (``TorchBackend(script=...)``): it turns the reply text of the first matching rule into the
tokenizer's ids and scores them with the model's own forward pass (teacher forcing). This module is the first
part, pure: the file format, matching and the reply's text in the hermes form the chat template renders.

The script is data because each CLI names its shell tool differently (Claude Code ``Bash`` {"command"};
Codex ``shell`` / ``exec_command``; opencode ``bash`` {"command", "description"}). A file::

    {"rules": [
      {"name": "run", "when": {"tool": "Bash", "tool_result": false},
       "reply": {"content": "Writing it.",
                 "tool_calls": [{"name": "Bash", "arguments": {"command": "echo hi > out.txt"}}]}},
      {"name": "final", "when": {"tool_result": true}, "reply": {"content": "Done."}},
      {"name": "side call", "when": {}, "reply": {"content": "A title"}}
    ]}

Rules are tried in order; the first whose every condition holds answers. A request no rule matches is
refused (``RequestRejected`` naming ``messages``): the test sees which call the script did not foresee.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import ConfigError, describe_validation_error
from schemas import ChatMessage, LLMRequest, Role


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class When(_Strict):
    """Conditions on a request; all given ones must hold (none given: any request)."""

    tool: str | None = Field(default=None, description="a tool of this name is offered")
    tools: bool | None = Field(default=None, description="whether any tool is offered")
    last_role: Role | None = Field(
        default=None, description="the role of the last message that is not a system message"
    )
    tool_result: bool | None = Field(default=None, description="whether a tool result is in the conversation")
    contains: str | None = Field(
        default=None, description="the last message that is not a system message contains this text"
    )
    system_contains: str | None = Field(default=None, description="a system message contains this text")

    def holds(self, request: LLMRequest) -> bool:
        names = {tool.function.name for tool in request.tools}
        last = last_spoken(request.messages)
        systems = [m.content or "" for m in request.messages if m.role == "system"]
        checks = (
            self.tool is None or self.tool in names,
            self.tools is None or self.tools == bool(names),
            self.last_role is None or self.last_role == last.role,
            self.tool_result is None or self.tool_result == any(m.role == "tool" for m in request.messages),
            self.contains is None or self.contains in (last.content or ""),
            self.system_contains is None or any(self.system_contains in text for text in systems),
        )
        return all(checks)


class ScriptedCall(_Strict):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class Reply(_Strict):
    content: str = ""
    tool_calls: list[ScriptedCall] = Field(default_factory=list)

    def text(self) -> str:
        """The completion text in the hermes form the tiny models' chat template renders an assistant message
        in, so that the next turn's full render equals its token-exact continuation (no render drift)."""
        parts = [self.content]
        for index, call in enumerate(self.tool_calls):
            if self.content or index:
                parts.append("\n")
            arguments = json.dumps(call.arguments, ensure_ascii=False)  # as jinja's tojson writes them
            parts.append(f'<tool_call>\n{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>')
        return "".join(parts)


class Rule(_Strict):
    name: str = ""
    when: When = Field(default_factory=When)
    reply: Reply


class Script(_Strict):
    """Rules tried in order; the first that holds for a request gives its reply."""

    rules: list[Rule] = Field(min_length=1)

    def match(self, request: LLMRequest) -> Rule | None:
        return next((rule for rule in self.rules if rule.when.holds(request)), None)

    @classmethod
    def load(cls, path: Path) -> Script:
        """Read a script file; a missing file, bad JSON or an unknown field is a ``ConfigError`` naming it."""
        try:
            return cls.model_validate_json(path.read_bytes())
        except OSError as error:
            raise ConfigError(f"cannot read the script {path}: {error.strerror}") from None
        except ValidationError as error:
            raise ConfigError(f"the script {path} is not valid: {describe_validation_error(error)}") from None


def last_spoken(messages: Sequence[ChatMessage]) -> ChatMessage:
    """The last message that is not a system message (the whole conversation's last where all are).

    Clients put notes of their own between the turns as system messages (Claude Code's ``<total_tokens>``
    reminder after a tool result); the gateway keeps them where they stand, so a rule about "what was just
    said" looks past them."""
    return next((m for m in reversed(messages) if m.role != "system"), messages[-1])


def describe(request: LLMRequest) -> str:
    """What the rules look at in a request, for the error when none matches."""
    names = [tool.function.name for tool in request.tools]
    last = last_spoken(request.messages)
    snippet = (last.content or "")[:80]
    return (
        f"tools {names or 'none'}, last message {last.role!r} ({snippet!r}), "
        f"tool result {'present' if any(m.role == 'tool' for m in request.messages) else 'absent'}"
    )
