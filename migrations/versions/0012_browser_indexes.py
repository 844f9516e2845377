"""Indexes for the episode browser (``turnstile ui``): its list sorts and filters the ``episodes`` read model
and finds an episode's samples, on logs of a million turns.

- ``episodes`` sorted by start, reward, turns, duration or completion tokens, newest or largest first (a
  page is the first rows of one of these indexes, never a sort of every row); by agent, task and
  termination, newest first; tags by containment (GIN).
- ``turns`` that broke the prefix or drifted: partial indexes hold only those (few) rows, so the "prefix
  breaks" and "render drift" filters are a semi-join over them.
- ``samples`` of an episode (the episode page's advantages and batches).

Rebuild schemas (``rm_<name>``) made after this get them too (``LIKE ... INCLUDING ALL``).

Revision ID: 0012
Revises: 0010
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A list page is the first rows of one of these, read forward (largest first, no value last) or backward.
ORDER = "DESC NULLS LAST, episode_id DESC"
INDEXES: dict[str, str] = {
    "episodes_started": f"episodes (started_at {ORDER})",
    "episodes_finished": f"episodes (finished_at {ORDER})",
    "episodes_reward": f"episodes (reward {ORDER})",
    "episodes_turns": f"episodes (turns {ORDER})",
    "episodes_duration": f"episodes (duration_s {ORDER})",
    "episodes_completion_tokens": f"episodes (completion_tokens {ORDER})",
    "episodes_version": f"episodes (max_policy_version {ORDER})",
    "episodes_policy_newest": f"episodes (policy, started_at {ORDER})",
    "episodes_agent_newest": f"episodes (agent, started_at {ORDER})",
    "episodes_task_newest": f"episodes (task_id, started_at {ORDER})",
    "episodes_termination_newest": f"episodes (termination, started_at {ORDER})",
    "episodes_tags": "episodes USING gin (tags jsonb_path_ops)",
    "turns_prefix_break": "turns (episode_id) WHERE prefix_break",
    "turns_render_drift": "turns (episode_id) WHERE render_drift",
    "samples_episode": "samples (episode_id)",
}


def upgrade() -> None:
    for name, definition in INDEXES.items():
        op.execute(f"CREATE INDEX {name} ON {definition}")


def downgrade() -> None:
    for name in reversed(INDEXES):
        op.execute(f"DROP INDEX {name}")
