"""Event store: events (append-only), tracking, dead letters, node_status projection.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, UUID

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
        sa.Column("js_seq", sa.BigInteger, nullable=True),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("producer", sa.Text, nullable=False),
        sa.Column("causation_id", UUID(as_uuid=True), nullable=True),
        sa.Column("correlation_id", UUID(as_uuid=True), nullable=True),
        sa.Column("payload", JSONB, nullable=False),
    )
    # Audit queries: by job, subject, type, time, incident (correlation) and cause.
    op.create_index("events_job_position", "events", ["job_id", "position"])
    op.create_index("events_subject_position", "events", ["subject", "position"])
    op.create_index("events_type_position", "events", ["type", "position"])
    op.create_index("events_occurred_at", "events", ["occurred_at"])
    op.create_index("events_correlation", "events", ["correlation_id"])
    op.create_index("events_causation", "events", ["causation_id"])
    # Append-only: history is never rewritten. (TRUNCATE stays possible for an operator.)
    op.execute(
        """
        CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'events is append-only: % refused', TG_OP;
        END $$;
        """
    )
    op.execute(
        "CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events "
        "FOR EACH ROW EXECUTE FUNCTION events_append_only()"
    )

    op.create_table(
        "tracking",
        sa.Column("consumer", sa.Text, primary_key=True),
        sa.Column("last_js_seq", sa.BigInteger, nullable=False),
        sa.Column("last_position", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("js_seq", sa.BigInteger, nullable=False, unique=True),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("raw", BYTEA, nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_table(
        "node_status",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("node_id", sa.Text, primary_key=True),
        sa.Column("health", sa.Text, nullable=False, server_default="unknown"),
        sa.Column("detail", sa.Text, nullable=False, server_default=""),
        sa.Column("evicted", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("last_event_id", UUID(as_uuid=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_status")
    op.drop_table("dead_letters")
    op.drop_table("tracking")
    op.execute("DROP TRIGGER IF EXISTS events_append_only ON events")
    op.drop_table("events")
    op.execute("DROP FUNCTION IF EXISTS events_append_only()")
