"""Behaviour of the accounting Store (design §1; catalog §5.1, the Store side of §5.2, §5.8).

Pure unit tests: no database. Names follow the catalog where a test comes from it.
"""

from __future__ import annotations

import pytest

from accounting.store import (
    Applied,
    BookingDelta,
    Caps,
    CounterSnapshot,
    LimitChange,
    LimitExceeded,
    LimitKind,
    PgSnapshot,
    Store,
)

SHOW, ALLOC, FOLDER, JOB = "show-1", "alloc-1", "folder-1", "job-1"
SUB = (SHOW, ALLOC)


def delta(cores: int, gpus: int = 0, *, job: str = JOB, folder: str = FOLDER) -> BookingDelta:
    return BookingDelta(SHOW, ALLOC, folder, job, cores, gpus)


def store_with_caps(burst: int = 1000, folder: tuple[int, int] = (-1, -1), job: tuple[int, int] = (-1, -1)) -> Store:
    store = Store()
    store.set_caps({SUB: burst}, {FOLDER: folder}, {JOB: job})
    return store


def snap(cores: int, gpus: int = 0, *, job: str = JOB) -> CounterSnapshot:
    return CounterSnapshot(sub={SUB: (cores, gpus)}, folder={FOLDER: (cores, gpus)}, job={job: (cores, gpus)})


def recompute(store: Store, snapshot: CounterSnapshot, pg: PgSnapshot | None = None) -> None:
    store.overwrite_counters(snapshot, store.begin_recompute(), pg)


def live(store: Store) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    audit = store.audit_snapshot()
    return audit.sub[SUB], audit.folder[FOLDER], audit.job[JOB]


# ------------------------------------------------------------------ §5.1 store.rs


def test_book_rejects_when_unseeded_burst_is_zero() -> None:
    store = Store()
    result = store.book(delta(1))
    assert result == LimitExceeded("subscription", 0, 0)
    assert store.audit_snapshot() == CounterSnapshot()


def test_book_enforces_job_hard_cap_atomically() -> None:
    store = store_with_caps(job=(10, -1))
    assert isinstance(store.book(delta(6)), Applied)
    assert store.book(delta(6)) == LimitExceeded("job", 6, 10)
    assert store.job_cores_in_use(JOB) == 6
    # No partial increment on the vertices checked before the job either.
    assert live(store) == ((6, 0), (6, 0), (6, 0))


def test_unlimited_sentinel_never_rejects() -> None:
    store = store_with_caps(burst=100_000, folder=(-1, -1), job=(-1, -1))
    assert store.book(delta(500, 4)) == Applied(delta(500, 4))
    assert live(store) == ((500, 4), (500, 4), (500, 4))


def test_confirm_then_recompute_keeps_booked() -> None:
    store = store_with_caps()
    store.book(delta(10))
    store.confirm(delta(10))
    recompute(store, CounterSnapshot(job={JOB: (10, 0)}))
    assert store.job_cores_in_use(JOB) == 10


def test_rollback_undoes_book() -> None:
    store = store_with_caps()
    store.book(delta(10))
    store.rollback(delta(10))
    assert store.job_cores_in_use(JOB) == 0
    recompute(store, snap(0))
    assert live(store) == ((0, 0), (0, 0), (0, 0))


def test_recompute_carries_forward_in_flight_booking() -> None:
    store = store_with_caps()
    store.book(delta(8, 1))
    recompute(store, snap(0))
    assert live(store) == ((8, 1), (8, 1), (8, 1))


def test_recompute_does_not_erase_booking_confirmed_after_snapshot_read() -> None:
    store = store_with_caps()
    store.book(delta(8))
    epoch = store.begin_recompute()
    store.confirm(delta(8))  # proc committed after the snapshot was read
    store.overwrite_counters(snap(0), epoch)
    assert store.job_cores_in_use(JOB) == 8
    recompute(store, snap(8))
    assert live(store) == ((8, 0), (8, 0), (8, 0))  # no double count afterwards


def test_release_decrements_unconditionally() -> None:
    store = store_with_caps()
    store.book(delta(10))
    store.confirm(delta(10))
    assert store.apply_delta(delta(-10)) is True
    assert store.job_cores_in_use(JOB) == 0


