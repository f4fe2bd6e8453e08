"""Audit views over the event log: incidents, decisions, evictions, rollbacks, node history, human actions.

Plain views (no copies of the log: always current, nothing to keep in step), read by the ``auditor`` role
(``keel audit``, ``docs/audit.md``). They read payloads as the producers wrote them: a field an older schema
version lacked reads as NULL (``keel replay`` and ``keel timeline`` upcast; these do not). Two expression
indexes make the joins by id (a resolution to its incident, a carried-out eviction to its decision) lookups.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

DECISIONS = """
CREATE VIEW audit_decisions AS
SELECT e.position, e.event_id, e.job_id, e.type, e.occurred_at AS decided_at,
       e.correlation_id AS incident_id,
       COALESCE((e.payload->>'rung')::int,
                CASE e.type WHEN 'DiagnosticsRequested' THEN 2 WHEN 'StacksRequested' THEN 3
                            WHEN 'RollbackDecided' THEN 4 END) AS rung,
       NULLIF(e.payload->>'node_id', '') AS node_id,
       e.payload->>'reason' AS reason,
       COALESCE(e.payload->'evidence', '[]'::jsonb) AS evidence
FROM events e
WHERE e.producer = 'controller' AND e.payload ? 'reason'
"""

INCIDENTS = """
CREATE VIEW audit_incidents AS
SELECT o.event_id AS incident_id, o.job_id, o.payload->>'kind' AS kind, NULLIF(o.payload->>'node_id', '') AS node_id,
       NULLIF(o.payload->>'fingerprint', '') AS fingerprint, o.occurred_at AS opened_at,
       o.payload->>'reason' AS reason, r.occurred_at AS resolved_at,
       COALESCE(r.payload->>'outcome', 'open') AS outcome,
       EXTRACT(EPOCH FROM (r.occurred_at - o.occurred_at))::double precision AS open_s,
       COALESCE((SELECT array_agg(DISTINCT d.rung ORDER BY d.rung) FROM audit_decisions d
                 WHERE d.incident_id = o.event_id AND d.rung IS NOT NULL
                   AND d.type NOT IN ('IncidentOpened', 'IncidentResolved', 'ActionHeld')), '{}') AS rungs,
       COALESCE((SELECT array_agg(DISTINCT v.node_id ORDER BY v.node_id) FROM audit_evictions v
                 WHERE v.incident_id = o.event_id AND v.outcome = 'evicted'), '{}') AS evicted_nodes,
       r.payload->>'reason' AS resolution
FROM events o
LEFT JOIN LATERAL (SELECT x.occurred_at, x.payload FROM events x
                   WHERE x.type = 'IncidentResolved' AND x.payload->>'incident_id' = o.event_id::text
                     AND x.job_id = o.job_id
                   ORDER BY x.position LIMIT 1) r ON true
WHERE o.type = 'IncidentOpened'
"""

EVICTIONS = """
CREATE VIEW audit_evictions AS
SELECT d.event_id AS decision_id, d.job_id, d.payload->>'node_id' AS node_id, (d.payload->>'rung')::int AS rung,
       d.occurred_at AS decided_at, d.correlation_id AS incident_id, d.payload->>'reason' AS reason,
       COALESCE(d.payload->'evidence', '[]'::jsonb) AS evidence,
       COALESCE((d.payload->>'observe_only')::boolean, false) AS observe_only,
       COALESCE(x.payload->>'outcome', 'pending') AS outcome, x.payload->>'actuator' AS actuator,
       x.occurred_at AS carried_out_at, NULLIF(x.payload->>'detail', '') AS detail
FROM events d
LEFT JOIN LATERAL (SELECT y.occurred_at, y.payload FROM events y
                   WHERE y.type = 'NodeEvicted' AND y.payload->>'decision_id' = d.event_id::text
                     AND y.job_id = d.job_id
                   ORDER BY y.position DESC LIMIT 1) x ON true
WHERE d.type = 'NodeEvictionDecided'
"""

ROLLBACKS = """
CREATE VIEW audit_rollbacks AS
SELECT e.event_id AS decision_id, e.job_id, e.type, e.occurred_at AS decided_at,
       COALESCE(e.payload->>'incident_id', e.correlation_id::text) AS incident_id,
       NULLIF(COALESCE(e.payload->>'to_version', e.payload->>'code_version'), '') AS to_version,
       NULLIF(e.payload->>'fingerprint', '') AS fingerprint, e.payload->>'reason' AS reason,
       COALESCE(e.payload->'evidence', '[]'::jsonb) AS evidence
FROM events e
WHERE e.type = 'RollbackDecided' OR (e.type = 'RestartDecided' AND (e.payload->>'rollback')::boolean)
"""

NODE_HISTORY = """
CREATE VIEW audit_node_history AS
SELECT e.position, e.event_id, e.job_id, e.payload->>'node_id' AS node_id, e.occurred_at AS at, e.type, e.producer,
       COALESCE(NULLIF(e.payload->>'reason', ''), NULLIF(e.payload->>'detail', ''),
                NULLIF(concat_ws(' ', e.payload->>'component', e.payload->>'check', e.payload->>'status',
                                 e.payload->>'classification', e.payload->>'outcome'), '')) AS what,
       e.correlation_id AS incident_id
FROM events e
WHERE e.type IN ('NodeRegistered', 'NodeHealthChanged', 'NodeEvictionDecided', 'NodeEvicted', 'NodeCordoned',
                 'NodeFenced', 'NodeClockSkewed', 'StandbyChecked', 'StandbyPromotionRequested', 'RankExited',
                 'IncidentOpened')
  AND e.payload ? 'node_id' AND e.payload->>'node_id' <> ''
"""

HUMAN_ACTIONS = """
CREATE VIEW audit_human_actions AS
SELECT e.position, e.event_id, e.job_id, e.occurred_at AS at, e.type, e.payload->>'by' AS by,
       COALESCE(e.payload->>'node_id', e.payload->>'request_id', e.payload->>'version_id') AS target,
       CASE WHEN e.payload ? 'approved' THEN (e.payload->>'approved')::boolean END AS approved,
       q.payload->>'action' AS action, q.payload->>'incident_id' AS incident_id,
       COALESCE(NULLIF(e.payload->>'reason', ''), NULLIF(e.payload->>'comment', ''), NULLIF(e.payload->>'why', ''))
           AS note
FROM events e
LEFT JOIN LATERAL (SELECT r.payload FROM events r
                   WHERE e.type = 'ApprovalGiven' AND r.type = 'ApprovalRequested'
                     AND r.event_id::text = e.payload->>'request_id' AND r.job_id = e.job_id
                   LIMIT 1) q ON true
WHERE e.payload ? 'by'
"""

VIEWS = ("audit_decisions", "audit_evictions", "audit_incidents", "audit_rollbacks", "audit_node_history",
         "audit_human_actions")


def upgrade() -> None:
    for statement in (DECISIONS, EVICTIONS, INCIDENTS, ROLLBACKS, NODE_HISTORY, HUMAN_ACTIONS):
        op.execute(statement)
    op.execute("CREATE INDEX events_incident_ref ON events ((payload->>'incident_id')) WHERE type = 'IncidentResolved'")
    op.execute("CREATE INDEX events_decision_ref ON events ((payload->>'decision_id')) WHERE type = 'NodeEvicted'")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS events_decision_ref")
    op.execute("DROP INDEX IF EXISTS events_incident_ref")
    for view in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {view}")
