"""Events of the ``policy-<name>`` streams: the versions a trainer publishes."""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import Field

from schemas.base import Contract
from schemas.ids import new_uuid


class PolicyVersionPublished(Contract):
    type: Literal["PolicyVersionPublished"] = "PolicyVersionPublished"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=new_uuid)
    policy: str = Field(min_length=1)
    version: int = Field(ge=0, lt=2**31)
    checkpoint: str = Field(min_length=1, description="where the weights are: a directory or URL")
    batches_consumed: list[str] = Field(default_factory=list, description="ids of the batches trained on")


PolicyEvent = PolicyVersionPublished
