"""A local Standard Webhooks receiver: what the demo shows deliveries with, the benchmark times them with, and
what an operator can point a ``webhook`` destination at to see what the notifier sends (adapter: a thread
serving HTTP on 127.0.0.1).

Each POST's signature is verified with the destination's secret (``verify_standard_webhook``); a verified
payload is kept with its arrival times (monotonic and wall clock), a bad one is counted and answered 401.
While ``failing`` is set, every request is answered 503 and counted as refused, as a receiver that is down.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from keel.events.envelope import now_utc
from keel.notifier.core import verify_standard_webhook


@dataclass(frozen=True)
class Delivery:
    payload: dict[str, Any]
    at_monotonic: float
    at_wall: float


class WebhookReceiver:
    """Serves on ``url`` from construction until ``close()`` (or the end of a ``with`` block)."""

    def __init__(self, secret: str, host: str = "127.0.0.1") -> None:
        self.secret = secret
        self.received: list[Delivery] = []
        self.bad_signatures = 0
        self.refused = 0
        self.failing = False
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                at, wall = time.monotonic(), time.time()
                if receiver.failing:
                    with receiver.lock:
                        receiver.refused += 1
                    self._answer(503)
                    return
                if verify_standard_webhook(dict(self.headers.items()), body, receiver.secret, now_utc()) is not None:
                    with receiver.lock:
                        receiver.bad_signatures += 1
                    self._answer(401)
                    return
                with receiver.lock:
                    receiver.received.append(Delivery(json.loads(body), at, wall))
                self._answer(200)

            def _answer(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/keel"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="webhook-receiver").start()

    def payloads(self) -> list[dict[str, Any]]:
        """Every verified payload so far, in arrival order (a redelivery appears again)."""
        with self.lock:
            return [d.payload for d in self.received]

    def first_arrivals(self) -> dict[str, Delivery]:
        """Per event id (``data.event_id``): its first verified delivery."""
        with self.lock:
            deliveries = list(self.received)
        first: dict[str, Delivery] = {}
        for delivery in deliveries:
            first.setdefault(str(delivery.payload.get("data", {}).get("event_id")), delivery)
        return first

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


__all__ = ["Delivery", "WebhookReceiver"]
