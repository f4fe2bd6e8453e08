"""NATS permissions per role (pure): who may publish what, and that the tables agree with the events,
the producers' signing table and the agent's consumer."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.agent.consumer import command_subjects
from keel.agent.supervisor import without_control_plane_credentials
from keel.events.envelope import REGISTRY
from keel.events.signing import REQUIRED_SIGNER
from keel.infra.nats_auth import (
    ADMIN,
    AGENT,
    AGENT_NODE_COMMANDS,
    AUDITOR,
    CONTROLLER,
    OPERATOR,
    ROLE_EVENT_TYPES,
    NatsAuthError,
    NatsAuthority,
    NatsScope,
    agent_durable,
    new_identity,
    permissions,
    render_authorization,
)

SCOPE = NatsScope("keel", "KEEL", "KEEL_DLQ")


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    want, have = pattern.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or (token != "*" and token != have[index]):
            return False
    return len(want) == len(have)


def may_publish(role: str, subject: str, **who: str) -> bool:
    name = f"agent.{who['job']}.{who['node']}" if role == AGENT else role
    identity = new_identity(name, role, **who)
    return any(matches(p, subject) for p in permissions(identity, SCOPE)["publish"]["allow"])


AGENT_N0 = {"job": "j", "node": "n0"}


def test_an_agent_reports_only_its_own_node() -> None:
    assert may_publish(AGENT, "keel.j.node.n0.NodeHeartbeat", **AGENT_N0)
    assert not may_publish(AGENT, "keel.j.node.n1.NodeHeartbeat", **AGENT_N0)
    assert not may_publish(AGENT, "keel.other.node.n0.NodeHeartbeat", **AGENT_N0)


@pytest.mark.parametrize("subject", [
    "keel.j.node.n1.NodeEvictionDecided", "keel.j.node.n0.NodeEvictionDecided", "keel.j.node.n0.RanksRestartRequested",
    "keel.j.clock.j.TimerTicked", "keel.j.job.j.ApprovalGiven", "keel.j.job.j.StandbyRefillRequested",
    "keel.j.job.j.CheckpointRestorePlanned", "$JS.API.STREAM.DELETE.KEEL", "$JS.API.STREAM.PURGE.KEEL",
    "$JS.API.CONSUMER.CREATE.KEEL.controller-j", "$JS.API.CONSUMER.DELETE.KEEL.agent-j-n1-cmd",
])
def test_an_agent_may_not_command_approve_or_manage_streams(subject: str) -> None:
    assert not may_publish(AGENT, subject, **AGENT_N0)


def test_an_agent_reads_through_its_own_consumer_only() -> None:
    own = agent_durable("j", "n0", checkpointing=True)
    assert may_publish(AGENT, f"$JS.API.CONSUMER.MSG.NEXT.KEEL.{own}", **AGENT_N0)
    assert not may_publish(AGENT, "$JS.API.CONSUMER.MSG.NEXT.KEEL.controller-j", **AGENT_N0)
    assert not may_publish(AGENT, f"$JS.API.CONSUMER.MSG.NEXT.KEEL.{agent_durable('j', 'n1', checkpointing=True)}",
                           **AGENT_N0)


def test_only_the_controller_commands_and_only_admin_manages_streams() -> None:
    for role in ROLE_EVENT_TYPES:
        allowed = may_publish(role, "keel.j.node.n0.RanksRestartRequested")
        assert allowed == (role == CONTROLLER), role
        assert not may_publish(role, "$JS.API.STREAM.DELETE.KEEL"), role
    assert may_publish(ADMIN, "$JS.API.STREAM.DELETE.KEEL")


def test_operator_and_auditor() -> None:
    assert may_publish(OPERATOR, "keel.j.job.j.ApprovalGiven")
    assert not may_publish(OPERATOR, "keel.j.node.n0.NodeEvictionDecided")
    assert not may_publish(AUDITOR, "keel.j.job.j.ApprovalGiven")
    assert may_publish(AUDITOR, "$JS.API.STREAM.INFO.KEEL")


def test_every_identity_subscribes_only_below_its_own_inbox() -> None:
    identity = new_identity(CONTROLLER, CONTROLLER)
    assert permissions(identity, SCOPE)["subscribe"]["allow"] == [f"{identity.inbox_prefix}.>"]


def test_every_event_type_has_a_publisher_and_every_signer_may_publish_what_it_signs() -> None:
    publishable = {t for pairs in ROLE_EVENT_TYPES.values() for _, t in pairs}
    from keel.infra.nats_auth import AGENT_NODE_FACTS, AGENT_OTHER_FACTS
    publishable |= set(AGENT_NODE_FACTS) | {t for _, t in AGENT_OTHER_FACTS}
    admin_only = {"DeadLetterRedriven"}  # keel dlq redrive runs as admin
    assert set(REGISTRY.names()) - publishable == admin_only
    for event_type, roles in REQUIRED_SIGNER.items():
        for role in roles:
            assert event_type in {t for _, t in ROLE_EVENT_TYPES.get(role, ())}, (event_type, role)


def test_the_agent_may_dead_letter_every_node_command_it_consumes() -> None:
    consumed = {subject.rsplit(".", 1)[1] for subject in command_subjects("keel", "j", "n0", checkpointing=True)
                if ".node." in subject}
    assert consumed <= set(AGENT_NODE_COMMANDS)


def test_authorization_is_valid_json_in_nats_syntax_and_unions_scopes() -> None:
    identity = new_identity(CONTROLLER, CONTROLLER)
    text = render_authorization([identity], [SCOPE, NatsScope("kt1", "KT1", "KT1_DLQ")])
    assert text.count(identity.password) == 1
    assert "$JS.API.STREAM.INFO.KEEL" in text and "$JS.API.STREAM.INFO.KT1" in text


def test_bad_identities_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(NatsAuthError, match="unknown role"):
        new_identity("x", "root")
    with pytest.raises(NatsAuthError, match="names its job and node"):
        new_identity("agent.x", AGENT)
    authority = NatsAuthority(tmp_path / "creds")
    authority.ensure("controller", CONTROLLER, reload=False)
    with pytest.raises(NatsAuthError, match="exists with role controller"):
        authority.ensure("controller", OPERATOR, reload=False)
    assert (tmp_path / "creds" / "nats" / "controller.json").stat().st_mode & 0o777 == 0o600


def test_ranks_inherit_no_control_plane_credentials() -> None:
    env = {"PATH": "/bin", "KEEL_NATS_URL": "nats://x", "KEEL_BUS__CREDENTIALS": "/c/agent.json",
           "KEEL_DATABASE_URL": "postgresql://u:p@h/db", "KEEL_CREDENTIALS_DIR": "/c", "KEEL_HOME": "/h",
           "KEEL_POSTGRES__PASSWORD": "x", "KEEL_FAULT_FILE": "/f"}
    assert without_control_plane_credentials(env) == {"PATH": "/bin", "KEEL_FAULT_FILE": "/f"}
