from django.apps import AppConfig


class OpencueApiConfig(AppConfig):
    name = "opencue_api"
    verbose_name = "OpenCue client API"
