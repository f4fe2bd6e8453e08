"""An index on (job_id, type, position): one job's events of a few types, in log order, without a scan.

The reports (``keel incidents``, ``keel timeline``, ``keel ettr``, the API's routes) read one job's incident and
decision events. With only ``(job_id, position)`` and ``(type, position)``, PostgreSQL walked every event of the
job to find them: 1.9 s a request for 1,000 incidents in a job of 1,000,000 events (bench/ops.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("events_job_type_position", "events", ["job_id", "type", "position"])


def downgrade() -> None:
    op.drop_index("events_job_type_position", table_name="events")
