"""The recorder's append lock as a SECURITY DEFINER function, so the recorder role needs only INSERT on
``events``: ``LOCK TABLE ... IN SHARE ROW EXCLUSIVE MODE`` would otherwise need UPDATE, DELETE or TRUNCATE
(``keel.infra.dbroles``). EXECUTE is revoked from PUBLIC; the migration's grants give it to the recorder.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from alembic import op
from sqlalchemy import text

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT current_schema()")).scalar_one()
    # The table is named with its schema and search_path is pinned: a SECURITY DEFINER function must not
    # resolve names through its caller's search_path.
    op.execute(
        f"""
        CREATE FUNCTION lock_events_for_append() RETURNS void LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp AS $$
        BEGIN
            LOCK TABLE "{schema}".events IN SHARE ROW EXCLUSIVE MODE;
        END $$;
        """
    )
    op.execute("REVOKE ALL ON FUNCTION lock_events_for_append() FROM PUBLIC")


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS lock_events_for_append()")
