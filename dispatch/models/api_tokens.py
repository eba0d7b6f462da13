"""API tokens: one per user, stored only as a SHA-256 digest (see `dispatch.jobs.tokens`)."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from dispatch.models.base import now_default


class ApiToken(models.Model):
    """A user's bearer token for the JSON API. The token itself is shown once and never stored.

    A plain SHA-256 is enough here (no slow KDF): the token is 256 random bits, so there is
    nothing to guess offline, and the digest is what the lookup's unique index holds.
    """

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_token")
    digest = models.CharField(max_length=64, unique=True)
    # The first characters of the token, to tell tokens apart in the admin and in logs.
    prefix = models.CharField(max_length=16)
    ts_created = models.DateTimeField(db_default=now_default())

    class Meta:
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix}... ({self.user_id})"
