"""Both groups may read the kill switch's audit events (ops.permissions.VIEWABLE gained them)."""

from django.db import migrations

# What this migration adds to the groups 0002_groups made (a test keeps the sum equal to
# ops.permissions.GROUP_PERMISSIONS).
ADDED = {
    "operators": [("ops", "view_killswitchevent")],
    "viewers": [("ops", "view_killswitchevent")],
}


def add_permissions(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    Permission = apps.get_model("auth", "Permission")
    Group = apps.get_model("auth", "Group")
    for group_name, perms in ADDED.items():
        group, _ = Group.objects.get_or_create(name=group_name)
        for app_label, codename in perms:
            model = codename.partition("_")[2]
            name = f"Can view {apps.get_model(app_label, model)._meta.verbose_name}"
            ct, _ = ContentType.objects.get_or_create(app_label=app_label, model=model)
            perm, _ = Permission.objects.get_or_create(content_type=ct, codename=codename, defaults={"name": name})
            group.permissions.add(perm)


def remove_permissions(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    for group_name, perms in ADDED.items():
        for group in Group.objects.filter(name=group_name):
            group.permissions.remove(*group.permissions.filter(codename__in=[code for _app, code in perms]))


class Migration(migrations.Migration):
    dependencies = [
        ("ops", "0003_kill_switch_audit"),
        ("ops", "0002_groups"),
    ]

    operations = [migrations.RunPython(add_permissions, remove_permissions)]