def test_missed_release_heals_via_recompute() -> None:
    store = store_with_caps()
    store.book(delta(10))
    store.confirm(delta(10))
    recompute(store, snap(10))
    recompute(store, snap(10))  # buckets flushed
    assert store.job_cores_in_use(JOB) == 10  # the release never came
    recompute(store, snap(0))
    assert live(store) == ((0, 0), (0, 0), (0, 0))


def test_managed_flip_seed_prevents_overbook() -> None:
    store = Store()
    store.set_caps({SUB: 100}, {FOLDER: (-1, -1)}, {JOB: (-1, -1)})
    store.seed_show_booked(snap(90))
    assert store.sub_counters(SHOW, ALLOC) == (90, 100)
    assert store.book(delta(20)) == LimitExceeded("subscription", 90, 100)
    assert isinstance(store.book(delta(10)), Applied)
    assert store.sub_counters(SHOW, ALLOC) == (100, 100)


def test_live_limit_change_updates_cap() -> None:
    store = store_with_caps(job=(50, -1))
    assert isinstance(store.book(delta(40)), Applied)
    assert store.apply_limit_change(LimitChange(LimitKind.JOB_MAX_CORES, JOB, 30)) is True
    assert store.book(delta(1)) == LimitExceeded("job", 40, 30)


# ------------------------------------------------------------------ §5.2, the Store side


def test_baseline_key_absent_from_snapshot_resets_to_zero() -> None:
    # A zero baseline row for a drained job resets it; SUM alone would omit the key.
    store = store_with_caps()
    store.book(delta(5, 1))
    store.confirm(delta(5, 1))
    recompute(store, snap(5, 1))
    recompute(store, snap(0, 0))
    assert store.audit_snapshot().job[JOB] == (0, 0)


def test_snapshot_writes_each_vertex_independently() -> None:
    store = store_with_caps()
    recompute(store, CounterSnapshot(sub={SUB: (35, 3)}, folder={FOLDER: (35, 3)}, job={"a": (10, 1), "b": (25, 2)}))
    audit = store.audit_snapshot()
    assert (audit.sub[SUB], audit.folder[FOLDER], audit.job) == ((35, 3), (35, 3), {"a": (10, 1), "b": (25, 2)})


# ------------------------------------------------------------------ cap rules (§1.3, §1.4)


def test_check_order_and_tables() -> None:
    store = Store()
    store.set_caps({SUB: 10}, {FOLDER: (5, 1)}, {JOB: (3, 1)})
    assert store.book(delta(11)) == LimitExceeded("subscription", 0, 10)
    assert store.book(delta(6)) == LimitExceeded("folder", 0, 5)
    assert store.book(delta(4)) == LimitExceeded("job", 0, 3)
    assert store.book(delta(1, 2)) == LimitExceeded("folder_gpus", 0, 1)
    store.set_caps({}, {FOLDER: (5, 5)}, {})
    assert store.book(delta(1, 2)) == LimitExceeded("job_gpus", 0, 1)
    assert store.audit_snapshot() == CounterSnapshot()  # nothing mutated by any rejection


def test_reaching_a_cap_exactly_is_allowed() -> None:
    store = Store()
    store.set_caps({SUB: 10}, {FOLDER: (10, 2)}, {JOB: (10, 2)})
    assert isinstance(store.book(delta(10, 2)), Applied)
    assert store.book(delta(1)) == LimitExceeded("subscription", 10, 10)
    assert store.book(delta(0, 1)) == LimitExceeded("folder_gpus", 2, 2)


@pytest.mark.parametrize("burst", [0, -1, -100])
def test_zero_or_negative_burst_rejects_all_cores(burst: int) -> None:
    store = store_with_caps(burst=burst)
    # Even a counter driven negative by releases must not let a booking through.
    store.seed_show_booked(snap(-50))
    assert store.book(delta(1)) == LimitExceeded("subscription", -50, burst)


@pytest.mark.parametrize("cap", [-1, -7])
def test_folder_and_job_caps_below_zero_are_unlimited(cap: int) -> None:
    store = store_with_caps(folder=(cap, cap), job=(cap, cap))
    assert isinstance(store.book(delta(999, 99)), Applied)


