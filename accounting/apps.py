from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


def ensure_settings_row(using: str = "default", **_kwargs: Any) -> None:
    """The kill-switch row exists after every migrate (and after a test flush, which truncates it).

    The data migration creates it once; this keeps it there when something outside the
    triggers' protection (TRUNCATE) removed it. A missing row reads as "on" anyway.
    """
    from accounting.models import SETTINGS_ROW_ID, AccountingSettings

    AccountingSettings.objects.using(using).get_or_create(id=SETTINGS_ROW_ID)


class AccountingConfig(AppConfig):
    name = "accounting"
    verbose_name = "Accounting"

    def ready(self) -> None:
        post_migrate.connect(ensure_settings_row, sender=self, dispatch_uid="accounting.ensure_settings_row")
