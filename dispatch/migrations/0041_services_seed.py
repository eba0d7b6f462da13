"""Cuebot's default services (its seed_data.sql), so a plain cuesched database resolves a layer's
`services` as a Cuebot one does. Same keys, names and values as Cuebot's seed; the columns its
seed leaves out take their defaults (no GPUs, no timeouts, a 2 GB memory-failure increase).

One row differs on purpose: `default`, which every layer naming no service gets, holds what such
a layer booked before these tables existed (threadable, 4 GB, no tags: the show's allocations'
tags). Cuebot's `default` is not threadable, 3.2 GB and tagged "general | desktop", which works
where every allocation is tagged `general` by Cuebot's convention; cuesched's allocations carry
their own names as tags, so those tags would leave every untagged layer of a plain farm (the
demo's, an RQD registered into an allocation) unbookable. An operator edits `default` like any
other service.

On a Cuebot database the table and its rows are Cuebot's: adoption copies rows only into the
tables it creates (dispatch.adoption._copy_rows), so these never land over Cuebot's."""

from django.db import migrations

# (pk_service, str_name, b_threadable, int_cores_min, int_mem_min KB, str_tags): seed_data.sql, but `default`.
CUEBOT_SERVICES = (
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA0", "default", True, 100, 4194304, ""),  # cuesched's, see above
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA1", "prman", False, 100, 3355443, "general | desktop"),
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA2", "arnold", True, 100, 3355443, "general | desktop"),
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA3", "shell", False, 100, 3355443, "general | util"),
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA4", "maya", False, 100, 2097152, "general | desktop"),
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA5", "houdini", False, 100, 3355443, "general | desktop"),
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA7", "katana", True, 100, 2097152, "general | desktop | util"),
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA9", "nuke", False, 100, 2097152, "general | desktop"),
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAA11", "preprocess", False, 10, 393216, "util"),
    ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAA12", "postprocess", False, 10, 524288, "util"),
)


def seed(apps, schema_editor):
    Service = apps.get_model("dispatch", "Service")
    for pk, name, threadable, cores, mem, tags in CUEBOT_SERVICES:
        if not Service.objects.using(schema_editor.connection.alias).filter(str_name=name).exists():
            Service.objects.using(schema_editor.connection.alias).create(
                pk_service=pk,
                str_name=name,
                b_threadable=threadable,
                int_cores_min=cores,
                int_mem_min=mem,
                str_tags=tags,
            )


def unseed(apps, schema_editor):
    Service = apps.get_model("dispatch", "Service")
    Service.objects.using(schema_editor.connection.alias).filter(pk__in=[s[0] for s in CUEBOT_SERVICES]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("dispatch", "0040_services_tables"),
    ]

    operations = [migrations.RunPython(seed, unseed)]
