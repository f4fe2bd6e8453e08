"""Which database errors the recorder retries: a lost connection and a server that is not (yet) accepting
connections pass; a real error (a constraint, bad SQL) is raised."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError

from keel.recorder.adapter import transient_db_error


class _PgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize("sqlstate, transient", [
    ("57P03", True),   # the database system is starting up (a restart the recorder raced)
    ("57P01", True),   # admin shutdown
    ("08006", True),   # connection failure
    ("53300", True),   # too many connections
    ("23505", False),  # unique violation: a bug, not weather
    ("42P01", False),  # undefined table
])
def test_transient_errors_by_sqlstate(sqlstate: str, transient: bool) -> None:
    assert transient_db_error(DBAPIError("INSERT ...", None, _PgError(sqlstate))) is transient


def test_an_invalidated_connection_is_transient_whatever_its_state() -> None:
    assert transient_db_error(DBAPIError("SELECT 1", None, _PgError(""), connection_invalidated=True))
