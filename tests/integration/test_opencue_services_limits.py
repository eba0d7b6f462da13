"""pycue 1.37 reads the farm's services and lists, finds, creates and changes licence limits (issue 30).

The real client runs in its own environment against our server; every answer is checked against
the database, every change against its audit row, and every refusal leaves both as they were.
"""

from __future__ import annotations

import json

import pytest

from dispatch.models import LayerLimit, LimitRecord, Service
from ops.models import LimitRecordEvent
from tests.integration import farm_fixtures as ff
from tests.integration.opencue_clients import Clients

pytestmark = pytest.mark.django_db(transaction=True)

# Prints a pycue call's refusal as the client sees it: the exception's class and gRPC's status.
REFUSAL = """
import opencue, grpc
def refusal(call):
    try:
        call()
    except grpc.RpcError as exc:
        print(json.dumps(["RpcError", exc.code().name, exc.details()]))
    except Exception as exc:
        print(json.dumps([type(exc).__name__, "", str(exc)]))
    else:
        print(json.dumps(["accepted", "", ""]))
"""


def pycue_json(clients: Clients, script: str) -> object:
    result = clients.pycue("import json, opencue\n" + script)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json.loads(result.stdout)


def refusals(clients: Clients, *calls: str) -> list[list[str]]:
    result = clients.pycue("import json\n" + REFUSAL + "\n".join(f"refusal(lambda: {c})" for c in calls))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


SERVICE_FIELDS = """
def fields(s):
    return [s.id(), s.name(), s.threadable(), s.minCores(), s.maxCores(), s.minMemory(), s.minGpuMemory(),
            list(s.tags()), s.timeout(), s.timeoutLLU(), s.minGpus(), s.maxGpus(), s.minMemoryIncrease()]
"""


def _db_service(s: Service) -> list[object]:
    return [
        s.pk, s.str_name, s.b_threadable, s.int_cores_min, s.int_cores_max, s.int_mem_min, s.int_gpu_mem_min,
        s.tags, s.int_timeout, s.int_timeout_llu, s.int_gpus_min, s.int_gpus_max, s.int_min_memory_increase,
    ]  # fmt: skip


def test_default_services_are_the_service_rows_in_cuebots_units(clients: Clients) -> None:
    Service.objects.create(
        str_name="svc_render", b_threadable=True, int_cores_min=150, int_cores_max=800, int_mem_min=8388608,
        str_tags="general | gpu ", int_gpu_mem_min=4194304, int_gpus_min=1, int_gpus_max=2, int_timeout=30,
        int_timeout_llu=10, int_min_memory_increase=1048576,
    )  # fmt: skip
    # The seeded services (the migration's shell, maya...) are listed beside it, whatever they are.
    got = pycue_json(
        clients,
        SERVICE_FIELDS + "print(json.dumps([fields(s) for s in opencue.api.getDefaultServices()]))",
    )
    # Centicores and KB as stored, tags split as Cuebot splits them, ordered by name.
    assert got == [_db_service(s) for s in Service.objects.order_by("str_name")]
    (render,) = (g for g in got if g[1] == "svc_render")
    assert render[3:6] == [150, 800, 8388608] and render[7] == ["general", "gpu"]

    one = pycue_json(
        clients,
        SERVICE_FIELDS + "print(json.dumps([fields(opencue.api.getService('svc_render')), "
        "opencue.api.getService('no_such_service') is None]))",
    )
    assert one == [_db_service(Service.objects.get(str_name="svc_render")), True]  # NOT_FOUND: pycue's None


def _db_limit(row: LimitRecord) -> list[object]:
    return [row.pk, row.str_name, row.int_max_value, row.int_running, 1 if row.b_host_limit else 0]


LIMIT_FIELDS = """
def fields(l):
    return [l.id(), l.name(), l.maxValue(), l.currentRunning(), int(l.limitType())]
"""


