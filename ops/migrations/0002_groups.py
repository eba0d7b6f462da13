"""The "operators" and "viewers" groups with their permissions (see ops.permissions).

Permissions are normally created after all migrations (post_migrate); the ones the groups
need are created here with Django's own names, and post_migrate then finds them in place.
"""

from django.db import migrations

# Frozen copy of ops.permissions.GROUP_PERMISSIONS at this migration (a test keeps them equal).
GROUP_PERMISSIONS = {'operators': [('ops', 'view_console'),
               ('ops', 'flip_show'),
               ('ops', 'edit_caps'),
               ('ops', 'set_kill_switch'),
               ('dispatch', 'change_subscription'),
               ('dispatch', 'change_folderresource'),
               ('dispatch', 'change_jobresource'),
               ('accounting', 'change_accountingsettings'),
               ('dispatch', 'view_facility'),
               ('dispatch', 'view_dept'),
               ('dispatch', 'view_show'),
               ('dispatch', 'view_alloc'),
               ('dispatch', 'view_subscription'),
               ('dispatch', 'view_point'),
               ('dispatch', 'view_folder'),
               ('dispatch', 'view_folderresource'),
               ('dispatch', 'view_job'),
               ('dispatch', 'view_jobresource'),
               ('dispatch', 'view_jobstat'),
               ('dispatch', 'view_layer'),
               ('dispatch', 'view_layerresource'),
               ('dispatch', 'view_layerstat'),
               ('dispatch', 'view_frame'),
               ('dispatch', 'view_host'),
               ('dispatch', 'view_hoststat'),
               ('dispatch', 'view_hosttag'),
               ('dispatch', 'view_proc'),
               ('accounting', 'view_accountingsettings'),
               ('ops', 'view_subscriptioncapevent'),
               ('ops', 'view_foldercapevent'),
               ('ops', 'view_jobcapevent'),
               ('ops', 'view_showmanagedevent')],
 'viewers': [('ops', 'view_console'),
             ('dispatch', 'view_facility'),
             ('dispatch', 'view_dept'),
             ('dispatch', 'view_show'),
             ('dispatch', 'view_alloc'),
             ('dispatch', 'view_subscription'),
             ('dispatch', 'view_point'),
             ('dispatch', 'view_folder'),
             ('dispatch', 'view_folderresource'),
             ('dispatch', 'view_job'),
             ('dispatch', 'view_jobresource'),
             ('dispatch', 'view_jobstat'),
             ('dispatch', 'view_layer'),
             ('dispatch', 'view_layerresource'),
             ('dispatch', 'view_layerstat'),
             ('dispatch', 'view_frame'),
             ('dispatch', 'view_host'),
             ('dispatch', 'view_hoststat'),
             ('dispatch', 'view_hosttag'),
             ('dispatch', 'view_proc'),
             ('accounting', 'view_accountingsettings'),
             ('ops', 'view_subscriptioncapevent'),
             ('ops', 'view_foldercapevent'),
             ('ops', 'view_jobcapevent'),
             ('ops', 'view_showmanagedevent')]}

NAMES = {
    "view_console": "Can view the ops console (live counters, why not booking, audit)",
    "flip_show": "Can flip a show between scheduler- and database-managed accounting",
    "edit_caps": "Can edit subscription burst/size and folder/job max cores/GPUs",
    "set_kill_switch": "Can turn accounting notifications on or off",
}


def create_groups(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    Permission = apps.get_model("auth", "Permission")
    Group = apps.get_model("auth", "Group")
    for group_name, perms in GROUP_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=group_name)
        for app_label, codename in perms:
            action, _, model = codename.partition("_")
            if app_label == "ops" and codename in NAMES:
                model, name = "console", NAMES[codename]
            else:
                name = f"Can {action} {apps.get_model(app_label, model)._meta.verbose_name}"
            ct, _ = ContentType.objects.get_or_create(app_label=app_label, model=model)
            perm, _ = Permission.objects.get_or_create(content_type=ct, codename=codename, defaults={"name": name})
            group.permissions.add(perm)


def delete_groups(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=["operators", "viewers"]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("ops", "0001_audit_trail"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("dispatch", "0003_accounting_triggers_advisory_locks"),
        ("accounting", "0002_scheduler_state"),
    ]

    operations = [migrations.RunPython(create_groups, delete_groups)]
