"""Event signatures: the signer and the ed25519 signature of a signed event (``keel.events.signing``), kept
so that ``keel replay --verify`` checks them on history. Null on unsigned events.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-10
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("events", sa.Column("signed_by", sa.Text, nullable=True))
    op.add_column("events", sa.Column("signature", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("events", "signature")
    op.drop_column("events", "signed_by")
