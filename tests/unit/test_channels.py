"""Payload parsing: the reference's listener tests (§5.3) plus every malformed input of §5.8."""

from __future__ import annotations

import json

import pytest

from accounting.channels import PayloadError, parse_limit_change, parse_release
from accounting.store import LimitKind

SHOW = "00000000-0000-0000-0000-0000000000a1"
ALLOC = "00000000-0000-0000-0000-0000000000a2"
FOLDER = "00000000-0000-0000-0000-0000000000a3"
JOB = "00000000-0000-0000-0000-0000000000a4"
LAYER = "00000000-0000-0000-0000-0000000000a5"
DEPT = "00000000-0000-0000-0000-0000000000a6"


def release(**overrides: object) -> str:
    body: dict[str, object] = {
        "show": SHOW, "alloc": ALLOC, "folder": FOLDER, "job": JOB, "layer": LAYER, "dept": DEPT,
        "cores": -10, "gpus": -1,
    }
    body.update(overrides)
    return json.dumps({k: v for k, v in body.items() if v is not ...})


def test_parses_release_payload() -> None:
    parsed = parse_release(release(extra="ignored"))
    assert parsed.delta.cores == -10
    assert parsed.delta.gpus == -1
    assert parsed.delta.job == JOB
    assert (parsed.delta.show, parsed.delta.alloc, parsed.delta.folder) == (SHOW, ALLOC, FOLDER)
    assert parsed.xid is None


def test_release_carries_xid() -> None:
    assert parse_release(release(xid=123456789012)).xid == 123456789012


def test_parses_sub_burst_change() -> None:
    notice = parse_limit_change(json.dumps({"vertex": "sub", "show": SHOW, "alloc": ALLOC, "burst": 200}))
    assert len(notice.changes) == 1
    change = notice.changes[0]
    assert (change.kind, change.key, change.value) == (LimitKind.SUB_BURST, (SHOW, ALLOC), 200)


def test_parses_job_max_cores_change_preserving_unlimited() -> None:
    notice = parse_limit_change(json.dumps({"vertex": "job", "id": JOB, "max_cores": -1, "xid": 7}))
    assert [(c.kind, c.key, c.value) for c in notice.changes] == [(LimitKind.JOB_MAX_CORES, JOB, -1)]
    assert notice.xid == 7


def test_folder_change_with_both_fields_is_one_change() -> None:
    # One change, not the reference's two: a Store that does not hold the folder can only
    # create its entry from both values at once (a missing folder fails closed).
    notice = parse_limit_change(json.dumps({"vertex": "folder", "id": FOLDER, "max_cores": 20, "max_gpus": 4}))
    assert [(c.kind, c.value) for c in notice.changes] == [(LimitKind.FOLDER_CAPS, (20, 4))]


def test_removed_rows_parse_as_removals() -> None:
    sub = parse_limit_change(json.dumps({"vertex": "sub", "show": FOLDER, "alloc": FOLDER, "removed": True}))
    job = parse_limit_change(json.dumps({"vertex": "job", "id": FOLDER, "removed": True, "xid": 7}))
    assert [c.kind for c in sub.changes] == [LimitKind.SUB_REMOVED]
    assert [c.kind for c in job.changes] == [LimitKind.JOB_REMOVED] and job.xid == 7


def test_folder_change_with_neither_field_does_nothing() -> None:
    assert parse_limit_change(json.dumps({"vertex": "folder", "id": FOLDER})).changes == ()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ("not json", "not JSON"),
        ("", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('"a string"', "JSON object"),
        (release(show=...), "missing field 'show'"),
        (release(cores=...), "missing field 'cores'"),
        (release(cores="10"), "must be an integer"),
        (release(cores=1.5), "must be an integer"),
        (release(cores=True), "must be an integer"),
        (release(gpus=None), "must be an integer"),
        (release(job="not-a-uuid"), "not a UUID"),
        (release(job=12), "must be a UUID string"),
        (release(job="{00000000-0000-0000-0000-0000000000a4}"), "canonical"),
        (release(cores=2**63), "out of range"),
        (release(gpus=2**31), "out of range"),
        (release(xid=-5), "out of range"),
        (release(xid="5"), "must be an integer"),
    ],
)
def test_malformed_release_is_rejected_with_reason(payload: str, reason: str) -> None:
    with pytest.raises(PayloadError, match=reason):
        parse_release(payload)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"vertex": "layer", "id": JOB, "max_cores": 1}, "unknown vertex"),
        ({"id": JOB, "max_cores": 1}, "unknown vertex"),
        ({"vertex": "sub", "show": SHOW, "burst": 1}, "missing field 'alloc'"),
        ({"vertex": "sub", "show": SHOW, "alloc": ALLOC}, "missing field 'burst'"),
        ({"vertex": "job", "max_cores": 1}, "missing field 'id'"),
        ({"vertex": "job", "id": "x" * 36, "max_cores": 1}, "not a UUID"),
        ({"vertex": "folder", "id": FOLDER, "max_gpus": "4"}, "must be an integer"),
        ({"vertex": "job", "id": JOB, "max_cores": 2**70}, "out of range"),
    ],
)
def test_malformed_limit_change_is_rejected_with_reason(body: dict[str, object], reason: str) -> None:
    with pytest.raises(PayloadError, match=reason):
        parse_limit_change(json.dumps(body))
