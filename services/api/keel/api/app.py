"""The API's routes (adapter): FastAPI over the event store, read as the ``auditor`` role.

Every route answers what a reporting command answers, from the same functions (``keel.reports.incidents``,
``keel.reports.audit``), so the API and the CLI cannot disagree:

=====================================  ==============================  ===========================
route                                  what                            the command
=====================================  ==============================  ===========================
``GET /healthz``                       liveness (no token)             -
``GET /v1/jobs``                       jobs in the log, first / last   ``keel ettr`` (its jobs)
``GET /v1/incidents``                  the controller's incidents      ``keel incidents --json``
``GET /v1/incidents/{ref}/timeline``   one incident, every event       ``keel timeline --json``
``GET /v1/jobs/{job}/ettr``            cumulative and window ETTR      ``keel ettr --job --json``
``GET /v1/jobs/{job}/ettr/series``     both over time (a chart's)      -
``GET /v1/audit/<view>``               an audit view, filtered         ``keel audit --format json``
``GET /v1/nodes``                      each node's last known health   -
``GET /v1/events``                     the log, paged by position      ``keel events``
``POST /v1/approvals/{request_id}``    an operator's answer            ``keel approve`` / ``deny``
``POST /v1/nodes/{node_id}/cordon``    an operator takes a node out    ``keel cordon``
``POST /v1/nodes/{node_id}/uncordon``  ... or puts it back             ``keel uncordon``
``POST /v1/chatops/slack``             Slack's Approve / Deny buttons  ``keel approve`` / ``deny``
``POST /v1/chatops/callback/{name}``   a tool's signed answer          ``keel approve`` / ``deny``
=====================================  ==============================  ===========================

Errors are JSON ``{"detail": ...}``: 401 without a known token, 403 for a token whose scope does not
allow the route, 404 for an id or job the log does not hold, 422 for a parameter that cannot be used (with
the reason). Nothing is written to the store. The actions (``keel.api.actions``) need an ``operator`` token:
each publishes one event on the bus, signed by the token's operator identity. The chat-ops routes (``keel.api.chatops``, served only when
``api.chatops`` is configured) take no token: each request's signature authenticates it, and an answer is
published on the bus signed by the API's ``chatops`` key.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from enum import Enum
from importlib import resources
from typing import Annotated, Any, Literal

import asyncpg  # type: ignore[import-untyped]  # no stubs: its two exception bases only
import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.ext.asyncio import AsyncEngine

import keel.events.types  # noqa: F401 - registers the event types the store decodes
from keel.api.actions import Actions, Refused
from keel.api.chatops import ChatOps
from keel.events.envelope import JOB_ID_RE, REGISTRY
from keel.events.units import parse_duration
from keel.infra.api_auth import OPERATOR, READ, ApiToken, Forbidden, Unauthorized, authenticate, authorize
from keel.infra.store import EventStore, node_status_table
from keel.notifier.chatops import MAX_BODY_BYTES
from keel.reports.audit import VIEWS, AuditInputError, AuditQuery, rows_json
from keel.reports.incidents import (
    SUMMARY_TYPES,
    BadInput,
    LookupFailed,
    ettr_json,
    load_ettr,
    load_incident_page,
    load_job_spans,
    load_timeline,
    timeline_json,
)

log = logging.getLogger("keel.api")

API_VERSION = "1"
_ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"detail": {}}}}}}
ERRORS: dict[int | str, dict[str, Any]] = {401: {"description": "no known token", **_ERROR},
                                           403: {"description": "the token's scope does not allow this", **_ERROR},
                                           422: {"description": "a parameter cannot be used: the reason", **_ERROR}}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "the log holds no such thing", **_ERROR}}

DURATION_PATTERN = r"^0{0,3}[1-9][0-9]{0,4}(\.[0-9]{1,3})?(ms|s|m|h|d)$"
"""A positive duration with its unit, as ``keel.events.units.parse_duration`` reads it (at most 99,999 units)."""
MAX_SERIES_POINTS = 2000
"""The most instants one ETTR series holds (each costs a pass over the job's incidents)."""
PAGE_CACHE_ENTRIES = 256
"""Pages of incidents kept with the log position they were read at (per process)."""
MAX_POSITION = 2**63 - 1
"""The largest log position (a PostgreSQL ``bigint``)."""
EventType = Enum("EventType", {name: name for name in REGISTRY.names()}, type=str)  # type: ignore[misc]

PRINTABLE = r"^[^\x00-\x1f\x7f]{1,200}$"
"""Free text filters: no control characters (PostgreSQL text holds no NUL), at most 200 characters."""
JobFilter = Annotated[str | None, Query(pattern=JOB_ID_RE.pattern, description="one training job")]
NodeFilter = Annotated[str | None, Query(pattern=PRINTABLE, description="one node (incidents: its node or one it "
                                                                        "evicted)")]
KindFilter = Annotated[str | None, Query(pattern=PRINTABLE, description="an incident's kind (crash, hang, ...), else "
                                                                        "the event type")]
Since = Annotated[datetime | None, Query(description="from this time (RFC 3339; UTC when it names no zone)")]
Until = Annotated[datetime | None, Query(description="until this time, exclusive")]
Last = Annotated[str | None, Query(pattern=DURATION_PATTERN, description="only the last 7d, 12h, ... (with since: "
                                                                          "the later of the two)")]
Limit = Annotated[int, Query(ge=1, le=100_000, description="at most this many (capped at api.max_page)")]


TEXT = r"^[^\x00-\x08\x0b-\x1f\x7f]*$"
"""An operator's free text (a comment, a reason): no control character but tab and newline (the log is JSON in
PostgreSQL, which holds no NUL)."""
NODE_ID = r"^[A-Za-z0-9_.:-]{1,128}$"
"""A node id, as an event's subject takes it (``keel.events.envelope.SUBJECT_RE``)."""


class ApprovalDecision(BaseModel):
    """An operator's answer to an approval request."""

    model_config = ConfigDict(extra="forbid")
    decision: Literal["approve", "deny"] = Field(description="approve: the held action is carried out; deny: it is not")
    comment: str = Field("", max_length=1000, pattern=TEXT, description="recorded with the answer")


class CordonRequest(BaseModel):
    """An operator's cordon (or uncordon) of a node."""

    model_config = ConfigDict(extra="forbid")
    reason: str = Field("", max_length=1000, pattern=TEXT, description="why (a cordon needs one)")
    job: str | None = Field(None, pattern=JOB_ID_RE.pattern,
                            description="the node's job (default: the one job the log has the node in)")


_UNPUBLISHED = (503, "not published (the bus did not acknowledge it, or the API has no operator actions); try again")
APPROVAL_ANSWERS: dict[int | str, dict[str, Any]] = {
    **ERRORS, **{status: {"description": what, **_ERROR} for status, what in (
        (404, "the log holds no such approval request"),
        (409, "the request was already answered (by whom, in the reason)"),
        (410, "the approval request expired"), _UNPUBLISHED)}}
CORDON_ANSWERS: dict[int | str, dict[str, Any]] = {
    **ERRORS, **{status: {"description": what, **_ERROR} for status, what in (
        (404, "the log (or the job named) holds no event about this node"),
        (409, "the bus already holds this event"), _UNPUBLISHED)}}


def create_app(engine: AsyncEngine, tokens: Sequence[ApiToken], *, max_page: int = 1000,
               store_engine: AsyncEngine | None = None, parsed_events_kept: int = 5_000,
               chatops: Callable[[EventStore], ChatOps] | None = None,
               actions: Callable[[EventStore], Actions] | None = None) -> FastAPI:
    """The API over ``engine`` (the event store, as the auditor), for callers holding one of ``tokens``.
    ``store_engine``: the engine of the ``EventStore``'s listing reads (``EventStore.fetch_engine``: pages and
    timelines), when not ``engine``.
    ``parsed_events_kept``: ``EventStore.parsed_kept`` (``api.parsed_events_kept``).
    ``chatops``: makes the chat-ops approvals' handler over the store (``keel.api.chatops``); None: not served.
    ``actions``: makes the operator actions' handler over the store (``keel.api.actions``); None: the action
    routes answer an operator token 503 (their spec is the same either way)."""
    app = FastAPI(title="Keel API", version=API_VERSION, docs_url=None, redoc_url=None,
                  description="Incidents, timelines, ETTR, audit views and the event log of Keel; approvals and "
                              "cordons for operator tokens.")
    store = EventStore(engine, fetch_engine=store_engine)
    store.parsed_kept = parsed_events_kept
    bearer = HTTPBearer(auto_error=False, description="a token of api.tokens (keel-api --new-token NAME makes one)")

    bearer_credentials = Depends(bearer)

    def caller(needed: str) -> Callable[..., ApiToken]:
        # Default-value style: these annotations are strings (``from __future__``) that FastAPI resolves in the
        # module's globals, where the local ``bearer`` is not.
        def check(credentials: HTTPAuthorizationCredentials | None = bearer_credentials) -> ApiToken:
            try:
                token = authenticate(credentials.credentials if credentials else None, tokens)
                authorize(token, needed)
            except Unauthorized as exc:
                raise HTTPException(401, str(exc), headers={"WWW-Authenticate": "Bearer"}) from None
            except Forbidden as exc:
                raise HTTPException(403, str(exc)) from None
            return token
        return check

    reader = Depends(caller(READ))  # every route's token check: a read scope at least
    operator = Depends(caller(OPERATOR))  # the actions': an operator token

    async def answer(work: Awaitable[Any]) -> Any:
        """Run a query; the reporting functions' lookup and input errors become 404 and 422."""
        try:
            return await work
        except LookupFailed as exc:
            raise HTTPException(404, str(exc)) from None
        except (BadInput, AuditInputError) as exc:
            raise HTTPException(422, str(exc)) from None

    @app.exception_handler(sa.exc.SQLAlchemyError)
    @app.exception_handler(ConnectionError)  # the store's every pooled connection closed (EventStore._fetch)
    @app.exception_handler(asyncpg.PostgresError)
    @app.exception_handler(asyncpg.InterfaceError)
    async def store_unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s: the event store failed: %s", request.method, request.url.path, exc.__class__.__name__)
        return JSONResponse({"detail": "the event store could not answer; try again"}, status_code=503)

    # The page (no data in it: its script reads the routes below with the tab's token). Not in the spec.
    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return _page_file("index.html", "text/html; charset=utf-8")

    @app.get("/ui/{name}", include_in_schema=False)
    async def page_asset(name: str) -> Response:
        if name not in PAGE_ASSETS:
            raise HTTPException(404, f"no page asset {name!r}")
        return _page_file(name, PAGE_ASSETS[name])

    @app.get("/healthz", summary="liveness: the process answers (no token needed, nothing read)")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/jobs", responses=ERRORS, summary="the training jobs in the log, with their first and last event")
    async def jobs(_: ApiToken = reader) -> dict[str, Any]:
        spans = await load_job_spans(engine)
        return {"jobs": [{"job_id": job, "first_event_at": first.isoformat(), "last_event_at": last.isoformat()}
                         for job, first, last in spans]}

    # A page of incidents, as answered, with the log position it was read at: the page stays true until an event
    # of the types it summarizes is appended (of its job), which one index step per type tells. The people on
    # call poll the same page, and incidents are rare next to polls. Bounded: the oldest entry goes first.
    pages: OrderedDict[tuple[str | None, int | None, int], tuple[int, bytes]] = OrderedDict()
    totals: dict[str | None, tuple[int, int]] = {}  # a job's incident count, with the log position it was read at

    # The two routes an on-call person's page polls answer with their JSON as built (plain values already): FastAPI's
    # own encoding of the returned dict walked every value again (7 ms for a page of 100 incidents, here).
    @app.get("/v1/incidents", responses=ERRORS, response_model=dict[str, Any],
             summary="the controller's incidents, newest first, paged: pass the answer's next_before for older ones")
    async def incidents(job: JobFilter = None,
                        before: Annotated[int | None, Query(ge=1, le=MAX_POSITION,
                                                            description="only incidents opened before this log "
                                                                        "position (a page's next_before)")] = None,
                        limit: Limit = 100, _: ApiToken = reader) -> Response:
        key = (job, before, min(limit, max_page))
        mark = await store.newest_position(types=SUMMARY_TYPES, job_id=job)  # read before the page: never stale
        cached = pages.get(key)
        if cached is not None and cached[0] == mark:
            pages.move_to_end(key)
            return Response(cached[1], media_type="application/json")
        counted = totals.get(job)
        page = await load_incident_page(store, job, limit=key[2], before=before,
                                        total=counted[1] if counted is not None and counted[0] == mark else None)
        if len(totals) >= PAGE_CACHE_ENTRIES and job not in totals:
            totals.clear()  # as many jobs asked for as pages kept: start again
        totals[job] = (mark, page.total)
        answer = JSONResponse(page.to_json())
        pages[key] = (mark, bytes(answer.body))
        if len(pages) > PAGE_CACHE_ENTRIES:
            pages.popitem(last=False)
        return answer

    @app.get("/v1/incidents/{ref}/timeline", responses={**ERRORS, **NOT_FOUND}, response_model=dict[str, Any],
             summary="every event of one incident (its id or a unique prefix of 6+ characters), with the reasons")
    async def timeline(ref: Annotated[str, Path(pattern=r"^[0-9a-fA-F-]{6,36}$", description="the incident's id or a "
                                                "prefix of 6 or more of its characters")], job: JobFilter = None,
                       _: ApiToken = reader) -> Response:
        return JSONResponse(timeline_json(await answer(load_timeline(store, ref, job))))

    @app.get("/v1/jobs/{job_id}/ettr", responses={**ERRORS, **NOT_FOUND},
             summary="the job's ETTR: cumulative, the sliding window, lost time by incident and phase")
    async def ettr(job_id: Annotated[str, Path(pattern=JOB_ID_RE.pattern)],
                   window: Annotated[str, Query(pattern=DURATION_PATTERN,
                                                description="the sliding window, with its unit: 1h, 30m")] = "1h",
                   _: ApiToken = reader) -> dict[str, Any]:
        width = _duration(window, "window")
        [(_name, report)] = await answer(load_ettr(store, job_id, width))
        if report is None:
            return {"job_id": job_id, "cumulative": None, "window": None}
        return ettr_json(report)

    @app.get("/v1/jobs/{job_id}/ettr/series", responses={**ERRORS, **NOT_FOUND},
             summary="the job's ETTR over time: cumulative and the sliding window at evenly spread instants")
    async def ettr_series(job_id: Annotated[str, Path(pattern=JOB_ID_RE.pattern)],
                          window: Annotated[str, Query(pattern=DURATION_PATTERN,
                                                       description="the sliding window, with its unit: 1h, 30m")] = "1h",
                          points: Annotated[int, Query(ge=2, le=MAX_SERIES_POINTS,
                                                       description="how many instants, the first and last included")] = 200,
                          _: ApiToken = reader) -> dict[str, Any]:
        width = _duration(window, "window")
        [(_name, report)] = await answer(load_ettr(store, job_id, width))
        series = [] if report is None else [p.to_json() for p in report.report.series(points, width)]
        return {"job_id": job_id, "window_s": width.total_seconds(), "points": series}

    async def audit_rows(view: str, since: datetime | None, until: datetime | None, last: str | None, job: str | None,
                         node: str | None, kind: str | None, limit: int) -> dict[str, Any]:
        now = datetime.now(UTC)
        starts = [_aware(since)] if since else []
        if last is not None:
            starts.append(now - _duration(last, "last"))
        begin, end = (max(starts) if starts else None), (_aware(until) if until else None)
        if begin is not None and end is not None and begin >= end:
            return {**rows_json(view, []), "truncated": False}  # an empty window holds nothing
        try:
            query = AuditQuery(view=view, job=job, node=node, kind=kind, limit=min(limit, max_page), since=begin, until=end)
        except AuditInputError as exc:
            raise HTTPException(422, str(exc)) from None
        text, params = query.sql()
        async with engine.connect() as conn:
            result = await conn.execute(sa.text(text), params)
            columns = list(result.keys())
            rows = [dict(zip(columns, row, strict=True)) for row in result.all()]
        return {**rows_json(view, rows), "truncated": len(rows) == query.limit}

    # One route per audit view, each declaring only the filters its view has (the spec says exactly what works).
    for view, spec in VIEWS.items():
        summary = f"the {view} audit view ({spec.relation}), oldest first: ``keel audit {view}``"
        if spec.node is not None and spec.kind is not None:
            async def with_node_and_kind(since: Since = None, until: Until = None, last: Last = None, job: JobFilter = None,
                                         node: NodeFilter = None, kind: KindFilter = None, limit: Limit = 100,
                                         _: ApiToken = reader, view: str = view) -> dict[str, Any]:
                return await audit_rows(view, since, until, last, job, node, kind, limit)
            route: Callable[..., Awaitable[dict[str, Any]]] = with_node_and_kind
        elif spec.node is not None:
            async def with_node(since: Since = None, until: Until = None, last: Last = None, job: JobFilter = None,
                                node: NodeFilter = None, limit: Limit = 100, _: ApiToken = reader,
                                view: str = view) -> dict[str, Any]:
                return await audit_rows(view, since, until, last, job, node, None, limit)
            route = with_node
        else:
            async def with_kind(since: Since = None, until: Until = None, last: Last = None, job: JobFilter = None,
                                kind: KindFilter = None, limit: Limit = 100, _: ApiToken = reader,
                                view: str = view) -> dict[str, Any]:
                return await audit_rows(view, since, until, last, job, None, kind, limit)
            route = with_kind
        _hide_parameter(route, "view")
        app.get(f"/v1/audit/{view}", responses=ERRORS, summary=summary, name=f"audit_{view}")(route)

    @app.get("/v1/nodes", responses=ERRORS, summary="each node's last known health, from the recorder's read model")
    async def nodes(job: JobFilter = None, _: ApiToken = reader) -> dict[str, Any]:
        t = node_status_table.c
        query = sa.select(t.job_id, t.node_id, t.health, t.detail, t.evicted, t.updated_at).order_by(t.job_id, t.node_id)
        if job is not None:
            query = query.where(t.job_id == job)
        async with engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return {"nodes": [{"job_id": r.job_id, "node_id": r.node_id, "health": r.health, "detail": r.detail,
                           "evicted": r.evicted, "updated_at": r.updated_at.isoformat()} for r in rows]}

    @app.get("/v1/events", responses=ERRORS,
             summary="the log in position order, paged: pass the answer's next_after to get the next page")
    async def events(job: JobFilter = None,
                     type: Annotated[list[EventType] | None, Query(description="event types (repeat for several)")] = None,
                     after: Annotated[int, Query(ge=0, le=MAX_POSITION, description="only events after this position")] = 0,
                     limit: Limit = 100, _: ApiToken = reader) -> dict[str, Any]:
        page = min(limit, max_page)
        types = [t.value for t in type] if type else None
        rows = [r async for r in store.read(job_id=job, after_position=after, types=types, limit=page)]
        return {"events": [{"position": r.position, **r.event.to_wire()} for r in rows],
                "next_after": rows[-1].position if len(rows) == page else None}

    _action_routes(app, actions(store) if actions is not None else None, operator)
    if chatops is not None:
        _chatops_routes(app, chatops(store))
    return app


def _action_routes(app: FastAPI, handler: Actions | None, operator: Any) -> None:
    """The operator actions: an operator token, each publishing one event signed by the token's identity."""

    async def act(work: Callable[[Actions], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        if handler is None:
            raise HTTPException(503, "this API serves no operator actions (no operator token was configured at "
                                     "its start)")
        try:
            return await work(handler)
        except Refused as refused:
            raise HTTPException(refused.status, refused.reason) from None

    @app.post("/v1/approvals/{request_id}", responses=APPROVAL_ANSWERS,
              summary="answer a held action's approval request (approve or deny), as the token's operator: "
                      "``keel approve`` / ``keel deny``")
    async def approve(request_id: Annotated[uuid.UUID, Path(description="the ApprovalRequested event's id")],
                      body: ApprovalDecision, token: ApiToken = operator) -> dict[str, Any]:
        return await act(lambda h: h.answer(token, request_id, approved=body.decision == "approve",
                                            comment=body.comment))

    for verb, cordoned, text in (("cordon", True, "take a node out of service: ``keel cordon``"),
                                 ("uncordon", False, "put a cordoned node back into service: ``keel uncordon``")):
        async def cordon(node_id: Annotated[str, Path(pattern=NODE_ID, description="the node")],
                         body: CordonRequest, token: ApiToken = operator,
                         cordoned: bool = cordoned) -> dict[str, Any]:
            return await act(lambda h: h.cordon(token, node_id, cordoned=cordoned, reason=body.reason, job=body.job))
        _hide_parameter(cordon, "cordoned")
        app.post(f"/v1/nodes/{{node_id}}/{verb}", responses=CORDON_ANSWERS, name=f"node_{verb}",
                 summary=f"{text}, as the token's operator")(cordon)


CHATOPS_ANSWERS: dict[int | str, dict[str, Any]] = {
    status: {"description": what, **_ERROR} for status, what in (
        (401, "the signature or its timestamp does not verify (expired, or not signed with the secret)"),
        (403, "the approver is not on the allow-list"), (404, "no such approval request (or callback)"),
        (409, "a replayed request, or one already answered"), (410, "the approval request expired"),
        (413, "the body is too large"), (422, "not a request chat-ops understands"),
        (503, "the answer could not be published; try again"))}


async def _body(request: Request) -> bytes:
    """The raw body (what the signature covers), refused past ``MAX_BODY_BYTES`` without reading it all."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HTTPException(413, f"the body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _chatops_routes(app: FastAPI, handler: ChatOps) -> None:
    """The chat-ops routes: no bearer token, the request's own signature authenticates it."""

    @app.post("/v1/chatops/slack", responses=CHATOPS_ANSWERS, response_model=dict[str, Any],
              summary="Slack's interactivity request (an Approve / Deny button), signed with the app's signing secret")
    async def slack(request: Request) -> JSONResponse:
        status, answer = await handler.slack(dict(request.headers), await _body(request))
        return JSONResponse(answer, status_code=status)

    @app.post("/v1/chatops/callback/{name}", responses=CHATOPS_ANSWERS, response_model=dict[str, Any],
              summary="a tool's answer to an approval request, signed per Standard Webhooks with its secret")
    async def callback(name: Annotated[str, Path(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], request: Request) -> JSONResponse:
        status, answer = await handler.callback(name, dict(request.headers), await _body(request))
        return JSONResponse(answer, status_code=status)


PAGE_ASSETS = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8"}
PAGE_HEADERS = {
    # Only this origin's script and style, fetches to this origin only, no framing, no inline code: a value in
    # the log that looks like markup stays text (the script sets text only).
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _page_file(name: str, media_type: str) -> Response:
    body = resources.files("keel.api").joinpath("page", name).read_bytes()
    return Response(body, media_type=media_type, headers=PAGE_HEADERS)


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _hide_parameter(route: Callable[..., Any], name: str) -> None:
    """Drop ``name`` (a loop variable bound as a default) from the signature FastAPI reads: not a query parameter."""
    signature = inspect.signature(route)
    route.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for p in signature.parameters.values() if p.name != name])


def _duration(text: str, name: str) -> timedelta:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise HTTPException(422, f"{name}: {exc}") from None
    if value <= timedelta(0):
        raise HTTPException(422, f"{name} must be longer than 0 s, got {text!r}")
    return value


__all__ = ["API_VERSION", "create_app"]
