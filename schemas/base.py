"""The base of every contract model: strict when we write, tolerant when we read stored data.

Writers build models directly and unknown fields are refused (``extra="forbid"``). Readers of stored
events or of messages from newer peers validate with ``extra="ignore"`` and ``context=TOLERANT``: pydantic
drops unknown fields at every level of nesting, so an old reader can read what a newer writer recorded, and
the context tells the models' own checks that the data was accepted once already (see ``TurnCompleted``).

pydantic's own ``extra`` override does the dropping inside pydantic-core, so a strict build pays nothing
for the tolerant read (a Python validator on every model would run on each model built).
"""

from __future__ import annotations

from typing import Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict

TOLERANT: Final[dict[str, bool]] = {"tolerant": True}
"""The validation context of tolerant reads; pass it with ``extra=IGNORE``."""
IGNORE: Final[Literal["ignore"]] = "ignore"
"""``extra=IGNORE``: a tolerant read drops unknown fields, at every depth."""


_set = object.__setattr__  # how pydantic sets a frozen model's internals


class Contract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __eq__(self, other: object) -> bool:
        # pydantic's own __eq__ (Python) also weighs private attributes, extras and generic origins, none
        # of which a contract model has: equal fields of the same model are equal models. It runs for each
        # model-valued field that a JSON dump leaving out defaults compares with its default.
        if type(other) is type(self):
            return self.__dict__ == other.__dict__
        return super().__eq__(other)

    __hash__ = BaseModel.__hash__  # a class that defines __eq__ loses the inherited __hash__ otherwise

    @classmethod
    def trusted(cls, **fields: Any) -> Self:
        """A model of values that are valid already (parts of models validated before), every field given:
        nothing is checked or filled in, the caller vouches for both. It sets what ``model_construct`` sets
        (pydantic's own way to skip validation) without that method's per-field loop over aliases and
        defaults, which is most of its cost for a ``TurnCompleted`` on the hot path. Every use is tested
        against the validated model, field by field."""
        model = cls.__new__(cls)
        _set(model, "__dict__", fields)
        _set(model, "__pydantic_fields_set__", set(fields))
        _set(model, "__pydantic_extra__", None)
        _set(model, "__pydantic_private__", None)
        return model