def test_a_folder_or_job_cap_of_zero_books_nothing() -> None:
    # Issue 20 problem 2: one meaning of 0 for every cap (as a burst of 0): typing 0 to stop a
    # folder used to lift its cap. Cores and GPUs, folder and job, each on its own.
    assert store_with_caps(folder=(0, -1)).book(delta(1)) == LimitExceeded("folder", 0, 0)
    assert store_with_caps(job=(0, -1)).book(delta(1)) == LimitExceeded("job", 0, 0)
    assert store_with_caps(folder=(-1, 0), job=(-1, -1)).book(delta(1, 1)) == LimitExceeded("folder_gpus", 0, 0)
    assert store_with_caps(folder=(-1, -1), job=(-1, 0)).book(delta(1, 1)) == LimitExceeded("job_gpus", 0, 0)
    # A zero-GPU booking is not refused by a GPU cap of 0; nothing was mutated by the refusals.
    store = store_with_caps(folder=(-1, 0), job=(-1, 0))
    assert isinstance(store.book(delta(1)), Applied)


def test_missing_folder_and_job_caps_fail_closed() -> None:
    # The reference failed open here: a new or reopened job booked without its max cores until
    # the next reseed. Now the Store refuses what it cannot check, and says which cap is missing.
    store = Store()
    store.set_caps({SUB: 50}, {}, {})
    assert store.book(delta(5)) == LimitExceeded("folder_unseeded", 0, 0)
    store.set_caps({}, {FOLDER: (-1, -1)}, {})
    assert store.book(delta(5)) == LimitExceeded("job_unseeded", 0, 0)
    store.set_caps({}, {}, {JOB: (-1, -1)})
    assert isinstance(store.book(delta(50, 7)), Applied)


def test_zero_core_positive_gpu_booking_skips_burst() -> None:
    # §5.8: no burst seeded, yet a GPU-only booking passes (the core checks are gated); the
    # folder and job caps must be known, as for any booking.
    store = Store()
    store.set_caps({}, {FOLDER: (-1, -1)}, {JOB: (-1, -1)})
    assert isinstance(store.book(delta(0, 2)), Applied)
    assert live(store) == ((0, 2), (0, 2), (0, 2))


def test_zero_zero_booking_always_succeeds() -> None:
    store = Store()
    store.set_caps({SUB: 0}, {FOLDER: (1, 1)}, {JOB: (1, 1)})
    store.seed_show_booked(snap(5, 5))
    assert isinstance(store.book(delta(0, 0)), Applied)


def test_gpu_check_ignores_core_caps_when_cores_are_zero() -> None:
    store = store_with_caps(job=(1, 4))
    store.seed_show_booked(snap(1))  # job at its core cap
    assert isinstance(store.book(delta(0, 4)), Applied)
    assert store.book(delta(0, 1)) == LimitExceeded("job_gpus", 4, 4)


def test_limit_exceeded_text() -> None:
    assert str(LimitExceeded("job", 6, 10)) == "limit exceeded on job: current=6 limit=10"


# ------------------------------------------------------------------ confirm / rollback / release


def test_confirm_moves_inflight_to_settled() -> None:
    store = store_with_caps()
    store.book(delta(4, 1))
    assert store.inflight_snapshot().job[JOB] == (4, 1)
    store.confirm(delta(4, 1))
    assert store.inflight_snapshot().job[JOB] == (0, 0)
    assert store.job_cores_in_use(JOB) == 4


def test_apply_delta_on_unknown_key_creates_nothing() -> None:
    store = Store()
    assert store.apply_delta(delta(-3, -1)) is False
    assert store.apply_delta(delta(-3, -1), xid=42) is False
    assert store.audit_snapshot() == CounterSnapshot()


def test_release_has_no_floor_and_no_cap_check() -> None:
    store = store_with_caps()
    store.seed_show_booked(snap(2))
    store.apply_delta(delta(-5, -1))
    assert live(store) == ((-3, -1), (-3, -1), (-3, -1))


def test_release_applies_only_to_existing_keys() -> None:
    store = store_with_caps()
    store.seed_show_booked(CounterSnapshot(job={JOB: (5, 0)}))
    assert store.apply_delta(delta(-2)) is True
    audit = store.audit_snapshot()
    assert audit.job == {JOB: (3, 0)} and audit.sub == {} and audit.folder == {}


