"""NATS subjects of Keel events: one rule, ``<prefix>.<job>.<aggregate kind>.<aggregate id>.<type>``.

An event with envelope subject ``node/gpu01.dc1`` of job ``train`` and type ``RanksRestartRequested`` is
published on ``keel.train.node.gpu01%2Edc1.RanksRestartRequested``. The aggregate id is a token of its own
so that a consumer can filter on one aggregate (a node agent takes only its own node's commands) with a
plain subject filter, and the server does the routing instead of every consumer decoding and dropping.

The aggregate id is encoded (``encode_token``) because NATS gives meaning to ``.`` (token separator),
``*`` and ``>`` (wildcards) and forbids whitespace, and host names carry dots. The encoding:

- ``A-Z a-z 0-9 _ -`` stand for themselves (the characters NATS recommends), so the usual ids
  (``n07``, ``node_3``, ``gpu-01``, a rank number) read the same in the subject as in the envelope;
- every other character becomes ``%XX`` per byte of its UTF-8 form, with upper-case hex digits
  (``.`` -> ``%2E``, ``:`` -> ``%3A``, ``%`` -> ``%25``, a space -> ``%20``);
- ``decode_token`` inverts it exactly and refuses anything ``encode_token`` does not produce (a lower-case
  or needless escape, a stray ``%``), so an id has exactly one token and a token exactly one id.

The other tokens need no encoding: the prefix is letters, job ids are ``[A-Za-z0-9_-]``, aggregate kinds
``[a-z_]`` and type names Python identifiers (all checked where they are defined).
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keel.events.envelope import Event

_PLAIN = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPED = re.compile(r"[^A-Za-z0-9_-]+")
_TOKEN = re.compile(r"(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+")


def _escape(match: re.Match[str]) -> str:
    return "".join(f"%{byte:02X}" for byte in match.group().encode("utf-8"))


@functools.lru_cache(maxsize=16384)
def encode_token(value: str) -> str:
    """``value`` (an aggregate id) as one NATS subject token; see the module docstring. Raises
    ``ValueError`` for an empty value (a subject has no empty tokens). Cached: a process meets few ids
    and every publish encodes one."""
    if not value:
        raise ValueError("an empty aggregate id has no subject token")
    if _PLAIN.fullmatch(value):
        return value
    return _ESCAPED.sub(_escape, value)


def decode_token(token: str) -> str:
    """The aggregate id ``encode_token`` turned into ``token``. Raises ``ValueError`` for a token it
    cannot have produced."""
    if not _TOKEN.fullmatch(token):
        raise ValueError(f"{token!r} is not an encoded subject token")
    value = urllib.parse.unquote(token, errors="strict")  # invalid UTF-8: UnicodeDecodeError, a ValueError
    if encode_token(value) != token:
        raise ValueError(f"{token!r} is not the canonical token of {value!r} ({encode_token(value)!r})")
    return value


def event_subject(prefix: str, event: Event) -> str:
    """The subject ``event`` is published on: ``<prefix>.<job>.<aggregate kind>.<aggregate id>.<type>``."""
    kind, _, aggregate_id = event.subject.partition("/")
    return f"{prefix}.{event.job_id}.{kind}.{encode_token(aggregate_id)}.{event.type}"


def subject_filter(prefix: str, job_id: str | None = None, kind: str | None = None,
                   aggregate_id: str | None = None, event_type: str | None = None) -> str:
    """A filter for the events that match every part given; a part left out (None) matches any (``*``).
    ``aggregate_id`` is the id as in the envelope (it is encoded here)."""
    return ".".join([prefix, job_id or "*", kind or "*", "*" if aggregate_id is None else encode_token(aggregate_id),
                     event_type or "*"])


def job_subjects(prefix: str, job_id: str | None = None) -> str:
    """A filter for every event of ``job_id`` (of every job when None): ``<prefix>.<job>.>``."""
    return f"{prefix}.{job_id or '*'}.>"
