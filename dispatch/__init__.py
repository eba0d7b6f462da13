"""The Cuebot-mapped farm and everything that books on it.

Four parts, importing downward only (`tests/unit/test_layout.py` checks it): `models` (the
tables) under `engine` (pending work, host choice, the booking transaction, the loop, the
release path, the launcher interface) under `jobs` (submit and control a job, its API) under
`hosts` (agents and the launchers that reach them). `lab` (seeding, stress, benchmarks) drives
all of them and nothing in the runtime imports it.
"""