# ------------------------------------------------------------------ recompute protocol (§1.6, §5.8)


def test_begin_without_overwrite_never_under_counts() -> None:
    store = store_with_caps()
    store.book(delta(6))
    store.book(delta(4))
    store.begin_recompute()  # this pass fails after begin: no overwrite
    store.confirm(delta(6))  # its proc committed before the next begin
    epoch = store.begin_recompute()
    store.confirm(delta(4))  # its proc committed after the next read
    store.overwrite_counters(snap(6), epoch)
    assert store.job_cores_in_use(JOB) == 10
    recompute(store, snap(10))
    assert store.job_cores_in_use(JOB) == 10


def test_failed_pass_over_counts_transiently_then_heals() -> None:
    store = store_with_caps()
    store.book(delta(6))
    epoch = store.begin_recompute()
    store.confirm(delta(6))  # settled in the "since begin" bucket
    store.begin_recompute()  # that pass never overwrote; a new pass begins
    recompute(store, snap(6))  # the bucket of the failed pass is carried once: high
    assert store.job_cores_in_use(JOB) >= 6
    recompute(store, snap(6))
    assert store.job_cores_in_use(JOB) == 6
    assert epoch == 0


def test_key_absent_from_snapshot_keeps_live_value_and_clears_its_bucket() -> None:
    store = store_with_caps()
    store.book(delta(7))
    store.confirm(delta(7))  # bucket of epoch 0
    recompute(store, CounterSnapshot())  # job absent from the snapshot
    assert store.job_cores_in_use(JOB) == 7
    # Its old bucket was cleared: a later snapshot of 0 is not topped up by the stale confirm.
    recompute(store, snap(0))
    assert live(store) == ((0, 0), (0, 0), (0, 0))


def test_bucket_parity_carries_only_confirms_after_begin() -> None:
    store = store_with_caps()
    before, after = delta(3, job="job-before"), delta(5, job="job-after")
    store.set_caps({}, {}, {"job-before": (-1, -1), "job-after": (-1, -1)})
    store.book(before)
    store.book(after)
    store.confirm(before)  # before begin: the snapshot surely has its proc
    epoch = store.begin_recompute()
    store.confirm(after)  # after begin: the snapshot may not
    store.overwrite_counters(CounterSnapshot(job={"job-before": (3, 0), "job-after": (0, 0)}), epoch)
    assert store.audit_snapshot().job == {"job-before": (3, 0), "job-after": (5, 0)}


def test_many_passes_alternate_buckets() -> None:
    store = store_with_caps()
    for n in range(1, 6):
        store.book(delta(1))
        epoch = store.begin_recompute()
        store.confirm(delta(1))
        store.overwrite_counters(snap(n - 1), epoch)  # the new proc is not in this read
        assert store.job_cores_in_use(JOB) == n
    recompute(store, snap(5))
    assert store.job_cores_in_use(JOB) == 5


def test_overwrite_rejects_a_stale_epoch() -> None:
    store = store_with_caps()
    first = store.begin_recompute()
    store.begin_recompute()
    with pytest.raises(ValueError):
        store.overwrite_counters(snap(0), first)
    with pytest.raises(ValueError):
        Store().overwrite_counters(snap(0), 0)  # no pass open


def test_epoch_counts_passes() -> None:
    store = Store()
    assert store.epoch == 0
    assert store.begin_recompute() == 0
    assert store.begin_recompute() == 1
    assert store.epoch == 2


def test_seed_keeps_inflight_bookings_on_top_of_the_snapshot() -> None:
    # A show re-seeded after a flip round trip can have a booking in flight; the seed used to
    # drop it, so the booking's rollback later read the counter LOW by its cores.
    store = store_with_caps()
    store.book(delta(4))
    store.seed_show_booked(snap(10))
    assert store.job_cores_in_use(JOB) == 14
    assert store.inflight_snapshot().job[JOB] == (4, 0)
    store.rollback(delta(4))
    assert store.job_cores_in_use(JOB) == 10
    assert store.epoch == 0


# ------------------------------------------------------------------ exactly-once releases


