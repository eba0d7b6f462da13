from typing import Any

from django.apps import AppConfig
from django.db.models.signals import pre_migrate


class DispatchConfig(AppConfig):
    name = "dispatch"
    verbose_name = "Farm"

    def ready(self) -> None:
        # The engine finds launchers by name; the host side's built-in ones register here.
        import dispatch.hosts.launchers  # noqa: F401

        pre_migrate.connect(_refuse_migrate_on_cuebot, dispatch_uid="cuesched_refuse_migrate_on_cuebot")


def _refuse_migrate_on_cuebot(sender: AppConfig, *, plan: Any = None, using: str = "default", **kwargs: Any) -> None:
    """`migrate` with migrations to apply on a Cuebot database would create, retype or drop
    Cuebot's objects (issue 22): it stops before the first one; adopt_cuebot_db adds them under
    its rules and records them, after which `migrate` has nothing to do."""
    if sender.name != "dispatch" or not plan:
        return
    from dispatch.adoption import refuse_migrate_on_cuebot

    refuse_migrate_on_cuebot(using, plan)
