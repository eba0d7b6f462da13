"""API tokens: issue (create or rotate) and authenticate. Only a SHA-256 digest is stored.

A token is `cst_` + 43 URL-safe characters (256 random bits). Issuing a new one replaces the
user's previous token at once; the raw token is returned to be shown once and is not kept.
"""

from __future__ import annotations

import hashlib
import secrets

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from dispatch.models import ApiToken

TOKEN_PREFIX = "cst_"
_SHOWN_CHARS = 8  # of the token, after the prefix: enough to tell tokens apart, useless to an attacker


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def issue_token(user: AbstractBaseUser) -> str:
    """A new token for `user`, replacing any previous one; returns the raw token (show it once)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic(durable=True):
        ApiToken.objects.filter(user=user).delete()
        ApiToken.objects.create(user=user, digest=digest(token), prefix=token[: len(TOKEN_PREFIX) + _SHOWN_CHARS])
    return token


def revoke_token(user: AbstractBaseUser) -> bool:
    with transaction.atomic(durable=True):
        deleted, _ = ApiToken.objects.filter(user=user).delete()
    return bool(deleted)


def user_for_token(token: str) -> AbstractBaseUser | None:
    """The active user the token belongs to, or None (unknown token, inactive user)."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    row = ApiToken.objects.select_related("user").filter(digest=digest(token)).first()
    if row is None or not row.user.is_active:
        return None
    return row.user