def test_pg_snapshot_parse_and_visibility() -> None:
    pg = PgSnapshot.parse("100:104:100,102")
    assert pg == PgSnapshot(100, 104, frozenset({100, 102}))
    assert [pg.visible(x) for x in (99, 100, 101, 102, 103, 104)] == [True, False, True, False, True, False]
    assert PgSnapshot.parse("7:7:") == PgSnapshot(7, 7, frozenset())
    for bad in ("", "1:2", "a:b:", "5:3:", "1:4:9", "1:4:0"):
        with pytest.raises(ValueError):
            PgSnapshot.parse(bad)


def test_release_visible_in_last_snapshot_is_skipped() -> None:
    store = store_with_caps()
    store.book(delta(10))
    store.confirm(delta(10))
    # Cuebot deleted the proc in xid 500 and committed; the next recompute read after that.
    recompute(store, snap(0), PgSnapshot.parse("501:501:"))
    assert store.apply_delta(delta(-10), xid=500) is False  # late release: already excluded
    assert live(store) == ((0, 0), (0, 0), (0, 0))


def test_release_not_visible_in_last_snapshot_is_applied() -> None:
    store = store_with_caps()
    store.book(delta(10))
    store.confirm(delta(10))
    recompute(store, snap(10), PgSnapshot.parse("500:502:500"))  # xid 500 still in progress
    assert store.apply_delta(delta(-10), xid=500) is True
    assert live(store) == ((0, 0), (0, 0), (0, 0))
    recompute(store, snap(0), PgSnapshot.parse("503:503:"))
    assert store.apply_delta(delta(-10), xid=503) is True  # committed after the read


def test_release_without_xid_keeps_reference_behaviour() -> None:
    store = store_with_caps()
    recompute(store, snap(10), PgSnapshot.parse("501:501:"))
    assert store.apply_delta(delta(-10)) is True
    assert store.job_cores_in_use(JOB) == 0


def test_release_decided_per_key() -> None:
    store = store_with_caps()
    store.seed_show_booked(snap(10), PgSnapshot.parse("100:100:"))
    # A later pass rewrote only the job (its folder and sub rows were absent from the read).
    recompute(store, CounterSnapshot(job={JOB: (0, 0)}), PgSnapshot.parse("301:301:"))
    assert store.apply_delta(delta(-10), xid=300) is True
    assert live(store) == ((0, 0), (0, 0), (0, 0))


def test_overwrite_without_pg_snapshot_forgets_the_old_one() -> None:
    store = store_with_caps()
    recompute(store, snap(10), PgSnapshot.parse("501:501:"))
    recompute(store, snap(10))  # provenance unknown from here on: reference behaviour
    assert store.apply_delta(delta(-10), xid=500) is True
    assert store.job_cores_in_use(JOB) == 0


def test_seed_records_its_snapshot() -> None:
    store = store_with_caps()
    store.seed_show_booked(snap(4), PgSnapshot.parse("90:95:91"))
    assert store.apply_delta(delta(-4), xid=89) is False
    assert store.apply_delta(delta(-4), xid=91) is True
    assert store.job_cores_in_use(JOB) == 0


# ------------------------------------------------------------------ caps (§1.7, §5.8) and reseed races


def test_set_caps_never_deletes() -> None:
    store = Store()
    store.set_caps({SUB: 10}, {FOLDER: (5, 1)}, {JOB: (3, 1)})
    store.set_caps({}, {}, {})
    store.set_caps({("s2", "a2"): 1}, {}, {"job-2": (1, 1)})
    assert store.caps() == Caps(
        sub={SUB: 10, ("s2", "a2"): 1}, folder={FOLDER: (5, 1)}, job={JOB: (3, 1), "job-2": (1, 1)}
    )


def test_one_field_change_on_unseen_folder_leaves_it_closed() -> None:
    # Cuebot sends one field per message. For a folder the Store does not hold, the other field
    # is unknown: the reference created it unlimited (-1); now the key stays missing (closed)
    # until a fill or reseed reads both, and a message with both fields creates it.
    store = Store()
    assert store.apply_limit_change(LimitChange(LimitKind.FOLDER_MAX_GPUS, FOLDER, 3)) is False
    assert store.folder_cap(FOLDER) is None
    store.apply_limit_change(LimitChange(LimitKind.JOB_MAX_CORES, JOB, 12))
    assert store.job_cap(JOB) is None
    assert store.apply_limit_change(LimitChange(LimitKind.JOB_CAPS, JOB, (12, -1))) is True
    assert store.job_cap(JOB) == (12, -1)
    store.apply_limit_change(LimitChange(LimitKind.SUB_BURST, SUB, 200))
    assert store.sub_counters(SHOW, ALLOC) == (0, 200)


