"""The NATS JetStream adapter: the only code in Keel that talks to NATS.

Contracts:

- An event is published on ``<prefix>.<job>.<aggregate kind>.<aggregate id>.<type>``, the aggregate id
  encoded as one subject token (``keel.infra.subjects``, which also builds consumers' filters).
- ``publish`` / ``publish_many`` set ``Nats-Msg-Id`` to the event id and return only once JetStream
  acknowledged every message (with ``sync_interval: always``, acknowledged means on disk). Transient
  errors (timeouts, no responders, a reconnect) are retried with capped exponential backoff, a bounded
  number of times, then raised as ``PublishFailed``. While the connection is down (the client reconnects
  on its own, for ever) attempts are not counted: a publish waits up to ``outage_tolerance`` for NATS to
  come back, so a NATS outage is ridden out rather than turned into a crash of every service.
  A stream without a leader (a cluster electing one: JetStream answers "no responders", its API "temporarily
  unavailable", a retry "duplicate message id is in process" while its first copy is being replicated) is such
  an outage too; so is creating a consumer meanwhile.
- Consumers are durable pull consumers; callers ack only after the effect of a message is durable.
- Signing (``keel.infra.signing.Signing``): every publish signs the events whose types the bus's keys must
  sign (``keel.events.signing.REQUIRED_SIGNER``), so a service's decisions are signed wherever they are
  published from; ``check`` is what consumers (``keel.infra.consumer``, the recorder) verify against.
- ``dead_letter`` moves a message that cannot be processed to the dead-letter stream: the body is the
  original raw bytes, the headers say why and where it came from.

Several servers (a cluster) are one comma-separated URL; the client moves to another when its server fails
or stops answering pings. While a stream's leader is elected (a server lost) a publish times out or finds no
responders (``NoStreamResponseError``): both are transient, retried like any other.

Stream limits (``BusSettings``): ``max_age`` 7 d and ``max_bytes`` 2 GiB per stream (reserved up front by
JetStream), ``replicas`` 1, or 3 with 3 or more NATS servers — the stream is a durable
buffer in front of Postgres, which keeps history for good. The events stream discards *new* messages at
its limit, never old ones: a full stream refuses a publish (``StreamFull``, a ``PublishFailed``, after the
usual retries with back-off, logged as such) instead of silently dropping its oldest events, which the
recorder may not have stored yet. The recorder makes room: past ``recorder.stream_trim_at`` of the limit it
purges, oldest first, what it has stored (``keel.recorder.core.trim_point``). The dead-letter stream keeps
discarding old messages (the ``dead_letters`` table holds every one), so dead-lettering never blocks; ``duplicate_window`` 2 min for dedup on
``Nats-Msg-Id``; ``max_msg_size`` 1 MiB (NATS's max_payload) so that an oversized event still reaches
the recorder and is dead-lettered with a reason rather than silently refused to the publisher's
successor; the event limit itself is ``max_event_bytes`` (256 KiB).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

from keel.events.envelope import Event
from keel.infra.config import BusSettings
from keel.infra.metrics import STREAM_FULL_REFUSALS
from keel.infra.nats_auth import NatsAuthError, load_identity
from keel.infra.signing import NO_SIGNING, Signing
from keel.infra.subjects import event_subject

log = logging.getLogger(__name__)

NATS_MAX_PAYLOAD_BYTES = 1024 * 1024
HEADER_DLQ_REASON = "Keel-Dlq-Reason"
HEADER_DLQ_SUBJECT = "Keel-Dlq-Original-Subject"
HEADER_DLQ_STREAM_SEQ = "Keel-Dlq-Stream-Seq"
HEADER_DLQ_TRUNCATED = "Keel-Dlq-Truncated-From"
"""On a dead letter whose copy had to be cut to fit NATS's payload limit: the original size in bytes (the
``dead_letters`` table keeps the whole message)."""
DLQ_HEADER_ROOM_BYTES = 4096
"""Room kept for the dead letter's headers (reason, subject, sequence, message id) under the limit."""

_TRANSIENT = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    # What nats-py makes of "no responders" to a JetStream publish: in a cluster, the stream's leader is being
    # elected (a server was lost); the publish is retried, not dropped.
    nats.js.errors.NoStreamResponseError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
)


PERMISSION_VIOLATION = "permissions violation for publish to"
"""nats-py lower-cases the server's error text (the subject in it too)."""


class NotPermitted(PermissionError):
    """The NATS server refused a publish: this identity may not publish on that subject (not retried)."""


class StreamMissing(RuntimeError):
    """A stream this client needs does not exist, and only the admin identity may create it."""


