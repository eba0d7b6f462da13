from django.apps import AppConfig


class DispatchConfig(AppConfig):
    name = "dispatch"
    verbose_name = "Farm"

    def ready(self) -> None:
        # The engine finds launchers by name; the host side's built-in ones register here.
        import dispatch.hosts.launchers  # noqa: F401