def test_caps_returns_copies() -> None:
    store = store_with_caps()
    caps = store.caps()
    caps.sub[SUB] = 0
    caps.job.clear()
    assert store.caps().sub[SUB] == 1000 and store.job_cap(JOB) == (-1, -1)


def test_accessors_on_unknown_keys() -> None:
    store = Store()
    assert store.job_cores_in_use("nope") == 0
    assert store.sub_counters("s", "a") == (0, 0)
    assert store.job_cap("nope") is None and store.folder_cap("nope") is None


def test_reseed_does_not_overwrite_newer_notification() -> None:
    store = Store()
    store.set_caps({SUB: 100}, {}, {JOB: (50, 4)}, PgSnapshot.parse("10:10:"))
    # The reseed reads its rows under snapshot 20:20: ... meanwhile xid 25 lowers the job
    # cap, commits, and its notification is applied before the reseed's set_caps lands.
    reseed_read = PgSnapshot.parse("20:20:")
    assert store.apply_limit_change(LimitChange(LimitKind.JOB_MAX_CORES, JOB, 8), xid=25) is True
    assert store.apply_limit_change(LimitChange(LimitKind.SUB_BURST, SUB, 60), xid=26) is True
    store.set_caps({SUB: 100}, {}, {JOB: (50, 6)}, reseed_read)
    assert store.job_cap(JOB) == (8, 6)  # cores kept from the notification, GPUs from the reseed
    assert store.sub_counters(SHOW, ALLOC) == (0, 60)
    # A later reseed that saw xid 25 and 26 is authoritative again.
    store.set_caps({SUB: 70}, {}, {JOB: (9, 6)}, PgSnapshot.parse("30:30:"))
    assert store.job_cap(JOB) == (9, 6)
    assert store.sub_counters(SHOW, ALLOC) == (0, 70)


def test_notification_the_reseed_already_saw_is_skipped() -> None:
    store = Store()
    store.set_caps({}, {FOLDER: (50, 4)}, {}, PgSnapshot.parse("10:10:"))
    # xid 15 set folder max 20 and committed; a second change (xid 16) set 30 and committed;
    # the reseed read at 17:17: saw both and wrote 30. The notification of 15 arrives late.
    store.set_caps({}, {FOLDER: (30, 4)}, {}, PgSnapshot.parse("17:17:"))
    assert store.apply_limit_change(LimitChange(LimitKind.FOLDER_MAX_CORES, FOLDER, 20), xid=15) is False
    assert store.folder_cap(FOLDER) == (30, 4)
    # A change the reseed could not see is applied.
    assert store.apply_limit_change(LimitChange(LimitKind.FOLDER_MAX_CORES, FOLDER, 25), xid=17) is True
    assert store.folder_cap(FOLDER) == (25, 4)


def test_notification_in_progress_at_reseed_is_applied() -> None:
    store = Store()
    store.set_caps({}, {}, {JOB: (50, 4)}, PgSnapshot.parse("12:20:12"))
    assert store.apply_limit_change(LimitChange(LimitKind.JOB_MAX_GPUS, JOB, 1), xid=12) is True
    assert store.job_cap(JOB) == (50, 1)


def test_older_overlapping_reseed_does_not_undo_newer_one() -> None:
    store = Store()
    store.set_caps({SUB: 10}, {}, {JOB: (5, 5)}, PgSnapshot.parse("40:40:"))
    store.set_caps({SUB: 99}, {}, {JOB: (99, 99)}, PgSnapshot.parse("30:35:31"))  # read earlier
    assert store.caps() == Caps(sub={SUB: 10}, folder={}, job={JOB: (5, 5)})
    store.set_caps({SUB: 11}, {}, {JOB: (6, 6)}, PgSnapshot.parse("40:40:"))  # same view: written
    assert store.caps().sub[SUB] == 11


