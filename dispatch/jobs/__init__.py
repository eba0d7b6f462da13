"""Jobs: submit and control them.

`spec` validates a job spec, `frameset` parses frame ranges, `actions` is every job state change
(one transaction each, with its audit row), `api` and `urls` the JSON API, `tokens` its tokens,
`admin` the console's job controls. Imports `dispatch.engine` (a kill releases procs through the
engine's completion path), `accounting` and `dispatch.models`.
"""
