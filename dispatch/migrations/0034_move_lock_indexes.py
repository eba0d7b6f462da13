"""A mover's UPDATE locks its row FOR UPDATE up front (accounting.move_locks): no lock cycle with
a proc writer that writes the same host or job row after its proc."""

from django.db import migrations

from accounting.move_locks import create_sql, drop_sql


class Migration(migrations.Migration):
    dependencies = [
        ("dispatch", "0033_host_ledger_definer"),
    ]

    operations = [migrations.RunSQL(sql=create_sql(), reverse_sql=drop_sql())]
