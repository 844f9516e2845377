"""TURNSTILE_DATABASE_URLS: which database each policy's log is in (docs/scale.md). The routing itself, with
two PostgreSQL servers, is tested in tests/integration/test_policy_logs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumers.gateway import GatewayConfig
from pipeline.errors import ConfigError
from pipeline.settings import Settings, parse_policy_urls

DEFAULT = "postgresql://turnstile@db:5432/turnstile"
MATH = "postgresql://turnstile@math-db:5432/turnstile"
CODE = "postgresql://turnstile@code-a,code-b:5432/turnstile?target_session_attrs=read-write"


def test_each_named_policy_gets_its_database_and_every_other_the_default() -> None:
    settings = Settings(database_url=DEFAULT, database_urls=f"math={MATH}\n  code={CODE} ")
    assert settings.policy_database_urls() == {"math": MATH, "code": CODE}
    assert settings.require_database_url("math") == MATH
    assert settings.require_database_url("code") == CODE  # a libpq host list keeps its comma
    assert settings.require_database_url("poetry") == DEFAULT
    assert settings.require_database_url() == DEFAULT


def test_a_mapped_policy_needs_no_default_database_but_another_policy_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no servers.env of a `turnstile up` here
    settings = Settings(database_url=None, database_urls=f"math={MATH}", data_dir=tmp_path)
    assert settings.require_database_url("math") == MATH
    with pytest.raises(ConfigError, match="no database: set TURNSTILE_DATABASE_URL"):
        settings.require_database_url("poetry")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (MATH, "entry 'postgresql://turnstile@math-db:5432/turnstile': write policy=postgresql://"),
        ("math=", "entry 'math=': write policy=postgresql://"),
        (f"ma.th={MATH}", "entry 'ma.th=postgresql"),
        (f"math={MATH} math={CODE}", "names policy 'math' twice"),
        ("math=mysql://db/x", "not a PostgreSQL URL: 'mysql://db/x'"),
    ],
)
def test_a_malformed_mapping_is_refused_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        parse_policy_urls(text)


def test_an_empty_mapping_routes_nothing() -> None:
    assert parse_policy_urls("  \n ") == {}


def test_gateway_replicas_that_share_sessions_take_logs_per_policy() -> None:
    config = GatewayConfig(
        DEFAULT, "nats://n:4222", admin_key="k", shared_sessions=True, policy_database_urls={"math": MATH}
    )
    assert (config.shared_sessions, dict(config.policy_database_urls)) == (True, {"math": MATH})