class NotAuthorized(PermissionError):
    """The NATS server refused this client's credentials (or it presented none); the message says which."""


def connect_credentials(settings: BusSettings, url: str) -> dict[str, object]:
    """``nats.connect`` keyword arguments for ``settings``' identity and TLS: a Keel identity file gives user,
    password and the identity's inbox prefix (it may subscribe only below it); a ``.creds`` file is passed
    as NATS user credentials. Raises ``NotAuthorized`` for an identity file that cannot be used."""
    options: dict[str, object] = {}
    if settings.credentials is not None:
        path = settings.credentials
        if path.suffix == ".creds":
            options["user_credentials"] = str(path)
        else:
            try:
                identity = load_identity(path)
            except (OSError, NatsAuthError) as exc:
                raise NotAuthorized(f"NATS credentials {path}: {exc}") from exc
            options.update(user=identity.user, password=identity.password, inbox_prefix=identity.inbox_prefix)
    if any(server.startswith("tls://") for server in server_urls(url)) or settings.tls_cert:
        context = ssl.create_default_context(cafile=str(settings.tls_ca) if settings.tls_ca else None)
        if settings.tls_cert:
            context.load_cert_chain(str(settings.tls_cert), str(settings.tls_key) if settings.tls_key else None)
        options["tls"] = context
    return options


