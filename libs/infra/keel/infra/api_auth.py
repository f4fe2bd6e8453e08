"""Who may call the API: bearer tokens with a scope, checked against their SHA-256 digests. Pure.

Scopes: ``read`` may call every query; ``operator`` may call the queries and the actions (approvals, cordons;
docs/api.md). An operator token acts as one operator *signing identity* (``identity``, by default the token's
name): the API signs its actions with that identity's key, so the event says who acted. The settings (``api.tokens``) hold each token's digest, never the token, so
a leaked configuration grants nothing (``keel-api --new-token NAME`` makes a token and its entry). A token is ``keel_`` and 32 random bytes in URL-safe base64: enough
entropy that an unsalted digest cannot be searched.

No token configured means nobody gets in (secure by default): every request is refused with that reason.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass

READ, OPERATOR = "read", "operator"
SCOPES = (READ, OPERATOR)
GRANTS: dict[str, frozenset[str]] = {READ: frozenset({READ}), OPERATOR: frozenset({READ, OPERATOR})}
"""What each token scope may do."""
TOKEN_PREFIX = "keel_"
TOKEN_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
"""A token's name, as the settings accept it (``api.tokens[].name``)."""
TOKEN_BYTES = 32
IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
"""An operator signing identity's name (``keel.infra.signing.IDENTITY_RE``)."""


class Unauthorized(Exception):
    """No usable token: HTTP 401, with the reason."""


class Forbidden(Exception):
    """A known token whose scope does not allow the call: HTTP 403, with the reason."""


@dataclass(frozen=True)
class ApiToken:
    name: str
    scope: str
    sha256: str
    identity: str | None = None
    """An operator token's signing identity (None: the token's name); a read token has none."""

    def __post_init__(self) -> None:
        if not TOKEN_NAME.fullmatch(self.name):
            raise ValueError(f"token name {self.name!r}: 1 to 64 letters, digits and _ . @ - only")
        if self.scope not in SCOPES:
            raise ValueError(f"token {self.name!r}: scope {self.scope!r} is not one of {', '.join(SCOPES)}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"token {self.name!r}: sha256 must be 64 lowercase hex digits")
        if self.identity is not None and self.scope != OPERATOR:
            raise ValueError(f"token {self.name!r}: only an operator token has a signing identity (a read token "
                             "cannot act)")
        if self.scope == OPERATOR and not IDENTITY.fullmatch(self.signer):
            raise ValueError(f"token {self.name!r}: signing identity {self.signer!r} is not a valid name (letters, "
                             "digits, _ . @ -, at most 64, starting with a letter or digit): set its identity")

    @property
    def signer(self) -> str:
        """The operator signing identity this token acts as (its ``identity``, else its name); '' for a read token."""
        if self.scope != OPERATOR:
            return ""
        return self.identity or self.name

    def entry(self) -> dict[str, str]:
        """The token's ``api.tokens`` entry (no secret in it)."""
        entry = {"name": self.name, "scope": self.scope, "sha256": self.sha256}
        if self.scope == OPERATOR:
            entry["identity"] = self.signer
        return entry


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(name: str, scope: str, random_bytes: bytes, identity: str | None = None) -> tuple[str, ApiToken]:
    """A token from ``random_bytes`` (``TOKEN_BYTES`` of them, from ``secrets.token_bytes``) and its entry
    (``identity``: an operator token's signing identity, None for its name)."""
    if len(random_bytes) < TOKEN_BYTES:
        raise ValueError(f"a token needs {TOKEN_BYTES} random bytes, got {len(random_bytes)}")
    token = TOKEN_PREFIX + base64.urlsafe_b64encode(random_bytes).decode().rstrip("=")
    return token, ApiToken(name, scope, token_digest(token), identity)


def authenticate(presented: str | None, tokens: Sequence[ApiToken]) -> ApiToken:
    """The token ``presented`` (the bearer credential, or None) is; ``Unauthorized`` with the reason otherwise.
    Every configured digest is compared, in constant time each, so the answer's timing names none."""
    if not tokens:
        raise Unauthorized("this API has no tokens configured (api.tokens): every request is refused")
    if not presented:
        raise Unauthorized("send a token: Authorization: Bearer <token>")
    digest = token_digest(presented)
    found: ApiToken | None = None
    for token in tokens:
        if hmac.compare_digest(token.sha256, digest):
            found = token
    if found is None:
        raise Unauthorized("the token is not one of this API's")
    return found


def authorize(token: ApiToken, needed: str) -> None:
    """``Forbidden`` unless ``token``'s scope allows ``needed``."""
    if needed not in GRANTS[token.scope]:
        raise Forbidden(f"token {token.name!r} has scope {token.scope!r}; this needs {needed!r}")


__all__ = ["GRANTS", "OPERATOR", "READ", "SCOPES", "ApiToken", "Forbidden", "Unauthorized", "authenticate",
           "authorize", "new_token", "token_digest"]