def test_pycue_creates_lists_finds_and_changes_limits_through_the_audited_actions(clients: Clients) -> None:
    made = pycue_json(
        clients,
        LIMIT_FIELDS + "from opencue_proto import limit_pb2\n"
        "print(json.dumps([fields(opencue.api.createLimit('arnold', 10)),"
        " fields(opencue.api.createLimit('houdini', 3, limitType=limit_pb2.HOST))]))",
    )
    arnold, houdini = LimitRecord.objects.get(str_name="arnold"), LimitRecord.objects.get(str_name="houdini")
    assert made == [_db_limit(arnold), _db_limit(houdini)]
    assert (arnold.int_max_value, arnold.b_host_limit, houdini.int_max_value, houdini.b_host_limit) == (
        10, False, 3, True,
    )  # fmt: skip

    listed = pycue_json(clients, LIMIT_FIELDS + "print(json.dumps([fields(l) for l in opencue.api.getLimits()]))")
    assert listed == [_db_limit(r) for r in LimitRecord.objects.order_by("str_name")]

    changed = pycue_json(
        clients,
        LIMIT_FIELDS + "l = opencue.api.findLimit('arnold')\nl.setMaxValue(4)\nprint(json.dumps(fields(l)))",
    )
    arnold.refresh_from_db()
    assert arnold.int_max_value == 4 and changed == _db_limit(arnold)

    events = list(LimitRecordEvent.objects.filter(pk_limit_record=arnold.pk).order_by("pgh_id"))
    assert [e.pgh_label for e in events] == ["limit_create", "limit_change"]
    assert (events[1].old_int_max_value, events[1].int_max_value) == (10, 4)
    assert [e.pgh_context.metadata["action"] for e in events] == ["create_limit", "set_limit"]
    assert {e.pgh_context.metadata["username"] for e in events} == {"opencue-api"}
    assert LimitRecordEvent.objects.filter(pk_limit_record=houdini.pk).count() == 1


def test_bad_limit_requests_are_refused_naming_the_field_and_write_nothing(clients: Clients) -> None:
    pycue_json(clients, "print(json.dumps(opencue.api.createLimit('arnold', 10).id()))")
    before = (list(LimitRecord.objects.values_list("str_name", "int_max_value", "b_host_limit")),
              LimitRecordEvent.objects.count())  # fmt: skip

    got = refusals(
        clients,
        "opencue.api.findLimit('nuke')",
        "opencue.api.findLimit('nuke').setMaxValue(3)",
        "opencue.api.createLimit('arnold', 5)",
        "opencue.api.createLimit('   ', 5)",
        "opencue.api.createLimit('katana', -2)",
        "opencue.api.createLimit('katana', 5, enforcement=1)",
        "opencue.api.createLimit('katana', 5, softValue=2)",
        "opencue.api.createLimit('katana', 5, exitStatus=3, delayMinutes=5)",
        "opencue.api.createLimit('katana', 5, delayMinutes=5)",
        "opencue.api.createLimit('katana', 5, limitType=7)",
        "opencue.api.findLimit('arnold').setMaxValue(-3)",
    )
    assert [g[0] for g in got[:3]] == ["EntityNotFoundException", "EntityNotFoundException",
                                       "EntityAlreadyExistsException"]  # fmt: skip
    fields = ["name", "max_value", "enforcement", "soft_value", "exit_status", "delay_minutes", "type", "max_value"]
    # pycue's api functions raise CueException for INVALID_ARGUMENT, with the status and the server's
    # text; Limit.setMaxValue has no such wrapper and lets gRPC's own error through.
    for (kind, code, text), field in zip(got[3:], fields, strict=True):
        wrapped = kind == "CueException" and f"StatusCode.INVALID_ARGUMENT : {field}: " in text
        raw = (kind, code) == ("RpcError", "INVALID_ARGUMENT") and text.startswith(f"{field}: ")
        assert wrapped or raw, (kind, code, text)
    after = (list(LimitRecord.objects.values_list("str_name", "int_max_value", "b_host_limit")),
             LimitRecordEvent.objects.count())  # fmt: skip
    assert after == before


def test_a_limits_use_is_what_its_running_frames_hold(clients: Clients) -> None:
    farm = ff.tiny_farm(managed=False, frames=4)
    frames = LimitRecord.objects.create(str_name="nuke_frames", int_max_value=10)
    hosts = LimitRecord.objects.create(str_name="nuke_hosts", int_max_value=10, b_host_limit=True)
    for limit in (frames, hosts):
        LayerLimit.objects.create(layer=farm.layer, limit=limit)
    other = ff.create_host(farm.alloc)
    for host, frame in zip((farm.host, farm.host, other), farm.frames, strict=False):
        ff.create_proc(host, frame)
    got = pycue_json(
        clients,
        "print(json.dumps({l.name(): [l.currentRunning(), l.currentUsage(), l.pendingUsage(), l.settledUsage(),"
        " l.hostCount(), l.specLayerCount()] for l in opencue.api.getLimits()}))",
    )
    # Three frames on two hosts: a frame limit holds 3, a host limit 2; none is settled by a report.
    assert got == {"nuke_frames": [3, 3, 3, 0, 2, 1], "nuke_hosts": [2, 2, 2, 0, 2, 1]}
    assert [LimitRecord.objects.get(pk=x.pk).int_running for x in (frames, hosts)] == [3, 2]
