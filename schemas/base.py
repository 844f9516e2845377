"""The base of every contract model: strict when we write, tolerant when we read stored data.

Writers build models directly and unknown fields are refused (``extra="forbid"``). Readers of stored
events or of messages from newer peers validate with ``context=TOLERANT`` and unknown fields are dropped
at every level of nesting, so an old reader can read what a newer writer recorded.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, ModelWrapValidatorHandler, ValidationInfo, model_validator

TOLERANT: Final[dict[str, bool]] = {"tolerant": True}


class Contract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _drop_unknown_when_reading(
        cls, data: Any, handler: ModelWrapValidatorHandler[Any], info: ValidationInfo
    ) -> Any:
        if info.context is not None and info.context.get("tolerant") and isinstance(data, dict):
            known = _known_fields(cls)
            if not data.keys() <= known:  # rebuild only when there is something to drop
                data = {key: value for key, value in data.items() if key in known}
        return handler(data)


@cache
def _known_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(model.__pydantic_fields__)
