"""Shared test set-up: every test that touches the database runs on real PostgreSQL.

`DATABASE_URL` (or the embedded server) decides which server; pytest-django creates
`test_<name>` on it, so two checkouts can test side by side with different names.
"""
