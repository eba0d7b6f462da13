"""The host side: agents that run frames, and the launchers that reach them.

`agent` is `run_agent` (register, heartbeat, run a frame, report its end), `launchers` implement
`dispatch.engine.launcher.Launcher` (simulated, q2, celery, rqd), `rqd_gateway` is the server
side of OpenCue RQD's report protocol (`run_rqd_gateway`), `celery_app` is the Celery
application. Imports `dispatch.engine`, `dispatch.jobs` (frame ranges), `accounting` and
`dispatch.models`.
"""
