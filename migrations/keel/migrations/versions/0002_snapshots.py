"""Decider snapshots: each decider's state folded through a log position, so a cold start folds the
newest snapshot plus the tail instead of the whole history.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import BYTEA, UUID

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "snapshots",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("decider", sa.Text, nullable=False),
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("js_seq", sa.BigInteger, nullable=True),
        sa.Column("event_id", UUID(as_uuid=True), nullable=True),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("events_folded", sa.BigInteger, nullable=False),
        sa.Column("state", BYTEA, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.UniqueConstraint("decider", "scope", "position", "fingerprint", name="snapshots_unique"),
    )
    op.create_index("snapshots_newest", "snapshots", ["decider", "scope", "position"])


def downgrade() -> None:
    op.drop_table("snapshots")