def test_reseed_without_snapshot_keeps_reference_behaviour() -> None:
    store = Store()
    store.apply_limit_change(LimitChange(LimitKind.JOB_MAX_CORES, JOB, 8), xid=25)
    store.set_caps({}, {}, {JOB: (50, 4)})
    assert store.job_cap(JOB) == (50, 4)
    # And a notification without xid always applies.
    store.set_caps({}, {}, {JOB: (50, 4)}, PgSnapshot.parse("99:99:"))
    assert store.apply_limit_change(LimitChange(LimitKind.JOB_MAX_CORES, JOB, 7)) is True
    assert store.job_cap(JOB) == (7, 4)


# ------------------------------------------------------------------ eviction


def test_evict_drops_idle_finished_jobs() -> None:
    store = store_with_caps()
    store.book(delta(2))
    store.confirm(delta(2))
    store.apply_delta(delta(-2))
    recompute(store, snap(0))
    recompute(store, snap(0))  # both settled buckets are now empty
    assert store.evict_jobs([JOB, "never-seen"]) == 1
    assert JOB not in store.audit_snapshot().job
    assert store.job_cap(JOB) == (-1, -1)  # caps are only removed by a complete reseed
    assert store.audit_snapshot().folder[FOLDER] == (0, 0)  # folders and subs stay


def test_evict_never_drops_a_booking() -> None:
    store = store_with_caps()
    store.book(delta(2))
    assert store.evict_jobs([JOB]) == 0  # in flight
    epoch = store.begin_recompute()
    store.confirm(delta(2))
    store.apply_delta(delta(-2))
    assert store.job_cores_in_use(JOB) == 0
    assert store.evict_jobs([JOB]) == 0  # settled amount not yet proven to be in a snapshot
    store.overwrite_counters(snap(0), epoch)
    assert store.evict_jobs([JOB]) == 0  # confirmed after begin: still carried by this pass
    recompute(store, snap(0))
    assert store.evict_jobs([JOB]) == 1


def test_evict_keeps_a_counter_reading_high() -> None:
    store = store_with_caps()
    store.seed_show_booked(snap(3))  # e.g. a lost release on a finished job
    assert store.evict_jobs([JOB]) == 0
    assert store.job_cores_in_use(JOB) == 3


def test_evict_never_drops_a_cap() -> None:
    # This test used to assert the risky direction: eviction dropped the caps of a job it could
    # not see, including a cap a notification set after the recompute's snapshot, and the job
    # then booked without its max cores. Eviction now drops counters only.
    store = Store()
    store.apply_limit_change(LimitChange(LimitKind.JOB_CAPS, JOB, (4, -1)))
    assert store.evict_jobs(iter([JOB])) == 0
    assert store.caps().job == {JOB: (4, -1)}


def test_complete_reseed_removes_caps_it_no_longer_finds_unless_newer() -> None:
    store = Store()
    old = PgSnapshot(100, 100)
    store.set_caps({SUB: 10}, {FOLDER: (5, -1)}, {JOB: (4, -1)}, pg_snapshot=old)
    store.apply_limit_change(LimitChange(LimitKind.JOB_CAPS, "job-new", (2, -1)), xid=150)
    newer = PgSnapshot(120, 120)  # does not see xid 150
    assert store.set_caps({}, {FOLDER: (5, -1)}, {}, pg_snapshot=newer, complete=True) == 2
    assert store.caps().sub == {} and store.job_cap(JOB) is None
    assert store.job_cap("job-new") == (2, -1)  # notified after the read: kept
    # A fill that read before the removal cannot bring the cap back.
    store.set_caps({}, {}, {JOB: (4, -1)}, pg_snapshot=PgSnapshot(110, 110))
    assert store.job_cap(JOB) is None
    store.set_caps({}, {}, {JOB: (3, -1)}, pg_snapshot=PgSnapshot(130, 130))
    assert store.job_cap(JOB) == (3, -1)


