"""A host freed outside the loop (its agent ended the frame) is booked again without a full reload."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dispatch.engine.booking import Booking
from dispatch.engine.completion import Completion, complete
from dispatch.hosts.launchers.remote import RemoteLauncher
from tests.integration.dispatch_support import autocommit, make_loop, scalar, seed, wait_for
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)


class AgentsElsewhere(RemoteLauncher):
    """A remote launcher whose frames go nowhere: the test plays the agent and completes them."""

    name = "agents-elsewhere"

    def _silent(self, bookings: Sequence[Booking]) -> dict[str, str]:
        return {}

    def send(self, live: Sequence[Booking]) -> list[tuple[Booking, str]]:
        return []


def test_a_host_its_agent_freed_is_booked_again_within_the_changes_interval(monkeypatch) -> None:
    monkeypatch.setenv("CUESCHED_HOST_CHANGES_INTERVAL", "0.05")
    seed(
        "hchg",
        hosts=1,
        jobs=1,
        layers=1,
        frames_per_layer=2,
        manual_tags=0,
        host_cores_choices=(1,),
        layer_cores_choices=(1,),
    )
    launcher = AgentsElsewhere()
    with running_scheduler() as proc, autocommit() as conn:
        # No full reload after the first: only the changed-hosts read can show the freed host.
        with make_loop(proc.service, launcher, host_refresh_interval=3600) as loop:
            assert loop.run_once().booked == 1
            assert loop.run_once().booked == 0  # the one core is taken
            first = scalar(conn, "SELECT pk_proc FROM proc")
            # What the host's agent does when the frame ends: the completion, from its own connection.
            assert complete(conn, [Completion(first, 0)]).released == 1
            wait_for(lambda: loop.run_once().booked == 1, timeout=10, what="the freed host booked again")
        launcher.close()
        assert scalar(conn, "SELECT count(*) FROM proc") == 1