def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL: one, or several comma-separated (a cluster: ``nats://a:4222,nats://b:4222``)."""
    return [part.strip() for part in url.split(",") if part.strip()]


class PublishFailed(RuntimeError):
    """JetStream did not acknowledge a publish after every retry."""


class StreamFull(PublishFailed):
    """The events stream is at its limit and refuses new messages (discard-new): back-pressure. What it holds
    is not all recorded yet (the recorder purges what it has stored): keep the event and publish it later."""


JS_UNAVAILABLE_ERR_CODE = 10008
"""JetStream's "JetStream system temporarily unavailable" (503): a cluster without a meta leader for now."""

DUPLICATE_IN_PROCESS_ERR_CODE = 10158
"""JetStream's "duplicate message id is in process" (409): a retry met its first copy still being replicated (a
stream leader lost meanwhile); asked again, the answer is that copy's acknowledgement or a failure to retry."""


def _in_process(error: BaseException | None) -> bool:
    return isinstance(error, nats.js.errors.APIError) and getattr(error, "err_code", None) == \
        DUPLICATE_IN_PROCESS_ERR_CODE


STREAM_FULL_ERR_CODE = 10077
"""JetStream's "stream store failed" error code, which a full discard-new stream answers with ("maximum
bytes exceeded", "maximum messages exceeded")."""


def is_stream_full(error: BaseException) -> bool:
    """Whether ``error`` is JetStream refusing a publish because the stream is at its limit."""
    description = str(getattr(error, "description", "") or "")
    return (isinstance(error, nats.js.errors.APIError) and getattr(error, "err_code", None) == STREAM_FULL_ERR_CODE
            and "exceeded" in description)


@dataclass(frozen=True)
class PublishResult:
    stream_seq: int
    duplicate: bool


class _Outage:
    """One publish call's view of a lost connection: while the client is disconnected (it reconnects on
    its own), a failed attempt is not counted; the call waits for the connection instead, up to
    ``bus.outage_tolerance`` in all."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.started: float | None = None
        self.waited_s = 0.0
        self.gave_up = False

    async def wait_for_connection(self, what: str) -> bool:
        """True once the connection is back after having been down (retry without counting); False when
        it was up all along (count the attempt), or the tolerance ran out or the client was closed."""
        nc = self.bus.nc
        if nc.is_connected or nc.is_closed or self.gave_up:
            return False
        loop = asyncio.get_running_loop()
        tolerance_s = self.bus.settings.outage_tolerance.total_seconds()
        if self.started is None:
            self.started = loop.time()
            log.warning("publish of %s: NATS connection lost; waiting up to %g s for it to come back", what,
                        tolerance_s)
        while not nc.is_connected:
            if nc.is_closed or loop.time() - self.started > tolerance_s:
                self.gave_up = True
                self.waited_s = loop.time() - self.started
                return False
            await asyncio.sleep(0.1)
        self.waited_s = loop.time() - self.started
        log.warning("publish of %s: NATS connection back after %.1f s; retrying", what, self.waited_s)
        return True

    def describe(self) -> str:
        if self.started is None:
            return ""
        return f" (NATS unreachable for {self.waited_s:.0f} s; bus.outage_tolerance " \
               f"{self.bus.settings.outage_tolerance.total_seconds():g} s)"


class _Election:
    """One publish call's view of a stream without a leader: while a cluster elects the stream's leader (seconds,
    more than ten on a loaded host, after its server was lost or cut off; for as long as a quorum is missing)
    JetStream answers a publish at once with "no responders". Like a lost connection (``_Outage``), that is an
    outage of the stream, not a failed attempt: such attempts are not counted, up to ``bus.outage_tolerance``,
    retried at the back-off's pace (at most ``retry_backoff_max`` apart)."""

    def __init__(self, bus: Bus) -> None:
        self.budget_s = bus.settings.outage_tolerance.total_seconds()
        self.started: float | None = None

    def ride_out(self, error: BaseException | None, what: str) -> bool:
        """True when ``error`` is "no responders" (or JetStream "temporarily unavailable", which its API answers
        while the cluster's meta leader is elected) and the budget is not spent (retry uncounted)."""
        if not (isinstance(error, (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError))
                or (isinstance(error, nats.js.errors.ServiceUnavailableError)
                    and getattr(error, "err_code", None) == JS_UNAVAILABLE_ERR_CODE) or _in_process(error)):
            return False
        now = time.monotonic()
        if self.started is None:
            self.started = now
            log.warning("%s: the stream (or JetStream) has no leader for now (one is being elected?); retrying for "
                        "up to %g s", what, self.budget_s)
        return now - self.started < self.budget_s


@dataclass
class _Denial:
    """A publish in flight that the server may refuse: the task awaiting it, and whether it was refused."""

    task: asyncio.Task | None
    fired: bool = False


class Bus:
    """One connection to NATS plus the JetStream context, for one subject prefix."""

    def __init__(self, nc: NatsClient, settings: BusSettings, *, signing: Signing = NO_SIGNING) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=settings.publish_timeout.total_seconds())
        self.settings = settings
        self.signing = signing
        """The keys this connection signs with and the keyring its consumers check against."""
        self._stream_full_said = False
        self._denied: dict[str, _Denial] = {}
        """Lower-cased subjects a publish of this client is waiting on (nats-py reports refusals lower-cased)."""

    def note_denied(self, text: str) -> None:
        """The server's ``Permissions Violation for Publish to "<subject>"``: fail the publish waiting on it."""
        subject = text.lower().split(PERMISSION_VIOLATION, 1)[1].strip().strip("')").strip().strip('"')
        log.error("NATS refused a publish to %s: this identity may not publish there", subject)
        denial = self._denied.get(subject)
        if denial is not None and not denial.fired and denial.task is not None:
            denial.fired = True
            denial.task.cancel()  # _publish_checked turns this cancellation into NotPermitted

    async def _publish_checked(self, subject: str, data: bytes, headers: dict[str, str]) -> api.PubAck:
        """``js.publish``, awaited inline (not in a task of its own, so concurrent publishers keep their order);
        a publish the server refuses for permissions raises ``NotPermitted`` as soon as the server says so
        (its acknowledgement never comes: nats-py would wait out the timeout, and it is not retried)."""
        key = subject.lower()
        task = asyncio.current_task()
        denied = _Denial(task)
        self._denied[key] = denied
        try:
            return await self.js.publish(subject, data, headers=headers)
        except asyncio.CancelledError:
            if denied.fired and task is not None and task.uncancel() == 0:
                raise NotPermitted(f"NATS refused a publish to {subject}: this client's identity may not publish "
                                   "there (keel.infra.nats_auth)") from None
            raise
        finally:
            if self._denied.get(key) is denied:
                del self._denied[key]

    @classmethod
    async def connect(cls, url: str, settings: BusSettings, *, name: str = "keel", administer: bool = False,
                      signing: Signing = NO_SIGNING) -> Bus:
        """Connect (retrying while the server starts) and make sure both streams exist.

        Only an administering client (``keel migrate``, ``keel-migrate``, ``keel up``) changes an existing
        stream's settings to its own; any other client creates a missing stream but leaves an existing
        one as it is and warns about each setting that differs from its own (one ``keel approve`` from
        a laptop with default settings must not turn an R3 / 8 GiB production stream into R1 / 2 GiB)."""
        refused = asyncio.Event()
        refusals: list[Exception] = []
        buses: list[Bus] = []

        async def quiet_error(error: Exception) -> None:
            # nats-py logs every failed (re)connect with a traceback; callers report unreachability once.
            # A refusal of the credentials ends the connect (nats-py would retry it for ever); a refused
            # publish fails that publish at once instead of after every retry's timeout.
            text = str(error)
            if isinstance(error, nats.errors.AuthorizationError) or "authorization violation" in text.lower():
                refusals.append(error)
                refused.set()
            elif PERMISSION_VIOLATION in text.lower() and buses:
                buses[0].note_denied(text)
            log.debug("nats %s: %r", name, error)

        servers = server_urls(url)
        connecting = asyncio.ensure_future(nats.connect(
            servers if len(servers) > 1 else url,
            name=name,
            error_cb=quiet_error,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            connect_timeout=2,
            # A server that stops answering without closing the connection (a partitioned or frozen host) is
            # left for another of the cluster after this many unanswered pings at this interval.
            ping_interval=settings.ping_interval.total_seconds(),
            max_outstanding_pings=2,
            allow_reconnect=True,
            pending_size=64 * 1024 * 1024,
            **connect_credentials(settings, url),
        ))
        refusal = asyncio.ensure_future(refused.wait())
        await asyncio.wait({connecting, refusal}, return_when=asyncio.FIRST_COMPLETED)
        refusal.cancel()
        if not connecting.done():
            connecting.cancel()
            try:
                await connecting
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the refusal is what to report
                pass
            raise NotAuthorized(
                f"NATS at {url} refused {name}: {refusals[-1] if refusals else 'authorization violation'} "
                f"(credentials: {settings.credentials or 'none given'}). Set KEEL_BUS__CREDENTIALS to this "
                "process's identity file, or run it the way `keel up` does (docs/security.md)")
        nc = connecting.result()
        bus = cls(nc, settings, signing=signing)
        buses.append(bus)
        await bus.ensure_streams(administer=administer)
        return bus

    async def close(self) -> None:
        # Not drain(): draining waits on in-flight pull requests until their expiry.
        if not self.nc.is_closed:
            try:
                await self.nc.flush(timeout=2)
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError):
                pass
            try:
                await self.nc.close()
            except OSError as exc:  # the connection was lost under it (a NATS restart): closed all the same
                log.debug("closing the NATS connection: %r", exc)

    @property
    def events_subjects(self) -> str:
        return f"{self.settings.subject_prefix}.>"

    @property
    def dlq_prefix(self) -> str:
        return f"{self.settings.subject_prefix}_dlq"

    def subject_for(self, event: Event) -> str:
        """``<prefix>.<job>.<aggregate kind>.<aggregate id>.<type>``, the id encoded (``keel.infra.subjects``)."""
        return event_subject(self.settings.subject_prefix, event)

    async def ensure_streams(self, *, administer: bool = False) -> list[str]:
        """Create the events and dead-letter streams when missing; with ``administer``, also bring
        existing ones to these settings. Returns the differences found and left as they were."""
        s = self.settings
        left = await self._ensure_stream(
            api.StreamConfig(
                name=s.stream,
                subjects=[self.events_subjects],
                storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.LIMITS,
                max_age=s.max_age.total_seconds(),
                max_bytes=s.max_bytes,
                max_msg_size=NATS_MAX_PAYLOAD_BYTES,
                duplicate_window=s.duplicate_window.total_seconds(),
                discard=api.DiscardPolicy.NEW,
                num_replicas=s.replicas,
            ),
            administer,
        )
        left += await self._ensure_stream(
            api.StreamConfig(
                name=s.dlq_stream,
                subjects=[f"{self.dlq_prefix}.>"],
                storage=api.StorageType.FILE,
                discard=api.DiscardPolicy.OLD,
                max_age=s.max_age.total_seconds(),
                max_bytes=s.max_bytes,
                duplicate_window=s.duplicate_window.total_seconds(),
                num_replicas=s.replicas,
            ),
            administer,
        )
        return left

    async def _ensure_stream(self, config: api.StreamConfig, administer: bool) -> list[str]:
        if not config.name:  # stream_info raises the same for a nameless config; checked here so the name is a str
            raise ValueError("nats: stream name is required")
        try:
            existing = (await self.js.stream_info(config.name)).config
        except nats.js.errors.NotFoundError:
            try:
                await self.js.add_stream(config)
            except (*_TRANSIENT, nats.js.errors.APIError) as exc:
                if administer:
                    raise
                # Only the admin identity manages streams; a service or the CLI finds them made.
                raise StreamMissing(f"stream {config.name} does not exist and this client may not create it "
                                    f"({exc!r}): run `keel up` or `keel migrate` (the admin identity) first") from exc
            return []
        if administer:
            await self.js.update_stream(config)
            return []
        differences = stream_differences(existing, config)
        for difference in differences:
            log.warning("stream %s: %s; left as it is (only `keel migrate` changes stream settings)",
                        config.name, difference)
        return differences

    # -- publishing ----------------------------------------------------------------------------

    async def publish(self, event: Event) -> PublishResult:
        """Publish one event (signed when it must be) and wait for its acknowledgement (retrying transient errors)."""
        event = self.signing.sign(event)
        return await self.publish_raw(self.subject_for(event), event.to_json(), msg_id=str(event.id))

    async def publish_raw(self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str] | None = None) -> PublishResult:
        """Publish bytes as they are (tests and the dead-letter path use this directly)."""
        all_headers = {api.Header.MSG_ID: msg_id, **(headers or {})}
        delay_s = self.settings.retry_backoff_initial.total_seconds()
        last_error: BaseException | None = None
        attempt = 0
        outage = _Outage(self)
        election = _Election(self)
        while attempt < self.settings.publish_attempts:
            try:
                ack = await self._publish_checked(subject, data, all_headers)
                if self._stream_full_said:
                    self._stream_full_ended()
                return PublishResult(ack.seq, bool(ack.duplicate))
            except (*_TRANSIENT, nats.js.errors.APIError) as exc:
                if not isinstance(exc, _TRANSIENT) and not _in_process(exc):
                    raise
                last_error = exc
                if not is_stream_full(exc) and await outage.wait_for_connection(subject):
                    continue  # the connection was down: that attempt does not count
                if election.ride_out(exc, f"publish to {subject}"):
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, self.settings.retry_backoff_max.total_seconds())
                    continue
                attempt += 1
                if is_stream_full(exc):
                    self._note_stream_full(subject)
                else:
                    log.warning("publish to %s failed (attempt %d): %r", subject, attempt, exc)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, self.settings.retry_backoff_max.total_seconds())
        if last_error is not None and is_stream_full(last_error):
            raise StreamFull(self._stream_full_text(subject, self.settings.publish_attempts))
        raise PublishFailed(f"publish to {subject} not acknowledged after {self.settings.publish_attempts} attempts"
                            f"{outage.describe()}: {last_error!r}")

    async def _probe(self, event: Event) -> tuple[PublishResult | None, bool]:
        """Publish one event synchronously: (its result, or None; whether a full stream refused it)."""
        try:
            ack = await self.js.publish(self.subject_for(event), event.to_json(),
                                        headers={api.Header.MSG_ID: str(event.id)})
            return PublishResult(ack.seq, bool(ack.duplicate)), False
        except _TRANSIENT as exc:
            return None, is_stream_full(exc)
        except nats.js.errors.APIError:
            return None, False

    def _stream_full_text(self, subject: str, attempts: int) -> str:
        return (f"stream {self.settings.stream} is full (it discards new messages, never unrecorded ones): publish to "
                f"{subject} refused {attempts} times; is the recorder running and keeping up? Keep the event and "
                "retry later")

    def _stream_full_ended(self) -> None:
        self._stream_full_said = False
        log.warning("stream %s accepts events again", self.settings.stream)

    def _note_stream_full(self, subject: str) -> None:
        """Back-pressure, said once per episode (a publish that goes through ends it), and counted."""
        STREAM_FULL_REFUSALS.inc()
        if not self._stream_full_said:
            self._stream_full_said = True
            log.error("stream %s is full: JetStream refuses new events (discard-new) until the recorder has stored and "
                      "purged older ones; publishers back off and keep what they could not publish (first: %s)",
                      self.settings.stream, subject)

    async def publish_many(self, events: Sequence[Event], *, max_in_flight: int = 256) -> list[PublishResult]:
        """Publish many events with up to ``max_in_flight`` unacknowledged; returns once all are acked.

        A sliding window: the next event goes out as soon as any acknowledgement comes back. An
        acknowledgement that does not come within ``publish_timeout`` counts as a failure; failures
        are retried as a group with backoff, then raised as ``PublishFailed``. Each event is signed when it
        must be (``Signing.sign``).
        """
        if self.signing.keys:
            events = [self.signing.sign(event) for event in events]
        results: list[PublishResult | None] = [None] * len(events)
        pending = list(range(len(events)))
        timeout_s = self.settings.publish_timeout.total_seconds()
        delay_s = self.settings.retry_backoff_initial.total_seconds()
        prefix = self.settings.subject_prefix
        msg_id = api.Header.MSG_ID
        full = False
        outage = _Outage(self)
        election = _Election(self)
        attempt = 0
        while attempt < self.settings.publish_attempts:
            attempt += 1
            if full:  # the last round met a full stream: ask with one event before sending them all again
                result, full = await self._probe(events[pending[0]])
                if result is not None:
                    results[pending[0]] = result
                    pending = pending[1:]
                if full or not pending:
                    if not pending:
                        return [r for r in results if r is not None]
                    self._note_stream_full(event_subject(prefix, events[pending[0]]))
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, self.settings.retry_backoff_max.total_seconds())
                    continue
            failed: list[int] = []
            full = False
            no_leader: BaseException | None = None
            slots = asyncio.Semaphore(max_in_flight)
            in_flight: dict[asyncio.Future, int] = {}

            def release(_future: asyncio.Future, slots: asyncio.Semaphore = slots) -> None:
                slots.release()

            for index in pending:
                if slots.locked():
                    try:
                        await asyncio.wait_for(slots.acquire(), timeout_s)
                    except TimeoutError:
                        break  # acknowledgements stopped coming: settle below, retry the rest
                else:
                    await slots.acquire()
                event = events[index]
                try:
                    future = await self.js.publish_async(
                        event_subject(prefix, event),
                        event.to_json(),
                        headers={msg_id: str(event.id)},
                    )
                except _TRANSIENT:
                    slots.release()
                    failed.append(index)
                    continue
                future.add_done_callback(release)
                in_flight[future] = index
            sent = set(in_flight.values()) | set(failed)
            failed += [index for index in pending if index not in sent]
            if in_flight:
                done, not_done = await asyncio.wait(in_flight, timeout=timeout_s)
                for future in not_done:
                    future.cancel()
                    failed.append(in_flight[future])
                for future in done:
                    error = future.exception()
                    if error is None:
                        ack = future.result()
                        results[in_flight[future]] = PublishResult(ack.seq, bool(ack.duplicate))
                    elif isinstance(error, (*_TRANSIENT, nats.js.errors.APIError)):
                        failed.append(in_flight[future])
                        full = full or is_stream_full(error)
                        if isinstance(error, (nats.js.errors.NoStreamResponseError,
                                              nats.js.errors.ServiceUnavailableError)) or _in_process(error):
                            no_leader = error
                    else:
                        raise error
                if not_done and not full:
                    # nats-py never resolves an asynchronous publish that JetStream answers with an error
                    # (its reply handler raises instead of failing the future): ask with one event, whose
                    # synchronous publish does say why (a full stream, typically).
                    first = min(in_flight[future] for future in not_done)
                    result, full = await self._probe(events[first])
                    if result is not None:
                        results[first] = result
                        failed.remove(first)
            if not failed:
                if self._stream_full_said:
                    self._stream_full_ended()
                return [r for r in results if r is not None]
            pending = sorted(failed)
            if not full and await outage.wait_for_connection(f"{len(pending)} events"):
                attempt -= 1  # the connection was down: that attempt does not count
                continue
            if not full and election.ride_out(no_leader, f"publish of {len(pending)} events"):
                attempt -= 1  # the stream's leader is being elected: not counted either (within its budget)
            if full:
                self._note_stream_full(event_subject(prefix, events[failed[0]]))
            else:
                log.warning("%d of %d publishes not acknowledged (attempt %d); retrying", len(failed), len(events),
                            attempt)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, self.settings.retry_backoff_max.total_seconds())
        if full:
            raise StreamFull(self._stream_full_text(f"{len(pending)} events", self.settings.publish_attempts))
        raise PublishFailed(f"{len(pending)} events not acknowledged after {self.settings.publish_attempts} attempts"
                            f"{outage.describe()}")

    # -- consuming -----------------------------------------------------------------------------

    async def consumer_ack_floor(self, durable: str) -> int | None:
        """The stream sequence up to which ``durable`` has acknowledged every message (its ack floor), or
        None when there is no such consumer (never created, or gone with the stream it was on)."""
        try:
            info = await self.js.consumer_info(self.settings.stream, durable)
        except nats.js.errors.NotFoundError:
            return None
        return int(info.ack_floor.stream_seq) if info.ack_floor is not None else 0

    async def stream_bounds(self) -> tuple[int, int]:
        """``(first_seq, last_seq)`` of the events stream as it is now (``(1, 0)`` or so when empty)."""
        state = (await self.js.stream_info(self.settings.stream)).state
        return int(state.first_seq), int(state.last_seq)

    async def stream_holds(self, seq: int, event_id: uuid.UUID) -> bool:
        """Whether the events stream's message ``seq`` is event ``event_id``: how a cold start tells that
        the log's newest sequences belong to this stream and not to one deleted and recreated since (a
        recreated stream numbers its messages from 1 again). A message retention has already removed
        (``seq`` below the first) counts as held: only a reset makes the stream younger than the log."""
        first, last = await self.stream_bounds()
        if seq > last:
            return False
        if seq < first:
            return True
        try:
            message = await self.js.get_msg(self.settings.stream, seq)
        except nats.js.errors.NotFoundError:
            return False
        headers = message.headers or {}
        return headers.get(api.Header.MSG_ID) == str(event_id)


    async def pull_consumer(
        self,
        durable: str,
        *,
        filter_subject: str | None = None,
        filter_subjects: list[str] | None = None,
        ack_all: bool = False,
        max_deliver: int | None = None,
        max_ack_pending: int = 20_000,
        inactive_threshold: timedelta | None = None,
    ) -> BatchPuller:
        """A durable pull consumer on the events stream (created if missing, from the first message).

        ``filter_subjects``: several subjects (NATS 2.10+), instead of one ``filter_subject``.
        ``max_deliver`` bounds redelivery (``-1``: unbounded, for the recorder, which must never give
        up on an event); by default ``BusSettings.max_deliver``. ``inactive_threshold``: the server
        removes the consumer after this long with no client (per-node consumers); None keeps it for ever.
        A durable name NATS cannot take (``.``, ``*``, ``>``, whitespace) is refused here, loudly.
        """
        if not durable or any(c in durable for c in ".*> \t\r\n"):
            raise ValueError(f"invalid durable consumer name {durable!r}: no '.', '*', '>' or whitespace")
        config = api.ConsumerConfig(
            durable_name=durable,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.ALL if ack_all else api.AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait.total_seconds(),
            max_deliver=self.settings.max_deliver if max_deliver is None else max_deliver,
            filter_subject=None if filter_subjects else (filter_subject or self.events_subjects),
            filter_subjects=filter_subjects or None,
            max_ack_pending=max_ack_pending,
            inactive_threshold=inactive_threshold.total_seconds() if inactive_threshold else None,
        )
        delay_s = self.settings.retry_backoff_initial.total_seconds()
        election = _Election(self)
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.js.add_consumer(self.settings.stream, config)  # idempotent for the same config
                break
            except nats.js.errors.BadRequestError as exc:
                # It exists with another configuration (say an older ack_wait). Recreating it would lose
                # its position, so keep it and say so.
                log.warning("consumer %s exists with other settings (%s); using it as it is", durable, exc.description)
                break
            except _TRANSIENT as exc:
                # A cluster electing a leader answers "JetStream system temporarily unavailable" (503) for a while.
                if election.ride_out(exc, f"consumer {durable}"):
                    attempt -= 1
                elif attempt >= self.settings.publish_attempts:
                    raise
                log.warning("creating consumer %s failed (attempt %d): %r; retrying", durable, attempt, exc)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, self.settings.retry_backoff_max.total_seconds())
        puller = BatchPuller(self.nc, self.settings.stream, durable)
        await puller.start()
        return puller

    async def dead_letter(self, msg: Msg, reason: str) -> PublishResult:
        """Copy ``msg`` (raw bytes) to the dead-letter stream with the reason; the caller then acks it.

        The dead letter's subject is the original one with ``<prefix>_dlq`` for ``<prefix>``
        (``keel_dlq.<job>.<kind>.<aggregate id>.<type>`` for a well-formed one), tokens as they were: a
        malformed message's subject need not follow the event rule, so it is not parsed."""
        seq = msg.metadata.sequence.stream if msg.reply else 0
        tail = msg.subject.split(".", 1)[1] if "." in msg.subject else msg.subject
        headers = {
            HEADER_DLQ_REASON: reason[:1000].replace("\r", " ").replace("\n", " "),
            HEADER_DLQ_SUBJECT: msg.subject[:1000],
            HEADER_DLQ_STREAM_SEQ: str(seq),
        }
        # The copy must fit where the original only just did: a message near the payload limit grows
        # past it with these headers, and a dead letter that cannot be published would stop its
        # consumer on the very message it carries. Cut the copy to fit and say so.
        data = msg.data
        room = min(NATS_MAX_PAYLOAD_BYTES, self.nc.max_payload or NATS_MAX_PAYLOAD_BYTES) - DLQ_HEADER_ROOM_BYTES
        if len(data) > room:
            headers[HEADER_DLQ_TRUNCATED] = str(len(data))
            data = data[:room]
        return await self.publish_raw(f"{self.dlq_prefix}.{tail}", data, msg_id=f"dlq-{self.settings.stream}-{seq}",
                                      headers=headers)


