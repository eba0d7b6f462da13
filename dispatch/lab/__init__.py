"""Tools that drive the runtime: the farm seeder, the stress suite and its fault relays.

Used by management commands and tests; nothing in the runtime imports this package.
"""
