"""The base of every contract model: strict when we write, tolerant when we read stored data.

Writers build models directly and unknown fields are refused (``extra="forbid"``). Readers of stored
events or of messages from newer peers validate with ``extra="ignore"`` and ``context=TOLERANT``: pydantic
drops unknown fields at every level of nesting, so an old reader can read what a newer writer recorded, and
the context tells the models' own checks that the data was accepted once already (see ``TurnCompleted``).

pydantic's own ``extra`` override does the dropping inside pydantic-core. It replaced a Python wrap
validator on every model, which ran on each model built, strict or not, and was the top line of the
runner's profile (issue 21).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict

TOLERANT: Final[dict[str, bool]] = {"tolerant": True}
"""The validation context of tolerant reads; pass it with ``extra=IGNORE``."""
IGNORE: Final[Literal["ignore"]] = "ignore"
"""``extra=IGNORE``: a tolerant read drops unknown fields, at every depth."""


class Contract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
