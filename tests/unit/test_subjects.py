"""NATS subjects (``keel.infra.subjects``): one rule for every aggregate, the aggregate id encoded as one
token, reversibly."""

from __future__ import annotations

import pytest

from keel.events.envelope import SUBJECT_RE, Event
from keel.events.types import DiagnosticsRequested, RanksRestartRequested
from keel.infra.subjects import decode_token, encode_token, event_subject, job_subjects, subject_filter
from tests.factories import T0, health_event

NATS_FORBIDDEN = (".", "*", ">", " ", "\t", "\r", "\n")


def matches(filter_: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a trailing ``>`` one or more."""
    want, got = filter_.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(got) > index
        if index >= len(got) or token not in ("*", got[index]):
            return False
    return len(want) == len(got)


@pytest.mark.parametrize("value, token", [
    ("n07", "n07"),
    ("node_3", "node_3"),
    ("gpu-01", "gpu-01"),
    ("12", "12"),
    ("gpu01.dc1", "gpu01%2Edc1"),
    ("host.rack-2.dc1", "host%2Erack-2%2Edc1"),
    ("sha256:ab12", "sha256%3Aab12"),
    ("a*b>c", "a%2Ab%3Ec"),
    ("has space\tand tab", "has%20space%09and%20tab"),
    ("100%", "100%25"),
    ("%2E", "%252E"),
    ("nœud", "n%C5%93ud"),
])
def test_an_aggregate_id_becomes_one_valid_token_and_back(value: str, token: str) -> None:
    assert encode_token(value) == token
    assert not any(c in token for c in NATS_FORBIDDEN)
    assert decode_token(token) == value


def test_every_envelope_subject_character_round_trips() -> None:
    # The envelope allows [A-Za-z0-9_.:-]; each must survive, alone and in runs.
    for value in ["A", "z", "0", "_", "-", ".", ":", "..", "a.b:c_d-e", "." * 128]:
        assert SUBJECT_RE.fullmatch(f"node/{value}")
        token = encode_token(value)
        assert "." not in token and decode_token(token) == value


@pytest.mark.parametrize("token", ["", "a.b", "a*", "a b", "%", "%2", "%2e", "%zz", "%41", "a%2", "%FF"])
def test_a_token_encode_token_cannot_have_made_is_refused(token: str) -> None:
    # Empty, NATS-special, a stray or short escape, lower-case hex, a needless escape of 'A', invalid UTF-8.
    with pytest.raises(ValueError):
        decode_token(token)


def test_an_empty_id_has_no_token() -> None:
    with pytest.raises(ValueError):
        encode_token("")


def test_every_aggregate_kind_follows_the_same_rule() -> None:
    node = health_event("gpu01.dc1", job="train")
    assert event_subject("keel", node) == "keel.train.node.gpu01%2Edc1.NodeHealthChanged"
    restart = Event.create(RanksRestartRequested(node_id="n07", generation=1, reason="r", expires_at=T0),
                           job_id="train", subject="node/n07", producer="controller", occurred_at=T0)
    assert event_subject("keel", restart) == "keel.train.node.n07.RanksRestartRequested"
    round_ = Event.create(DiagnosticsRequested(round=1, nodes=["n07"], checks=["gpu_matmul"], timeout_s=30, reason="r",
                                               expires_at=T0),
                          job_id="train", subject="job/train", producer="controller", occurred_at=T0)
    assert event_subject("keel", round_) == "keel.train.job.train.DiagnosticsRequested"


def test_filters_address_one_aggregate_or_any() -> None:
    mine = health_event("gpu01.dc1", job="train")
    other = health_event("gpu01", job="train")
    own = subject_filter("keel", "train", "node", "gpu01.dc1", "NodeHealthChanged")
    assert own == "keel.train.node.gpu01%2Edc1.NodeHealthChanged"
    assert matches(own, event_subject("keel", mine)) and not matches(own, event_subject("keel", other))
    every_node = subject_filter("keel", "train", "node", None, "NodeHealthChanged")
    assert every_node == "keel.train.node.*.NodeHealthChanged"
    assert matches(every_node, event_subject("keel", mine)) and matches(every_node, event_subject("keel", other))
    assert subject_filter("keel") == "keel.*.*.*.*"
    assert job_subjects("keel", "train") == "keel.train.>" and job_subjects("keel") == "keel.*.>"
    assert matches(job_subjects("keel", "train"), event_subject("keel", mine))
    assert not matches(job_subjects("keel", "other"), event_subject("keel", mine))


def test_an_agent_subscribes_to_its_own_nodes_commands_and_the_job_wide_requests() -> None:
    from keel.agent.consumer import command_subjects, durable_name

    subjects = command_subjects("keel", "train", "gpu01.dc1", checkpointing=False)
    assert subjects == ["keel.train.node.gpu01%2Edc1.RanksRestartRequested",
                        "keel.train.node.gpu01%2Edc1.StandbyPromotionRequested",
                        "keel.train.job.*.DiagnosticsRequested", "keel.train.job.*.StacksRequested",
                        "keel.train.job.*.SdcReplayRequested",
                        # The controller's report of this node's clock skew (it judges expiries net of it).
                        "keel.train.node.gpu01%2Edc1.NodeClockSkewed",
                        # Its eviction and fence: it stops its ranks and leaves (keel.agent.fencing).
                        "keel.train.node.gpu01%2Edc1.NodeEvictionDecided",
                        "keel.train.node.gpu01%2Edc1.NodeFenced"]
    with_broker = command_subjects("keel", "train", "gpu01.dc1", checkpointing=True)
    assert with_broker[:8] == subjects and "keel.train.job.*.CheckpointRestorePlanned" in with_broker
    # The broker's per-node parts (a restore plan's, a placement's): this node's only.
    assert with_broker[-3:] == ["keel.train.node.gpu01%2Edc1.CheckpointNodeBackupsAssigned",
                                "keel.train.node.gpu01%2Edc1.CheckpointNodeRestorePlanned",
                                # Who may send backups to this node's shard store.
                                "keel.train.node.gpu01%2Edc1.CheckpointNodeBackupsHeld"]

    def restart(node: str) -> Event:
        return Event.create(RanksRestartRequested(node_id=node, generation=1, reason="r", expires_at=T0),
                            job_id="train", subject=f"node/{node}", producer="controller", occurred_at=T0)

    def taken(event: Event) -> bool:
        return any(matches(f, event_subject("keel", event)) for f in subjects)

    assert taken(restart("gpu01.dc1"))
    assert not taken(restart("gpu01")) and not taken(restart("gpu01.dc2")) and not taken(restart("gpu01-dc1"))
    name = durable_name("train", "gpu01.dc1", checkpointing=False)
    assert name == "agent-train-gpu01%2Edc1-cmd" and not any(c in name for c in NATS_FORBIDDEN)
    assert durable_name("train", "gpu01.dc1", checkpointing=True) == "agent-train-gpu01%2Edc1-ckpt"
