"""The NOLOGIN role whose members write as the scheduler (accounting.writer_role).

Hand-written and kept apart from pgtrigger's trigger migrations, so that regenerating those leaves
it alone. Roles are cluster-wide: an existing role is kept, and a migrating role that may not
create roles fails with what to run instead. Not dropped on reverse: other databases of the
cluster may use it.
"""

from django.db import migrations

from accounting.writer_role import ENSURE_SQL


class Migration(migrations.Migration):
    dependencies = [
        ("accounting", "0008_generation"),
    ]

    operations = [
        migrations.RunSQL(ENSURE_SQL, reverse_sql=migrations.RunSQL.noop),
    ]
