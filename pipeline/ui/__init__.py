"""The episode browser (``turnstile ui``): a read-only web app over the log and the read models, served
alone or mounted in another app (the gateway's ``--ui``)."""

from pipeline.ui.app import create_app
from pipeline.ui.filters import BadRequest, EpisodeQuery, parse_query
from pipeline.ui.guard import KeyGuard
from pipeline.ui.reader import DatabaseUnavailable, check_login, reader_engine

__all__ = [
    "BadRequest",
    "DatabaseUnavailable",
    "EpisodeQuery",
    "KeyGuard",
    "check_login",
    "create_app",
    "parse_query",
    "reader_engine",
]
