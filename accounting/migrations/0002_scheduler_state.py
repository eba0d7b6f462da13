"""The UNLOGGED table the scheduler publishes its live Store view into (see accounting.live).

No model: only the scheduler writes it (raw SQL, once a second) and readers want the JSON
document whole. UNLOGGED because it is rebuilt every second and worthless after a crash,
and its writes should cost no WAL.
"""

from django.db import migrations

CREATE = """
CREATE UNLOGGED TABLE cuesched_scheduler_state (
    id smallint PRIMARY KEY CHECK (id = 1),
    pid integer NOT NULL,
    hostname text NOT NULL,
    heartbeat timestamptz NOT NULL,
    payload jsonb NOT NULL
)
"""


class Migration(migrations.Migration):
    dependencies = [("accounting", "0001_initial")]

    operations = [
        migrations.RunSQL(CREATE, reverse_sql="DROP TABLE cuesched_scheduler_state"),
    ]
