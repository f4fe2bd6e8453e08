"""The API's operator actions, their pure parts and the routes over a fake store and bus: who may act, as whom the
event is signed, what is refused (and that a refusal publishes nothing), the keys checked at start, the API's NATS
identity's permissions, and a chatops-signed cordon still refused."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.ext.asyncio import create_async_engine

from keel.api import main as api_main
from keel.api.actions import PRODUCER, Actions, answer_event_id, jobs_refusal, refusal_of, signed_as
from keel.api.app import create_app
from keel.events.envelope import Event
from keel.events.signing import sign_event, verify_event
from keel.events.types import ApprovalGiven, ApprovalRequested, NodeCordoned
from keel.infra.api_auth import OPERATOR, READ, ApiToken, new_token
from keel.infra.config import ApiTokenSettings, ConfigError, Settings
from keel.infra.nats_auth import CHATOPS, NatsScope, new_identity, permissions
from keel.infra.signing import ensure_signing_identity, load_signing_key
from keel.reports.incidents import approval_answer

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
READ_TOKEN, READ_ENTRY = new_token("viewer", READ, bytes(range(32)))
OP_TOKEN, OP_ENTRY = new_token("alice-phone", OPERATOR, bytes(range(1, 33)), identity="alice")
BOB_TOKEN, BOB_ENTRY = new_token("bob", OPERATOR, bytes(range(2, 34)))


def request_event(expires: timedelta = timedelta(hours=1)) -> Event:
    return Event.create(ApprovalRequested(incident_id=str(uuid.uuid4()), action="evict", reason="evict n2",
                                          expires_at=NOW + expires),
                        job_id="job1", subject="job/job1", producer="controller", occurred_at=NOW - timedelta(minutes=1),
                        correlation_id=uuid.uuid4())


@dataclass
class Row:
    event: Event


class FakeStore:
    def __init__(self, events: list[Event]) -> None:
        self.events = events

    async def get(self, event_id: uuid.UUID) -> Row | None:
        return next((Row(e) for e in self.events if e.id == event_id), None)

    async def read(self, *, job_id: str | None = None, types: list[str] | None = None) -> AsyncIterator[Row]:
        for event in self.events:
            if (job_id is None or event.job_id == job_id) and (types is None or event.type in types):
                yield Row(event)


@dataclass
class Ack:
    duplicate: bool = False


class FakeBus:
    """Publishes into the fake store (as the recorder would), a message id once (as JetStream does)."""

    def __init__(self, store: FakeStore, *, record: bool = True, fail: bool = False) -> None:
        self.store, self.record, self.fail = store, record, fail
        self.published: list[Event] = []

    async def publish(self, event: Event) -> Ack:
        if self.fail:
            raise ConnectionError("no NATS")
        if any(e.id == event.id for e in self.published):
            return Ack(duplicate=True)
        self.published.append(event)
        if self.record:
            self.store.events.append(event)
        return Ack()


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    credentials = tmp_path / "credentials"
    return {name: ensure_signing_identity(credentials, name, role)
            for name, role in (("alice", "operator"), ("bob", "operator"), ("chatops", "chatops"))}


def client(store: FakeStore, bus: FakeBus, keys: dict[str, Any], jobs: dict[str, list[str]] | None = None,
           clock: datetime = NOW) -> TestClient:
    async def node_jobs(node: str) -> list[str]:
        return (jobs or {}).get(node, [])

    actions = Actions(store, bus.publish, {k: v for k, v in keys.items() if v.role == "operator"}, node_jobs,
                      clock=lambda: clock)
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    return TestClient(create_app(engine, [READ_ENTRY, OP_ENTRY, BOB_ENTRY], actions=lambda _store: actions))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- tokens -------------------------------------------------------------------------------------------


def test_an_operator_token_acts_as_its_identity_or_its_name_and_a_read_token_as_nobody() -> None:
    assert (OP_ENTRY.signer, BOB_ENTRY.signer, READ_ENTRY.signer) == ("alice", "bob", "")
    assert OP_ENTRY.entry() == {"name": "alice-phone", "scope": "operator", "sha256": OP_ENTRY.sha256,
                                "identity": "alice"}
    assert "identity" not in READ_ENTRY.entry()
    with pytest.raises(ValueError, match="read token cannot act"):
        ApiToken("viewer", READ, READ_ENTRY.sha256, "alice")
    with pytest.raises(ValueError, match="not a valid name"):
        ApiToken("_odd", OPERATOR, READ_ENTRY.sha256)  # a token name that is no signing identity: set one
    with pytest.raises(ValueError, match="read token cannot act"):
        ApiTokenSettings(name="viewer", scope="read", sha256="ab" * 32, identity="alice")
    assert ApiTokenSettings(name="x", scope="operator", sha256="ab" * 32, identity="alice").identity == "alice"


# -- the pure parts -------------------------------------------------------------------------------------


def test_an_answered_request_is_409_naming_who_an_expired_one_410_an_open_one_answerable() -> None:
    request = request_event()
    assert refusal_of(request, [], NOW) is None
    given = approval_answer(request, approved=False, by="carol", comment="", now=NOW)
    refused = refusal_of(request, [given], NOW)
    assert refused is not None and refused.status == 409 and "denied by carol" in refused.reason
    expired = refusal_of(request_event(timedelta(seconds=-1)), [], NOW)
    assert expired is not None and expired.status == 410 and "expired" in expired.reason
    assert answer_event_id(request.id) == answer_event_id(request.id) != answer_event_id(uuid.uuid4())


def test_a_cordon_applies_to_the_nodes_one_job_or_the_one_named() -> None:
    assert jobs_refusal("n1", ["job1"], None) == ("job1", None)
    assert jobs_refusal("n1", ["job1", "job2"], "job2") == ("job2", None)
    for jobs, job, status in ((["job1", "job2"], None, 422), ([], None, 404), (["job1"], "job2", 404)):
        _, refused = jobs_refusal("n1", jobs, job)
        assert refused is not None and refused.status == status, (jobs, job)


def test_an_operator_event_is_signed_by_the_identity_it_names_and_a_chatops_signed_cordon_is_refused(
        keys: dict[str, Any]) -> None:
    ring = {k.name: k.public for k in keys.values()}
    cordon = Event.create(NodeCordoned(node_id="n1", by="alice", reason="flaky"), job_id="job1", subject="node/n1",
                          producer=PRODUCER, occurred_at=NOW)
    signed = signed_as(cordon, keys["alice"])
    assert signed.signed_by == "alice" and verify_event(signed, ring).ok
    with pytest.raises(RuntimeError, match="would be refused"):
        signed_as(cordon, keys["bob"])  # by=alice signed by bob: every consumer would refuse it
    by_chatops = sign_event(cordon.model_copy(update={"producer": "chatops-slack"}), keys["chatops"])
    verdict = verify_event(by_chatops, ring)
    assert not verdict.ok and "may only be signed by a operator key" in verdict.reason


def test_the_apis_nats_identity_publishes_answers_and_cordons_and_nothing_else() -> None:
    scope = NatsScope()
    allowed = permissions(new_identity("chatops", CHATOPS), scope)

    def may(subject: str) -> bool:
        def matches(pattern: str) -> bool:
            p, s = pattern.split("."), subject.split(".")
            return p[-1] == ">" and s[:len(p) - 1] == p[:-1] or (
                len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s, strict=True)))
        return any(matches(p) for p in allowed["publish"]["allow"])

    assert may("keel.job1.job.job1.ApprovalGiven") and may("keel.job1.node.n1.NodeCordoned")
    for subject in ("keel.job1.node.n1.NodeEvictionDecided", "keel.job1.node.n1.FaultInjected",
                    "keel.job1.code.c1.CodeVersionRegistered", "keel.job1.job.job1.JobRegistered",
                    "$JS.API.CONSUMER.CREATE.KEEL.x", "keel_dlq.job1.node.n1.NodeCordoned"):
        assert not may(subject), subject
    assert allowed["subscribe"]["allow"] == ["_INBOX.chatops.>"]


# -- the routes --------------------------------------------------------------------------------------------


def test_an_operator_token_approves_once_as_its_identity_and_a_read_token_cannot(keys: dict[str, Any]) -> None:
    request = request_event()
    store = FakeStore([request])
    bus = FakeBus(store, record=False)  # the recorder has not recorded the answer yet: the bus refuses a second
    api = client(store, bus, keys)
    path = f"/v1/approvals/{request.id}"
    body = {"decision": "approve", "comment": "go"}
    read = api.post(path, json=body, headers=bearer(READ_TOKEN))
    assert read.status_code == 403 and "needs 'operator'" in read.json()["detail"] and not bus.published
    assert api.post(path, json=body).status_code == 401

    done = api.post(path, json=body, headers=bearer(OP_TOKEN))
    assert done.status_code == 200, done.json()
    assert (done.json()["outcome"], done.json()["by"]) == ("approved", "alice")
    [given] = bus.published
    assert given.payload == ApprovalGiven(request_id=str(request.id), approved=True, by="alice", comment="go")
    assert (given.signed_by, given.producer, given.id, given.causation_id) == (
        "alice", "api", answer_event_id(request.id), request.id)
    assert verify_event(given, {k.name: k.public for k in keys.values()}).ok

    again = api.post(path, json={"decision": "deny"}, headers=bearer(BOB_TOKEN))  # raced: the bus has it
    assert again.status_code == 409 and "already answered" in again.json()["detail"] and len(bus.published) == 1
    store.events.append(given)  # recorded now: the log says by whom
    again = api.post(path, json={"decision": "deny"}, headers=bearer(BOB_TOKEN))
    assert again.status_code == 409 and "approved by alice" in again.json()["detail"]


def test_unknown_expired_and_unusable_answers_publish_nothing(keys: dict[str, Any]) -> None:
    expired = request_event(timedelta(seconds=-5))
    store = FakeStore([expired])
    bus = FakeBus(store)
    api = client(store, bus, keys)
    cases = [(f"/v1/approvals/{uuid.uuid4()}", {"decision": "approve"}, 404, "no approval request"),
             (f"/v1/approvals/{expired.id}", {"decision": "approve"}, 410, "expired"),
             (f"/v1/approvals/{expired.id}", {"decision": "maybe"}, 422, "decision"),
             (f"/v1/approvals/{expired.id}", {"decision": "deny", "comment": "a\u0000b"}, 422, "comment"),
             (f"/v1/approvals/{expired.id}", {"decision": "deny", "by": "mallory"}, 422, "by"),
             ("/v1/approvals/abc", {"decision": "approve"}, 422, "request_id")]
    for path, body, status, reason in cases:
        answer = api.post(path, json=body, headers=bearer(OP_TOKEN))
        assert answer.status_code == status and reason in json.dumps(answer.json()), (path, body, answer.json())
    assert not bus.published
    failing = client(store, FakeBus(store, fail=True), keys)
    fresh = request_event()
    store.events.append(fresh)
    answer = failing.post(f"/v1/approvals/{fresh.id}", json={"decision": "approve"}, headers=bearer(OP_TOKEN))
    assert answer.status_code == 503 and "try again" in answer.json()["detail"]


def test_a_cordon_and_an_uncordon_are_signed_by_the_operator(keys: dict[str, Any]) -> None:
    store = FakeStore([])
    bus = FakeBus(store)
    api = client(store, bus, keys, jobs={"n1": ["job1"], "n2": ["job1", "job2"]})
    assert api.post("/v1/nodes/n1/cordon", json={"reason": "ecc"}, headers=bearer(READ_TOKEN)).status_code == 403
    done = api.post("/v1/nodes/n1/cordon", json={"reason": "ecc errors"}, headers=bearer(BOB_TOKEN))
    assert done.status_code == 200 and done.json()["job_id"] == "job1", done.json()
    back = api.post("/v1/nodes/n1/uncordon", json={}, headers=bearer(OP_TOKEN))
    assert back.status_code == 200, back.json()
    cordon, uncordon = bus.published
    assert cordon.payload == NodeCordoned(node_id="n1", cordoned=True, by="bob", reason="ecc errors")
    assert uncordon.payload == NodeCordoned(node_id="n1", cordoned=False, by="alice", reason="")
    assert [(e.signed_by, e.job_id, e.subject) for e in bus.published] == [("bob", "job1", "node/n1"),
                                                                           ("alice", "job1", "node/n1")]
    ring = {k.name: k.public for k in keys.values()}
    assert all(verify_event(e, ring).ok for e in bus.published)
    for path, body, status in (("/v1/nodes/n1/cordon", {}, 422), ("/v1/nodes/n9/cordon", {"reason": "x"}, 404),
                               ("/v1/nodes/n2/cordon", {"reason": "x"}, 422),
                               ("/v1/nodes/n1/cordon", {"reason": "x", "job": "job2"}, 404),
                               ("/v1/nodes/n%201/cordon", {"reason": "x"}, 422)):
        answer = api.post(path, json=body, headers=bearer(OP_TOKEN))
        assert answer.status_code == status, (path, answer.json())
    assert len(bus.published) == 2
    picked = api.post("/v1/nodes/n2/cordon", json={"reason": "x", "job": "job2"}, headers=bearer(OP_TOKEN))
    assert picked.status_code == 200 and bus.published[-1].job_id == "job2"


def test_without_operator_actions_an_operator_token_is_told_so() -> None:
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    api = TestClient(create_app(engine, [READ_ENTRY, OP_ENTRY]))
    answer = api.post(f"/v1/approvals/{uuid.uuid4()}", json={"decision": "approve"}, headers=bearer(OP_TOKEN))
    assert answer.status_code == 503 and "no operator actions" in answer.json()["detail"]
    spec = api.app.openapi()  # the same spec with or without them
    assert {"/v1/approvals/{request_id}", "/v1/nodes/{node_id}/cordon", "/v1/nodes/{node_id}/uncordon"} <= set(
        spec["paths"])
    assert {"403", "404", "409", "410", "503"} <= set(spec["paths"]["/v1/approvals/{request_id}"]["post"]["responses"])


# -- the start ------------------------------------------------------------------------------------------------


def settings_with(tmp_path: Path, *entries: ApiToken) -> Settings:
    return Settings(credentials_dir=tmp_path / "credentials",
                    api={"tokens": [e.entry() for e in entries]})  # type: ignore[arg-type]


def test_an_operator_token_whose_key_is_missing_stops_the_start(tmp_path: Path, keys: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    settings = settings_with(tmp_path, READ_ENTRY, OP_ENTRY)
    loaded = api_main.operator_keys(settings, api_main.tokens_of(settings))
    assert list(loaded) == ["alice"] and loaded["alice"].public.public_text() == keys["alice"].public.public_text()
    _, carol = new_token("carol-laptop", OPERATOR, bytes(32), identity="carol")
    with pytest.raises(ConfigError, match=r"'carol-laptop' acts as 'carol'.*KEEL_SIGNING__OPERATOR=carol keel credentials init"):
        api_main.operator_keys(settings_with(tmp_path, carol), [carol])
    _, chat = new_token("bot", OPERATOR, bytes(32), identity="chatops")
    with pytest.raises(ConfigError, match="role chatops, not operator"):
        api_main.operator_keys(settings_with(tmp_path, chat), [chat])
    # keel-api itself: exit status 2 with the reason, before it connects to anything.
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(tmp_path / "credentials"))
    monkeypatch.setenv("KEEL_API__TOKENS", json.dumps([carol.entry()]))
    monkeypatch.setenv("KEEL_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert api_main.main([]) == 2
    assert "signing key" in capsys.readouterr().err


def test_new_operator_token_prints_its_identity_and_creates_its_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(tmp_path / "credentials"))
    assert api_main.main(["--new-token", "dave-phone", "--scope", "operator", "--identity", "dave"]) == 0
    out, err = capsys.readouterr()
    token, entry = out.strip().splitlines()
    assert json.loads(entry)["identity"] == "dave" and token.startswith("keel_") and "created" in err
    assert token not in err
    assert load_signing_key(tmp_path / "credentials", "dave").role == "operator"
    assert api_main.main(["--new-token", "dave-laptop", "--scope", "operator", "--identity", "dave"]) == 0
    assert "existing" in capsys.readouterr().err
    ensure_signing_identity(tmp_path / "credentials", "controller", "controller")
    assert api_main.main(["--new-token", "ci", "--scope", "operator", "--identity", "controller"]) == 2
    assert "role controller, not operator" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        api_main.main(["--new-token", "viewer", "--identity", "dave"])  # a read token has no identity
