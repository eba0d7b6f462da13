"""The host side: agents that run frames, and the launchers that reach them.

`agent` is `run_agent` (register, heartbeat, run a frame, report its end), `launchers` implement
`dispatch.engine.launcher.Launcher` (simulated, q2, celery), `celery_app` is the Celery
application. Imports `dispatch.engine`, `dispatch.jobs` (frame ranges), `accounting` and
`dispatch.models`.
"""
