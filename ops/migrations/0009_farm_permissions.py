"""The farm-list controls' permissions (ops.permissions: control_jobs, kill_work, control_hosts)
for operators, and the farm-action audit rows (dispatch.FarmAction) for both groups to read."""

from django.db import migrations

# What this migration adds to the groups 0002_groups made (a test keeps the sum of 0002, 0004
# and this equal to ops.permissions.GROUP_PERMISSIONS).
CONSOLE_PERMISSIONS = {
    "control_jobs": "Can pause, resume, retry, eat and reprioritise jobs and frames",
    "kill_work": "Can kill jobs and running frames",
    "control_hosts": "Can lock, unlock and drain hosts",
}
ADDED = {
    "operators": [("ops", code) for code in CONSOLE_PERMISSIONS] + [("dispatch", "view_farmaction")],
    "viewers": [("dispatch", "view_farmaction")],
}


def add_permissions(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    Permission = apps.get_model("auth", "Permission")
    Group = apps.get_model("auth", "Group")
    for group_name, perms in ADDED.items():
        group, _ = Group.objects.get_or_create(name=group_name)
        for app_label, codename in perms:
            if app_label == "ops":
                ct, _ = ContentType.objects.get_or_create(app_label="ops", model="console")
                name = CONSOLE_PERMISSIONS[codename]
            else:
                ct, _ = ContentType.objects.get_or_create(app_label=app_label, model="farmaction")
                name = "Can view farm action"
            perm, _ = Permission.objects.get_or_create(content_type=ct, codename=codename, defaults={"name": name})
            group.permissions.add(perm)


def remove_permissions(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    for group_name, perms in ADDED.items():
        for group in Group.objects.filter(name=group_name):
            group.permissions.remove(*group.permissions.filter(codename__in=[code for _app, code in perms]))


class Migration(migrations.Migration):
    dependencies = [
        ("ops", "0008_history"),
        ("dispatch", "0012_farm_action"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="console",
            options={
                "default_permissions": (),
                "managed": False,
                "permissions": [
                    ("view_console", "Can view the ops console (live counters, why not booking, audit)"),
                    ("flip_show", "Can flip a show between scheduler- and database-managed accounting"),
                    ("edit_caps", "Can edit subscription burst/size and folder/job max cores/GPUs"),
                    ("set_kill_switch", "Can turn accounting notifications on or off"),
                    *CONSOLE_PERMISSIONS.items(),
                ],
                "verbose_name": "ops console",
                "verbose_name_plural": "ops console",
            },
        ),
        migrations.RunPython(add_permissions, remove_permissions),
    ]
