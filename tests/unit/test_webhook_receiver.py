"""The local Standard Webhooks receiver (``keel.notifier.receiver``) the demo and ``bench/ops.py`` use: it keeps
what is signed with its secret, refuses the rest with 401, and answers 503 while failing, over real HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from keel.notifier.core import standard_webhook_headers
from keel.notifier.receiver import WebhookReceiver

SECRET = "whsec_" + "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="


def post(url: str, payload: dict[str, object], secret: str, message_id: str = "msg_1") -> int:
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", **standard_webhook_headers(message_id, int(time.time()), body, secret)}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_signed_deliveries_are_kept_forged_ones_refused_and_a_failing_receiver_answers_503() -> None:
    with WebhookReceiver(SECRET) as receiver:
        first = {"type": "keel.incident_opened", "data": {"event_id": "e1"}}
        assert post(receiver.url, first, SECRET) == 200
        assert post(receiver.url, {"type": "x", "data": {"event_id": "e2"}}, "whsec_" + "QUJD" * 8) == 401
        receiver.failing = True
        assert post(receiver.url, {"type": "x", "data": {"event_id": "e3"}}, SECRET) == 503
        receiver.failing = False
        assert post(receiver.url, first, SECRET, "msg_2") == 200  # a redelivery
        assert receiver.payloads() == [first, first]
        assert list(receiver.first_arrivals()) == ["e1"] and receiver.bad_signatures == 1 and receiver.refused == 1
        arrival = receiver.first_arrivals()["e1"]
        assert arrival.at_wall <= time.time() and arrival.at_monotonic <= time.monotonic()
