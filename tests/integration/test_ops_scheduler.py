"""The console against a real running scheduler (a SchedulerProcess in a thread, the test database):
a cap saved through the console is reported applied, with its time, once the listener has it;
a flip is reported published once the managed-shows loop has seeded the show."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AbstractBaseUser

from accounting import actions
from ops import permissions, status
from tests.integration.ops_support import make_user
from tests.integration.runtime_support import autocommit_conn, make_farm, running_scheduler, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operator() -> AbstractBaseUser:
    return make_user("olga", permissions.OPERATORS)


def test_a_lowered_job_cap_is_reported_applied_by_the_running_scheduler(operator: AbstractBaseUser) -> None:
    with autocommit_conn() as conn:
        farm = make_farm(conn, "opsjob", job_max_cores=40)
    job = farm.jobs[0]
    with running_scheduler(publish_interval=0.05) as proc:
        result = actions.set_job_caps(job, max_cores=12, actor=operator)

        def cap() -> status.CapStatus:
            return status.cap_status(
                status.read_view(),
                vertex="job",
                key=job,
                column="int_max_cores",
                db_value=1200,
                show_id=farm.show,
                show_managed=True,
            )

        wait_for(lambda: cap().state == "applied" and cap().at is not None, timeout=10, what="cap applied")
        applied = cap()
        assert proc.service.store.caps().job[job][0] == 12
        assert result.committed_at - 1 <= applied.at <= result.committed_at + 10  # type: ignore[operator]
        assert "Applied by the scheduler" in applied.message and "enforces 12" in applied.message


def test_a_flip_is_reported_published_once_the_scheduler_seeded_the_show(
    operator: AbstractBaseUser, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUESCHED_MANAGED_SHOWS_TTL", "0.2")
    with autocommit_conn() as conn:
        farm = make_farm(conn, "opsflip", managed=False)
        for _ in range(3):
            farm.add_proc(conn, cores=2)
    with running_scheduler(publish_interval=0.05) as proc:
        assert status.flip_status(status.read_view(), farm.show, False).state == "database"
        actions.flip_show(farm.show, True, actor=operator)
        assert status.flip_status(status.read_view(), farm.show, True).state in ("pending", "published")
        wait_for(
            lambda: status.flip_status(status.read_view(), farm.show, True).state == "published",
            timeout=10,
            what="show published as managed",
        )
        # Seeded before it was published: the Store already counts the 6 running cores.
        assert proc.service.store.sub_counters(farm.show, farm.alloc)[0] == 6
        actions.flip_show(farm.show, False, actor=operator)
        wait_for(
            lambda: status.flip_status(status.read_view(), farm.show, False).state == "database",
            timeout=10,
            what="show dropped by the scheduler",
        )
