"""The built-in launchers; importing this package registers them (`dispatch.apps` does)."""

from dispatch.hosts.launchers import celery_launcher, q2, rqd, simulated

__all__ = ["celery_launcher", "q2", "rqd", "simulated"]
