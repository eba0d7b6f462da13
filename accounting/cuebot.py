"""Cuebot mode: the scheduler running beside a live Cuebot on Cuebot's own (adopted) database.

Why a mode and not per-feature switches: beside Cuebot, three things must change together or a
show is counted twice or not at all.

* Unmanaged shows are Cuebot's. Its Java code (ProcDaoJdbc.procCreated / procDestroyed) and its
  triggers (after_job_moved, after_job_dept_update) keep their five counter tables, and its
  verify_* triggers enforce their caps. cuesched's proc triggers do not add to them for writers
  without the cuesched mark (accounting.triggers.CUEBOT_ACCOUNTS, decided in the database per
  statement, so every writer sees it from adoption on, with or without a scheduler). Not every
  unmarked writer is Cuebot, though: a psql session that inserts a proc without Cuebot's counter
  UPDATEs would be counted by nobody, a counter LOW. So such a transaction keeps a ledger of what
  its procs owe each counter row less what its own counter UPDATEs paid, and a deferred trigger
  tops up the rest at commit, caps checked (accounting.triggers, OUTSIDE_LEDGER_TABLE). Cuebot's
  SQL pays as it goes and owes nothing at commit: counted once. The reconcile loop that rewrites
  unmanaged counters from SUM(proc) does not run (it would race Cuebot's relative updates and
  could write a counter LOW), and the scheduler books managed shows only.
* Managed shows are the Store's. The expected configuration is Cuebot's
  `accounting.notify.enabled=false`: cuesched's proc trigger then sends the one release per proc,
  whoever deletes it (Cuebot's FrameCompleteHandler, its orphan cleanup, our completion path, a
  script). If Cuebot's AccountingNotifier is on anyway, its releases (no transaction id) are the
  same releases a second time: the listener drops them with a loud warning and counts them
  (`cuesched_payloads_dropped_total{reason="cuebot_notifier"}`). Dropping errs HIGH: the trigger's
  copy was applied. Cuebot's cap-change messages are applied (a cap value is set, not added, so
  receiving it twice is harmless).
* The mode is shown by `store_status` and the ops console, with where it came from.

Detection is the same test as the triggers': Cuebot's `verify_subscription` trigger on
`subscription`. `CUESCHED_CUEBOT_MODE=on` forces the scheduler side on (safe anywhere); `off` on a
Cuebot database is refused, because the triggers leave Cuebot's writes of unmanaged shows to Cuebot
there (recording only what they do not pay) whatever the setting says, and the scheduler would then
book unmanaged shows nobody counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from accounting.triggers import CUEBOT_ACCOUNTS
from cuesched_project import conf

DETECT_SQL = f"SELECT {CUEBOT_ACCOUNTS}, to_regclass('flyway_schema_history') IS NOT NULL"


class CuebotModeError(Exception):
    """The setting contradicts the database; the scheduler must not start."""


@dataclass(frozen=True)
class CuebotMode:
    enabled: bool
    setting: str  # auto | on | off
    detected: bool  # Cuebot's verify_subscription trigger is on subscription
    flyway: bool  # Flyway's history table is there (informative)

    def describe(self) -> str:
        if not self.enabled:
            return f"off (CUESCHED_CUEBOT_MODE={self.setting}, no Cuebot schema detected)"
        how = "detected: Cuebot's verify_subscription trigger" if self.detected else "forced by CUESCHED_CUEBOT_MODE=on"
        return (
            f"on ({how}): unmanaged shows are Cuebot's, only managed shows are booked, "
            "Cuebot's accounting.notify.enabled=false expected"
        )


def detect(conn: psycopg.Connection) -> tuple[bool, bool]:
    """(Cuebot's accounting triggers are there, Flyway's history is there)."""
    row = conn.execute(DETECT_SQL).fetchone()
    return bool(row[0]), bool(row[1])


def resolve(conn: psycopg.Connection) -> CuebotMode:
    """The mode for this database and setting; raises CuebotModeError for `off` on a Cuebot database."""
    setting = conf.cuebot_mode_setting()
    detected, flyway = detect(conn)
    if setting == "off" and detected:
        raise CuebotModeError(
            "CUESCHED_CUEBOT_MODE=off on a Cuebot database (its verify_subscription trigger is on subscription): "
            "cuesched's triggers leave unmanaged shows to Cuebot there, so booking them would count them nowhere. "
            "Unset it (auto) or set it to on."
        )
    enabled = setting == "on" or (setting == "auto" and detected)
    return CuebotMode(enabled=enabled, setting=setting, detected=detected, flyway=flyway)
