"""The allocation view: capacity against what the subscriptions promise, and who borrows.

Per allocation: hosts up and down (host_stat.str_state; an up host that is locked books
nothing, so it is counted apart), cores in total and idle on open up hosts, the sum of the
subscriptions' sizes and bursts against that capacity (sizes over capacity promise more than
the farm has; bursts over it are normal, they are ceilings), and SUM(proc) booked. Then every
subscription booked above its size: it is borrowing, and the others' waiting work has a claim.
Two queries, whatever the farm's size; whole cores throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

from accounting.units import centicores_to_cores

ALLOCS_SQL = """
WITH hosts AS (
  SELECT h.pk_alloc,
         COUNT(*) FILTER (WHERE hs.str_state = 'UP') AS up,
         COUNT(*) FILTER (WHERE hs.str_state IS DISTINCT FROM 'UP') AS down,
         COUNT(*) FILTER (WHERE hs.str_state = 'UP' AND h.str_lock_state <> 'OPEN') AS locked,
         COALESCE(SUM(h.int_cores) FILTER (WHERE hs.str_state = 'UP' AND h.str_lock_state = 'OPEN'), 0) AS cores,
         COALESCE(SUM(h.int_cores_idle) FILTER (WHERE hs.str_state = 'UP' AND h.str_lock_state = 'OPEN'), 0) AS idle
  FROM host h LEFT JOIN host_stat hs ON hs.pk_host = h.pk_host
  GROUP BY h.pk_alloc
), subs AS (
  SELECT pk_alloc, SUM(int_size) AS size, SUM(int_burst) AS burst, COUNT(*) AS n FROM subscription GROUP BY pk_alloc
), booked AS (
  SELECT h.pk_alloc, SUM(p.int_cores_reserved) AS cc
  FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE NOT p.b_local GROUP BY h.pk_alloc
)
SELECT a.pk_alloc, a.str_name, COALESCE(hosts.up, 0), COALESCE(hosts.down, 0), COALESCE(hosts.locked, 0),
       COALESCE(hosts.cores, 0), COALESCE(hosts.idle, 0), COALESCE(subs.size, 0), COALESCE(subs.burst, 0),
       COALESCE(subs.n, 0), COALESCE(booked.cc, 0)
FROM alloc a
LEFT JOIN hosts ON hosts.pk_alloc = a.pk_alloc
LEFT JOIN subs ON subs.pk_alloc = a.pk_alloc
LEFT JOIN booked ON booked.pk_alloc = a.pk_alloc
ORDER BY a.str_name
"""

BORROWERS_SQL = """
WITH booked AS (
  SELECT p.pk_show, h.pk_alloc, SUM(p.int_cores_reserved) AS cc
  FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE NOT p.b_local GROUP BY p.pk_show, h.pk_alloc
)
SELECT sub.pk_subscription, s.pk_show, s.str_name, a.str_name, b.cc, sub.int_size, sub.int_burst
FROM subscription sub
JOIN booked b ON b.pk_show = sub.pk_show AND b.pk_alloc = sub.pk_alloc
JOIN show s ON s.pk_show = sub.pk_show JOIN alloc a ON a.pk_alloc = sub.pk_alloc
WHERE b.cc > sub.int_size
ORDER BY b.cc - sub.int_size DESC, s.str_name, a.str_name
"""


@dataclass(frozen=True)
class AllocRow:
    pk: str
    name: str
    hosts_up: int
    hosts_down: int
    hosts_locked: int
    cores: int
    idle_cores: int
    size_sum: int
    burst_sum: int
    subscriptions: int
    booked: int

    @property
    def size_over_capacity(self) -> bool:
        return self.size_sum > self.cores

    def percent(self, amount: int) -> int | None:
        return None if self.cores <= 0 else round(100 * amount / self.cores)

    @property
    def size_percent(self) -> int | None:
        return self.percent(self.size_sum)

    @property
    def burst_percent(self) -> int | None:
        return self.percent(self.burst_sum)

    @property
    def booked_percent(self) -> int | None:
        return self.percent(self.booked)


@dataclass(frozen=True)
class Borrower:
    sub: str
    show: str
    show_name: str
    alloc_name: str
    booked: int
    size: int
    burst: int

    @property
    def borrowed(self) -> int:
        return self.booked - self.size


def allocations() -> tuple[list[AllocRow], list[Borrower]]:
    c = centicores_to_cores
    with connection.cursor() as cur:
        cur.execute(ALLOCS_SQL)
        allocs = [
            AllocRow(pk, name, int(up), int(down), int(locked), c(cores), c(idle), c(size), c(burst), int(n), c(cc))
            for pk, name, up, down, locked, cores, idle, size, burst, n, cc in cur.fetchall()
        ]
        cur.execute(BORROWERS_SQL)
        borrowers = [
            Borrower(sub, show, sname, aname, c(cc), c(size), c(burst))
            for sub, show, sname, aname, cc, size, burst in cur.fetchall()
        ]
    return allocs, borrowers
