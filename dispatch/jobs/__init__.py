"""Jobs: submit and control them.

`spec` validates a job spec into a `plan` (its database lookups in `spec_lookup`), `frameset`
parses frame ranges. The actions, every job and host state change (one durable transaction
each, with its audit row): `submit` (plan -> write), `controls` (pause, resume, kill, retry,
eat, priority, caps, layer minimums, frame kill), `depends` (dependencies between running
jobs), `host_controls` (lock, unlock, drain), on `action_base` (job lookup, results, cursor,
deadlock test) and `audit` (the `FarmAction` rows). `api` and `urls` are the JSON API,
`tokens` its tokens, `admin` the console's job controls. Imports `dispatch.engine` (a kill
releases procs through the engine's completion path), `accounting` and `dispatch.models`.
"""