def test_removal_notification_closes_the_key_and_an_older_fill_cannot_reopen_it() -> None:
    store = store_with_caps(job=(8, -1))
    assert store.apply_limit_change(LimitChange(LimitKind.JOB_REMOVED, JOB, 0), xid=200) is True
    assert store.book(delta(1)) == LimitExceeded("job_unseeded", 0, 0)
    store.set_caps({}, {}, {JOB: (8, -1)}, pg_snapshot=PgSnapshot(150, 150))  # read before the delete
    assert store.job_cap(JOB) is None
    assert store.apply_limit_change(LimitChange(LimitKind.SUB_REMOVED, SUB, 0), xid=201) is True
    assert store.sub_counters(SHOW, ALLOC)[1] == 0


def test_positive_delta_creates_a_missing_key_with_only_its_positive_part() -> None:
    store = store_with_caps()
    store.apply_delta(BookingDelta(SHOW, ALLOC, FOLDER, "job-x", 3, -1), xid=10)
    assert store.audit_snapshot().job["job-x"] == (3, 0)
    store.apply_delta(BookingDelta(SHOW, ALLOC, FOLDER, "job-y", -3, 0), xid=11)
    assert "job-y" not in store.audit_snapshot().job


def test_forget_sources_lets_the_next_reseed_write_unconditionally() -> None:
    # After a failover the new server's snapshots look older than every recorded one.
    store = store_with_caps(job=(8, -1))
    store.set_caps({}, {}, {JOB: (8, -1)}, pg_snapshot=PgSnapshot(9000, 9000))
    store.set_caps({}, {}, {JOB: (2, -1)}, pg_snapshot=PgSnapshot(700, 700))
    assert store.job_cap(JOB) == (8, -1)  # frozen: the new server looks like the past
    store.forget_sources()
    store.set_caps({}, {}, {JOB: (2, -1)}, pg_snapshot=PgSnapshot(700, 700))
    assert store.job_cap(JOB) == (2, -1)


# ------------------------------------------------------------------ releases during a read


def test_release_applied_between_snapshot_read_and_overwrite_is_not_lost() -> None:
    """The snapshot (xmax 100) still counted the proc deleted by xid 105; the release arrived
    while the pass was reading. The absolute overwrite must not erase it."""
    store = store_with_caps()
    recompute(store, snap(10), PgSnapshot(90, 90, frozenset()))
    epoch = store.begin_recompute()  # the pass opens ...
    read_under = PgSnapshot(100, 100, frozenset())  # ... reads 10 cores under this snapshot ...
    assert store.apply_delta(delta(-4), xid=105)  # ... the delete commits after the read
    store.overwrite_counters(snap(10), epoch, read_under)
    assert live(store) == ((6, 0), (6, 0), (6, 0))
    # The next pass sees the delete too: exact, never counted twice.
    recompute(store, snap(6), PgSnapshot(120, 120, frozenset()))
    assert live(store) == ((6, 0), (6, 0), (6, 0))


def test_release_already_in_the_snapshot_is_not_replayed() -> None:
    store = store_with_caps()
    recompute(store, snap(10), PgSnapshot(90, 90, frozenset()))
    epoch = store.begin_recompute()
    assert store.apply_delta(delta(-4), xid=95)  # committed before the read: the SUM excludes it
    store.overwrite_counters(snap(6), epoch, PgSnapshot(100, 100, frozenset()))
    assert live(store) == ((6, 0), (6, 0), (6, 0))


def test_managed_flip_seed_replays_a_release_for_keys_it_had_not_seen() -> None:
    """A newly managed show has no keys yet: a release during its seed read is skipped by
    apply_delta (unknown keys) but must still count once the seed writes the keys."""
    store = Store()
    store.open_release_window()
    assert not store.apply_delta(delta(-3), xid=205)  # no key yet: nothing applied now
    store.seed_show_booked(snap(9), pg_snapshot=PgSnapshot(200, 200, frozenset()))
    assert live(store) == ((6, 0), (6, 0), (6, 0))


def test_without_a_snapshot_a_window_release_is_not_replayed() -> None:
    """No snapshot to judge by: leave the counter high (the safe side) for the next pass."""
    store = store_with_caps()
    epoch = store.begin_recompute()
    store.apply_delta(delta(-4), xid=105)
    store.overwrite_counters(snap(10), epoch, None)
    assert live(store) == ((10, 0), (10, 0), (10, 0))
