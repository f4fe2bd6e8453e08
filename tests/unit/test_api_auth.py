"""The API's bearer tokens (``keel.infra.api_auth``): digests, scopes, and every refusal with its reason."""

from __future__ import annotations

import json

import pytest

from keel.api.main import main
from keel.infra.api_auth import (
    OPERATOR,
    READ,
    ApiToken,
    Forbidden,
    Unauthorized,
    authenticate,
    authorize,
    new_token,
    token_digest,
)
from keel.infra.config import ApiSettings

ALICE, ALICE_ENTRY = new_token("alice", READ, bytes(range(32)))
BOB, BOB_ENTRY = new_token("bob", OPERATOR, bytes(range(1, 33)))


def test_a_token_is_known_by_its_digest_and_carries_its_scope() -> None:
    assert ALICE.startswith("keel_") and len(ALICE) > 40 and ALICE not in repr(ALICE_ENTRY)
    assert ALICE_ENTRY.sha256 == token_digest(ALICE)
    assert authenticate(ALICE, [ALICE_ENTRY, BOB_ENTRY]) == ALICE_ENTRY
    assert authenticate(BOB, [ALICE_ENTRY, BOB_ENTRY]).scope == OPERATOR
    authorize(BOB_ENTRY, READ)
    authorize(BOB_ENTRY, OPERATOR)
    authorize(ALICE_ENTRY, READ)


@pytest.mark.parametrize("presented, tokens, reason", [
    (ALICE, [], "no tokens configured"),
    (None, [ALICE_ENTRY], "send a token"),
    ("", [ALICE_ENTRY], "send a token"),
    (ALICE + "x", [ALICE_ENTRY], "not one of this API's"),
    (ALICE_ENTRY.sha256, [ALICE_ENTRY], "not one of this API's"),  # the digest itself is no token
])
def test_no_known_token_is_refused_with_the_reason(presented: str | None, tokens: list[ApiToken], reason: str) -> None:
    with pytest.raises(Unauthorized, match=reason):
        authenticate(presented, tokens)


def test_a_read_token_may_not_act() -> None:
    with pytest.raises(Forbidden, match="'alice' has scope 'read'; this needs 'operator'"):
        authorize(ALICE_ENTRY, OPERATOR)


def test_malformed_entries_and_too_little_randomness_are_refused() -> None:
    with pytest.raises(ValueError, match="scope 'admin'"):
        ApiToken("x", "admin", "0" * 64)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        ApiToken("x", READ, "ABC")
    with pytest.raises(ValueError, match="32 random bytes"):
        new_token("x", READ, b"short")
    with pytest.raises(ValueError, match="token name 'bad name!'"):
        ApiToken("bad name!", READ, "0" * 64)


def test_keel_api_new_token_prints_a_token_and_the_entry_that_admits_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--new-token", "carol", "--scope", "operator"]) == 0
    token, entry_text = capsys.readouterr().out.splitlines()
    entry = ApiSettings(tokens=entry_text and [json.loads(entry_text)]).tokens[0]  # the settings accept it as printed
    assert token not in entry_text and entry.scope == OPERATOR
    assert authenticate(token, [ApiToken(entry.name, entry.scope, entry.sha256)]).name == "carol"
    assert main(["--new-token", "bad name!"]) == 2
    assert "token name" in capsys.readouterr().err
