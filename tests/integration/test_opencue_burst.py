"""A burst lowered through cueadmin while the scheduler books is never exceeded afterwards (issue 30).

A real scheduler (Store, listener, loops) and its dispatch loop with a simulated launcher book a
managed show on many short frames, well under its burst, while `cueadmin -burst` lowers it. From
the moment cueadmin returned, a sampler reads SUM(proc) of the subscription in consistent
snapshots. Frames booked before the change keep running (nothing running is stopped, as in
Cuebot), so the subscription may stay above the new burst until they end; but no booking may add
to it while it is above, and once it is at or under the new burst it stays there:
every sample is at most max(new burst, the sample before).
"""

from __future__ import annotations

import itertools
import threading
import time

import psycopg
import pytest

from accounting import db
from dispatch.models import Subscription
from ops.models import SubscriptionCapEvent
from tests.integration.dispatch_support import ONE_CORE, fast_launcher, make_loop, seed
from tests.integration.opencue_clients import Clients
from tests.integration.runtime_support import running_scheduler, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

OLD_BURST, NEW_BURST = 40, 12  # whole cores

SUB_SUM_SQL = """
SELECT COALESCE(SUM(p.int_cores_reserved), 0)::bigint / 100, count(*)
FROM proc p JOIN host h ON h.pk_host = p.pk_host
WHERE p.pk_show = %s AND h.pk_alloc = %s AND NOT p.b_local
"""


def _sample(conn: psycopg.Connection, show: str, alloc: str) -> tuple[int, int]:
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cores, procs = conn.execute(SUB_SUM_SQL, (show, alloc)).fetchone()
    return int(cores), int(procs)


def test_a_burst_lowered_through_cueadmin_under_booking_load_is_never_exceeded_afterwards(
    clients: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Many one-core frames of 0-20 ms on 4 x 16 cores: the loop books continuously, bounded by
    # the burst (40), never by the hosts (64).
    farm = seed(
        "cueburst", managed=True, shows=1, allocs=1, jobs=30, frames_per_layer=60,
        sub_burst=OLD_BURST * 100, folder_max_cores=-1, job_max_cores=-1, **ONE_CORE,
    )  # fmt: skip
    show, alloc = farm.show_ids[0], farm.alloc_ids[0]
    show_name = "cueburst_s0"
    alloc_name = "cueburst_a0"
    stop = threading.Event()
    errors: list[BaseException] = []
    with running_scheduler() as proc, db.connect(autocommit=True, application_name="cuesched-test") as conn:
        loop = make_loop(proc.service, fast_launcher())

        def run() -> None:
            try:
                loop.run(stop)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        thread = threading.Thread(target=run, name="dispatch-loop", daemon=True)
        thread.start()
        try:
            # Under load: the show books, up to its burst.
            wait_for(lambda: _sample(conn, show, alloc)[0] >= NEW_BURST + 4, timeout=60, what="booking load")
            result = clients.cueadmin("-burst", show_name, alloc_name, str(NEW_BURST * 100))
            assert result.returncode == 0, result.stdout + result.stderr
            returned = time.monotonic()

            samples: list[tuple[int, int]] = []
            while time.monotonic() - returned < 6 and not errors:
                samples.append(_sample(conn, show, alloc))
            booked_after = conn.execute(
                "SELECT count(*) FROM frame f JOIN job j ON j.pk_job = f.pk_job WHERE j.pk_show = %s"
                " AND f.str_state IN ('SUCCEEDED', 'RUNNING')",
                (show,),
            ).fetchone()[0]
        finally:
            stop.set()
            thread.join(15)
            loop.close()
    assert not errors, errors
    assert Subscription.objects.get(show_id=show, alloc_id=alloc).int_burst == NEW_BURST * 100
    event = SubscriptionCapEvent.objects.filter(int_burst=NEW_BURST * 100).order_by("pgh_id").last()
    assert event is not None and event.pgh_context.metadata["username"] == "opencue-api"

    cores = [c for c, _ in samples]
    assert len(cores) > 50, f"only {len(cores)} samples"
    breaches = [
        (i, before, after) for i, (before, after) in enumerate(itertools.pairwise(cores))
        if after > max(NEW_BURST, before)
    ]  # fmt: skip
    assert breaches == [], f"booked past the new burst of {NEW_BURST} after cueadmin returned: {breaches[:10]}"
    # The load went on: the show kept booking after the change, and reached the new burst's room.
    assert max(cores[len(cores) // 2 :]) > 0
    assert booked_after > NEW_BURST
