"""CHECK constraints on every amount that can never be negative (dispatch/nonnegative.py).

Hand-written, in a migration of its own, so that it survives the regeneration of the pgtrigger
trigger migrations. Each constraint and its reason:

- proc.int_cores_reserved > 0 (c_proc_cores_positive, already from the model on this path);
- proc.int_gpus_reserved, int_mem_reserved, int_mem_pre_reserved, int_gpu_mem_reserved,
  int_gpu_mem_pre_reserved >= 0: what a running frame holds; a negative amount cancels other
  procs' use on every key it books (8 real GPUs under a max of 4 with one proc of -4);
- proc.int_mem_used, int_mem_max_used, int_virt_used, int_virt_max_used, int_gpu_mem_used,
  int_gpu_mem_max_used >= 0: measured uses; a negative one is a broken report;
- subscription.int_size >= 0: a negative size makes the show's tier negative, served before all.

Rows that would break one are counted first: the migration then fails naming them (primary key
and value, the fix) and adds nothing, instead of PostgreSQL's bare "is violated by some row".
"""

from django.db import migrations


def forward(apps, schema_editor):
    from dispatch import nonnegative

    with schema_editor.connection.cursor() as cursor:
        try:
            nonnegative.install(cursor)
        except nonnegative.NegativeAmountsError as exc:
            raise RuntimeError(f"dispatch.0019_nonnegative_amounts: nothing was changed: {exc}") from None


def backward(apps, schema_editor):
    from dispatch import nonnegative

    with schema_editor.connection.cursor() as cursor:
        nonnegative.uninstall(cursor)


class Migration(migrations.Migration):
    dependencies = [
        ("dispatch", "0018_killing_procs"),
    ]

    operations = [migrations.RunPython(forward, backward)]
