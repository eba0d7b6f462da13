"""The booking engine: where a waiting frame gets its host.

`feed` reads pending work, `placement` picks hosts, `booking` writes a batch in one transaction,
`loop` runs the cycle, `completion` is the one release path, `launcher` is the interface the loop
hands committed bookings to. Imports `accounting` and `dispatch.models` only.
"""
