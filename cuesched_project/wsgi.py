"""WSGI entry point for serving the admin behind gunicorn or similar."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cuesched_project.settings")
application = get_wsgi_application()
