"""Who may do what in the ops console.

Two groups, made by the data migration `ops.0002_groups`:

* **operators** look at everything, flip shows, edit caps and the notification kill switch,
  control jobs and frames (pause, resume, retry, eat, priority), kill them, and lock, unlock
  and drain hosts;
* **viewers** look at everything and change nothing.

Anyone else (a staff user in neither group) gets nothing from the console; superusers get
everything, as everywhere in the admin. The group contents are listed here, once, and the
migration copies them, so a test can compare the database with this module.
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.exceptions import PermissionDenied

OPERATORS = "operators"
VIEWERS = "viewers"

VIEW_CONSOLE = "ops.view_console"
FLIP_SHOW = "ops.flip_show"
EDIT_CAPS = "ops.edit_caps"
SET_KILL_SWITCH = "ops.set_kill_switch"
CONTROL_JOBS = "ops.control_jobs"
KILL_WORK = "ops.kill_work"
CONTROL_HOSTS = "ops.control_hosts"

# Farm and accounting models both groups may browse in the admin (view_*).
VIEWABLE = [
    ("dispatch", m)
    for m in (
        "facility",
        "dept",
        "show",
        "alloc",
        "subscription",
        "point",
        "folder",
        "folderresource",
        "job",
        "jobresource",
        "jobstat",
        "layer",
        "layerresource",
        "layerstat",
        "frame",
        "host",
        "hoststat",
        "hosttag",
        "proc",
    )
] + [
    ("accounting", "accountingsettings"),
    ("ops", "subscriptioncapevent"),
    ("ops", "foldercapevent"),
    ("ops", "jobcapevent"),
    ("ops", "showmanagedevent"),
    ("ops", "killswitchevent"),
    ("dispatch", "farmaction"),
]

# (app_label, codename) per group. Operators change the cap rows through the cap forms (which
# call accounting.actions and write only the cap columns) and the kill-switch row.
GROUP_PERMISSIONS: dict[str, list[tuple[str, str]]] = {
    VIEWERS: [("ops", "view_console")] + [(app, f"view_{model}") for app, model in VIEWABLE],
    OPERATORS: [
        ("ops", "view_console"),
        ("ops", "flip_show"),
        ("ops", "edit_caps"),
        ("ops", "set_kill_switch"),
        ("ops", "control_jobs"),
        ("ops", "kill_work"),
        ("ops", "control_hosts"),
        ("dispatch", "change_subscription"),
        ("dispatch", "change_folderresource"),
        ("dispatch", "change_jobresource"),
        ("accounting", "change_accountingsettings"),
    ]
    + [(app, f"view_{model}") for app, model in VIEWABLE],
}


User = AbstractBaseUser | AnonymousUser


def can_view(user: User) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(VIEW_CONSOLE))


def can_flip(user: User) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(FLIP_SHOW))


def can_edit_caps(user: User) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(EDIT_CAPS))


def can_set_kill_switch(user: User) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(SET_KILL_SWITCH))


def can_control_jobs(user: User) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(CONTROL_JOBS))


def can_kill_work(user: User) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(KILL_WORK))


def can_control_hosts(user: User) -> bool:
    return bool(user.is_active and user.is_staff and user.has_perm(CONTROL_HOSTS))


def require(allowed: bool) -> None:
    """Refuse the request (403) unless `allowed`; views call this before any write."""
    if not allowed:
        raise PermissionDenied


def ensure_groups() -> None:
    """Create or complete the two groups from GROUP_PERMISSIONS (the migration does this once;
    a flushed test database or a hand-edited group is repaired by calling it again)."""
    from django.contrib.auth.models import Group, Permission

    for name, perms in GROUP_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=name)
        wanted = [Permission.objects.get(content_type__app_label=app, codename=code) for app, code in perms]
        group.permissions.set(wanted)
