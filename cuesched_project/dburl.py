"""Turn a `DATABASE_URL` into Django's DATABASES entry.

Small enough to own rather than add a dependency; only PostgreSQL URLs are accepted,
since cuesched relies on PostgreSQL triggers and LISTEN/NOTIFY.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit


def database_from_url(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ValueError(f"DATABASE_URL must be a postgres:// URL, got scheme {parts.scheme!r}")
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise ValueError("DATABASE_URL names no database (postgres://user@host:port/NAME)")
    options = dict(parse_qsl(parts.query))
    # libpq style: a Unix-socket directory may come as ?host=/path (and ?port=).
    query_host, query_port = options.pop("host", ""), options.pop("port", "")
    host = unquote(parts.hostname or "") or query_host
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(parts.port or query_port or ""),
        "OPTIONS": options,
    }


def url_from_settings(settings_dict: dict[str, Any]) -> str:
    """The `DATABASE_URL` that reaches a Django database, for child processes (scheduler, agents).

    A Unix-socket directory (the embedded server) goes in the query string, libpq style, since
    a path cannot stand in the URL's host part.
    """
    user = quote(settings_dict.get("USER") or "", safe="")
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{quote(password, safe='')}@" if password else (f"{user}@" if user else "")
    host = settings_dict.get("HOST") or ""
    port = str(settings_dict.get("PORT") or "5432")
    name = quote(settings_dict["NAME"], safe="")
    if host.startswith("/"):
        return f"postgres://{auth}/{name}?host={quote(host, safe='')}&port={port}"
    return f"postgres://{auth}{host or '127.0.0.1'}:{port}/{name}"
