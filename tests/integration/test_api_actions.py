"""Operator actions through the API end to end: the real API (``keel-api``, two processes) with a read token and an
operator token, over a real store and a real NATS JetStream with the recorder. The operator token approves a held
eviction: the ``ApprovalGiven`` names the token's operator identity, is signed by that operator's key, is recorded
(the recorder checks the signature first), passes the controller's signature check, and the controller's decider
carries the eviction out. A read token gets 403, a second answer 409 (naming who answered), an unknown request 404,
an expired one 410, and none of them publishes anything. A cordon and an uncordon through the API are recorded,
signed by the operator; a cordon signed by the API's chatops key, published on the API's own NATS identity (which may
publish cordons), is refused by the recorder."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event, now_utc
from keel.events.signing import sign_event
from keel.events.types import ApprovalRequested, NodeCordoned
from keel.infra.api_auth import OPERATOR, READ, new_token
from keel.infra.bus import Bus
from keel.infra.nats_auth import identity_file
from keel.infra.signing import Signing, consumer_signing, ensure_signing_identity
from keel.infra.store import append_events, event_row
from tests.integration.test_agent_rejoin import stop_process
from tests.integration.test_api import start_api
from tests.unit.test_controller import Job, of

pytestmark = pytest.mark.integration

OPERATOR_NAME = "api-test-alice"
READ_TOKEN, READ_ENTRY = new_token("viewer", READ, bytes(range(9, 41)))
OP_TOKEN, OP_ENTRY = new_token("alice-phone", OPERATOR, bytes(range(11, 43)), identity=OPERATOR_NAME)


def post(base: str, path: str, doc: dict[str, Any], token: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(base + path, data=json.dumps(doc).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def recorded(keel_env, event_type: str, count: int, timeout_s: float = 20.0) -> list[Event]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        found = [r.event async for r in keel_env.store.read(types=[event_type])]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


async def test_an_operator_token_approves_and_cordons_as_its_operator_and_a_read_token_cannot(
        keel_env, scratch_dir: Path) -> None:
    credentials = keel_env.settings.credentials_dir
    alice = ensure_signing_identity(credentials, OPERATOR_NAME, "operator")
    job = Job(policy=ControllerPolicy(approval_required=frozenset({"evict"}), approval_ttl=timedelta(days=3650)))
    [request] = of(job.health("n2"), "ApprovalRequested")
    assert not of(job.log, "NodeEvictionDecided")
    expired = Event.create(ApprovalRequested(incident_id=str(request.payload.incident_id), action="restart",
                                             reason="restart after n3", expires_at=now_utc() - timedelta(minutes=1)),
                           job_id=request.job_id, subject=request.subject, producer="controller",
                           occurred_at=now_utc() - timedelta(hours=1), correlation_id=request.correlation_id)
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(event, None) for event in [*job.log, expired]])
    await keel_env.start_recorder()
    process, base = await asyncio.to_thread(start_api, keel_env, scratch_dir, extra_env={
        "KEEL_API__WORKERS": "2",
        "KEEL_API__TOKENS": json.dumps([READ_ENTRY.entry(), OP_ENTRY.entry()])})
    try:
        path = f"/v1/approvals/{request.id}"
        # A read token cannot act.
        status, refused = await asyncio.to_thread(post, base, path, {"decision": "approve"}, READ_TOKEN)
        assert status == 403 and "needs 'operator'" in refused["detail"], refused

        status, answer = await asyncio.to_thread(post, base, path, {"decision": "approve", "comment": "n2 is bad"},
                                                 OP_TOKEN)
        assert status == 200, answer
        assert (answer["outcome"], answer["by"], answer["action"]) == ("approved", OPERATOR_NAME, "evict")
        # At once, before the recorder has it: the bus holds this request's answer already.
        status, again = await asyncio.to_thread(post, base, path, {"decision": "deny"}, OP_TOKEN)
        assert status == 409, again

        [given] = await recorded(keel_env, "ApprovalGiven", 1)  # recorded: its signature checked first
        assert str(given.id) == answer["event_id"]
        assert given.payload.model_dump() == {"request_id": str(request.id), "approved": True, "by": OPERATOR_NAME,
                                              "comment": "n2 is bad"}
        assert (given.producer, given.signed_by, given.causation_id) == ("api", OPERATOR_NAME, request.id)
        verdict = consumer_signing(keel_env.settings).check(given)  # what the controller's consumer loop runs
        assert verdict.ok and "(operator)" in verdict.reason, verdict.reason
        out = job.session.observe(given).emitted  # the controller's decider carries the held eviction out
        assert [e.payload.node_id for e in of(out, "NodeEvictionDecided")] == ["n2"]

        # Recorded: a second answer, to either process, is refused naming who answered.
        for _ in range(2):
            status, again = await asyncio.to_thread(post, base, path, {"decision": "deny"}, OP_TOKEN)
            assert status == 409 and f"already approved by {OPERATOR_NAME}" in again["detail"], again
        status, unknown = await asyncio.to_thread(post, base, "/v1/approvals/00000000-0000-4000-8000-000000000000",
                                                  {"decision": "approve"}, OP_TOKEN)
        assert status == 404 and "no approval request" in unknown["detail"], unknown
        status, late = await asyncio.to_thread(post, base, f"/v1/approvals/{expired.id}", {"decision": "approve"},
                                               OP_TOKEN)
        assert status == 410 and "expired" in late["detail"], late

        # A cordon signed by the API's chatops key, on the API's own NATS identity: NATS takes it (that identity
        # may publish cordons, to carry the operators'), the recorder refuses it (a cordon needs an operator's key).
        chatops_key = ensure_signing_identity(credentials, "chatops", "chatops")
        forged = sign_event(Event.create(NodeCordoned(node_id="n1", by=OPERATOR_NAME, reason="forged"),
                                         job_id=request.job_id, subject="node/n1", producer="chatops-slack",
                                         occurred_at=now_utc()), chatops_key)
        api_nats = keel_env.settings.bus.model_copy(update={"credentials": identity_file(credentials, "chatops")})
        bus = await Bus.connect(keel_env.settings.nats_url or "", api_nats, signing=Signing())
        try:
            await bus.publish(forged)
        finally:
            await bus.close()

        # Through the API: a cordon and an uncordon, signed by the operator.
        status, refused = await asyncio.to_thread(post, base, "/v1/nodes/n1/cordon", {"reason": "ecc"}, READ_TOKEN)
        assert status == 403, refused
        status, cordoned = await asyncio.to_thread(post, base, "/v1/nodes/n1/cordon", {"reason": "ecc errors"},
                                                   OP_TOKEN)
        assert status == 200 and (cordoned["job_id"], cordoned["by"]) == (request.job_id, OPERATOR_NAME), cordoned
        status, back = await asyncio.to_thread(post, base, "/v1/nodes/n1/uncordon", {}, OP_TOKEN)
        assert status == 200, back
        status, nowhere = await asyncio.to_thread(post, base, "/v1/nodes/n9/cordon", {"reason": "x"}, OP_TOKEN)
        assert status == 404, nowhere
        cordons = await recorded(keel_env, "NodeCordoned", 2)
        assert [(c.payload.cordoned, c.payload.by, c.signed_by, c.producer, str(c.id)) for c in cordons] == [
            (True, OPERATOR_NAME, OPERATOR_NAME, "api", cordoned["event_id"]),
            (False, OPERATOR_NAME, OPERATOR_NAME, "api", back["event_id"])]
        assert all(consumer_signing(keel_env.settings).check(c).ok for c in cordons)
        assert forged.id not in {c.id for c in cordons}, "a chatops-signed cordon was recorded"
        assert alice.public.public_text()  # the key the events verified against (the shared keyring's entry)

        # Nothing else was published: one answer, two cordons.
        assert len(await recorded(keel_env, "ApprovalGiven", 2, timeout_s=1.0)) == 1
    finally:
        await asyncio.to_thread(stop_process, process)
    assert process.returncode == 0, (scratch_dir / "api.log").read_text()


async def test_an_operator_token_without_its_key_stops_the_api_at_start(keel_env, scratch_dir: Path) -> None:
    _, orphan = new_token("nobody-phone", OPERATOR, bytes(range(13, 45)), identity="api-test-nobody")
    import subprocess
    import sys

    from tests.integration.test_crashes import service_env

    env = {**service_env(keel_env.settings), "KEEL_API__TOKENS": json.dumps([orphan.entry()])}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "keel.api.main"], env=env,
                                   capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "'nobody-phone' acts as 'api-test-nobody'" in done.stderr and "is missing" in done.stderr, done.stderr
