"""`manage.py api_token USER`: create or rotate USER's API token and print it (once).

The token is not stored, only its SHA-256, so it cannot be shown again: run the command
again to rotate it (the old token stops working at once). `--revoke` removes it.
"""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from dispatch.jobs.tokens import issue_token, revoke_token


class Command(BaseCommand):
    help = "Create or rotate a user's API token and print it once (--revoke removes it)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--revoke", action="store_true", help="remove the user's token instead")

    def handle(self, *args: Any, username: str, revoke: bool, **options: Any) -> None:
        User = get_user_model()
        user = User.objects.filter(**{User.USERNAME_FIELD: username}).first()
        if user is None:
            raise CommandError(f"no user {username!r}")
        if revoke:
            removed = revoke_token(user)
            self.stdout.write(f"token of {username} revoked" if removed else f"{username} had no token")
            return
        if not user.is_active:
            raise CommandError(f"user {username!r} is inactive: a token would not work")
        self.stdout.write(issue_token(user))