_COMPARED_STREAM_SETTINGS = ("subjects", "max_age", "max_bytes", "max_msg_size", "duplicate_window", "num_replicas",
                             "discard", "storage")


def stream_differences(existing: api.StreamConfig, wanted: api.StreamConfig) -> list[str]:
    """The settings in which an existing stream differs from this client's, one line each (pure)."""
    lines = []
    for name in _COMPARED_STREAM_SETTINGS:
        have, want = getattr(existing, name), getattr(wanted, name)
        if want is not None and have != want:
            lines.append(f"{name} is {have!r} on the server, {want!r} in this client's settings")
    return lines


class BatchPuller:
    """Pulls batches from a durable JetStream consumer with one inbox subscription.

    nats-py's ``PullSubscription.fetch`` waits for each message through its own task and costs about
    90 µs of CPU per message here, more than everything else the recorder does. This puller sends the
    pull requests itself (the JetStream API: ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``) and
    collects deliveries in a callback:

    1. a ``no_wait`` request for up to ``batch`` messages returns what is there at once;
    2. only when nothing was there, a long poll for *one* message (``expires`` = the timeout), so the
       call returns as soon as anything arrives, then another ``no_wait`` request for the rest.

    Deliveries that arrive after a call returned (a long poll answered late) are kept for the next
    call, never dropped. Messages are nats-py ``Msg`` objects: ``ack()``/``nak()``/``term()`` work.
    """

    def __init__(self, nc: NatsClient, stream: str, durable: str) -> None:
        self._nc = nc
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = ""
        self._buffer: list[Msg] = []
        self._arrived = asyncio.Event()
        self._request_done = asyncio.Event()
        self._target = 0
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_message, pending_msgs_limit=-1,
                                             pending_bytes_limit=-1)

    async def _on_message(self, msg: Msg) -> None:
        if not msg.reply:  # a status: 404 no messages, 408 request expired, 409 ...; 100 heartbeat
            status = msg.headers.get(api.Header.STATUS, "") if msg.headers else ""
            if status != "100":
                self._request_done.set()
            return
        self._buffer.append(msg)
        self._arrived.set()
        if len(self._buffer) >= self._target:  # a fully served request ends without a status
            self._request_done.set()

    async def _request(self, batch: int, *, no_wait: bool, expires_s: float | None = None) -> None:
        request: dict[str, object] = {"batch": batch}
        if no_wait:
            request["no_wait"] = True
        if expires_s is not None:
            request["expires"] = int(expires_s * 1_000_000_000)
        self._request_done.clear()
        self._target = len(self._buffer) + batch
        await self._nc.publish(self._api, json.dumps(request).encode(), reply=self._inbox)

    async def _wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def fetch(self, batch: int, timeout_s: float) -> list[Msg]:
        """Up to ``batch`` messages; ``[]`` when none arrived within ``timeout_s``.

        While the connection is down no pull request is sent (the client would buffer every one and flush
        them all on reconnect, each asking for a batch the consumer then cannot work off within
        ``ack_wait``): the call waits out the timeout and returns what is buffered."""
        if not self._buffer and not self._nc.is_connected:
            await asyncio.sleep(timeout_s)
            return []
        if not self._buffer:
            await self._request(batch, no_wait=True)
            await self._wait(self._request_done, timeout_s)
        if not self._buffer:
            self._arrived.clear()
            await self._request(1, no_wait=False, expires_s=timeout_s)
            if await self._wait(self._arrived, timeout_s + 0.05) and len(self._buffer) < batch:
                await self._request(batch - len(self._buffer), no_wait=True)
                await self._wait(self._request_done, timeout_s)
        taken, self._buffer = self._buffer[:batch], self._buffer[batch:]
        return taken

    async def unsubscribe(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


def stream_sequence(msg: Msg) -> int:
    """The stream sequence of a JetStream delivery, read from its reply subject.

    Cheaper than ``msg.metadata`` (which parses everything on every access). Reply subjects are
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...`` or, with a domain and account hash,
    ``$JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<stream seq>...``.
    """
    tokens = msg.reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])


def delivery_info(msg: Msg) -> tuple[int, int, int]:
    """(stream sequence, arrival in the stream in ns since the epoch, messages pending after it for this
    consumer) of a JetStream delivery, read from its reply subject like ``stream_sequence``:
    ``...<stream seq>.<consumer seq>.<timestamp ns>.<pending>`` (then a random token with a domain)."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[7]), int(tokens[8])
    return int(tokens[7]), int(tokens[9]), int(tokens[10])


async def fetch_batch(sub: BatchPuller | JetStreamContext.PullSubscription, batch: int, timeout_s: float) -> list[Msg]:
    """Fetch up to ``batch`` messages; an empty list when none arrived within ``timeout_s``."""
    if isinstance(sub, BatchPuller):
        return await sub.fetch(batch, timeout_s)
    try:
        return await sub.fetch(batch, timeout=timeout_s)
    except (TimeoutError, nats.errors.TimeoutError):
        return []
