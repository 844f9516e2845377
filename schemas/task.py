"""Messages on the JetStream work queues ``TASKS`` (subjects ``tasks.<policy>``) and ``HARNESS_TASKS``
(``harness.tasks.<policy>``)."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field

from schemas.base import Contract
from schemas.ids import new_uuid


class TaskSubmitted(Contract):
    """One task for runners: run ``group_size`` episodes of it. ``submission_id`` is the group id of
    those episodes and the message's ``Nats-Msg-Id``."""

    type: Literal["TaskSubmitted"] = "TaskSubmitted"
    schema_version: Literal[1] = 1
    submission_id: uuid.UUID = Field(default_factory=new_uuid)
    policy: str = Field(min_length=1)
    task: dict[str, Any]
    task_id: str
    group_size: int = Field(default=1, ge=1, le=4096)
