"""Procs, and a host's allocation and tags, from OpenCue's own 1.37 clients (issue 30).

pycue's `getProcs` lists the booked runs (`cueadmin -lp` 1.37 fails in the client, see below);
`proc.kill()` is the console's frame kill (the proc stays booked, marked killing, until the run
ends); `host.setAllocation`,
`addTags` and `removeTags` are the console's host actions. Every result is checked against the
database and the audit, and every refused request leaves both as they were.
"""

from __future__ import annotations

import pytest

from dispatch.models import Alloc, FarmAction, Frame, Host, HostTag, Job, Proc, Subscription
from tests.integration.farm_fixtures import create_alloc, create_proc, create_subscription
from tests.integration.opencue_clients import Clients, ok

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def running():
    """demo-h0 and demo-h1 in local.general; a job of 4 frames, frames 1 and 2 running (a proc
    each, on demo-h0 and demo-h1; 3 GB and 1 GB used); local.render, subscribed, with no host."""
    from dispatch.jobs.submit import submit_job
    from tests.integration.submit_support import simple_spec, submit_farm

    farm = submit_farm(hosts=2)
    result = submit_job(simple_spec("demo-sh010-cue_v1", frames=4), user="alice")
    job = Job.objects.get(pk=result.job_id)
    render = create_alloc(farm.facility, name="local.render", tag="render")
    create_subscription(farm.show, render, int_burst=100_000)
    procs = []
    for number, host, used in ((1, "demo-h0", 3), (2, "demo-h1", 1)):
        frame = Frame.objects.get(job=job, str_name=f"000{number}-main")
        Frame.objects.filter(pk=frame.pk).update(str_state="RUNNING", str_host=host)
        procs.append(create_proc(Host.objects.get(str_name=host), frame, int_mem_used=used * 1024 * 1024))
    return job, procs, render


def audit_rows() -> list[tuple[str, str, str, int]]:
    return list(
        FarmAction.objects.exclude(str_action="submit")
        .order_by("id")
        .values_list("str_action", "str_target_name", "str_username", "int_changed")
    )


def test_cueadmin_and_pycue_list_procs_by_host_job_show_alloc_and_memory(clients: Clients, running) -> None:
    _job, procs, _render = running
    # cueadmin 1.37's -lp never reaches a server: pycue's ProcSearch assigns its -limit (default
    # 0) to ProcSearchCriteria.max_results, a repeated field, and the client prints the error.
    # Against Cuebot too; the same search through pycue's getProcs (below) is what works.
    failed = clients.cueadmin("-lp", "demo")
    assert 'repeated field "max_results"' in failed.stdout + failed.stderr

    out = ok(
        clients.pycue(
            "import opencue\n"
            "def names(**kw):\n"
            "    return sorted(p.data.frame_name for p in opencue.api.getProcs(**kw))\n"
            "print('all', names())\n"
            "print('host', names(host=['demo-h1']))\n"
            "print('job', names(job=['demo-sh010-cue_v1']))\n"
            "print('layer', names(layer=['main']))\n"
            "print('show', names(show=['demo']), names(show=['nosuch']))\n"
            "print('alloc', names(alloc=['local.general']), names(alloc=['local.render']))\n"
            "print('memory', names(memory='2097152-4194304'))\n"  # KB used: 2-4 GB
            "stub = opencue.cuebot.Cuebot.getStub('proc')\n"
            "pb = opencue.api.host_pb2\n"
            "crit = pb.ProcSearchCriteria(max_results=[1], first_result=1)\n"
            "print('page', [p.frame_name for p in stub.GetProcs(pb.ProcGetProcsRequest(r=crit)).procs.procs])\n"
            "p = [p for p in opencue.api.getProcs(host=['demo-h0'])][0]\n"
            "print('proc', p.id(), p.data.name, p.data.show_name, p.data.group_name, p.data.reserved_memory,"
            " p.data.used_memory, p.data.unbooked)\n"
            "print('hostprocs', [x.data.frame_name for x in opencue.api.findHost('demo-h1').getProcs()])\n"
        )
    )
    assert "all ['0001-main', '0002-main']" in out
    assert "host ['0002-main']" in out
    assert "job ['0001-main', '0002-main']" in out
    assert "layer ['0001-main', '0002-main']" in out
    assert "show ['0001-main', '0002-main'] []" in out
    assert "alloc ['0001-main', '0002-main'] []" in out
    assert "memory ['0001-main']" in out
    assert "page ['0002-main']" in out  # one proc, after the first (by host name)
    assert f"proc {procs[0].pk} demo-h0 demo demo 1048576 3145728 False" in out
    assert "hostprocs ['0002-main']" in out
    assert audit_rows() == []  # reading writes nothing


def test_proc_kill_is_the_console_frame_kill_and_the_proc_stays_booked_killing(clients: Clients, running) -> None:
    job, procs, _render = running
    ok(
        clients.pycue(
            "import opencue\n"
            "[p] = opencue.api.getProcs(host=['demo-h0'])\n"
            "p.kill()\n"
            "[q] = opencue.api.getProcs(host=['demo-h1'])\n"
            "q.unbook()\n"  # without kill: nothing to mark, every proc ends with its frame
        )
    )
    killed, other = (Proc.objects.get(pk=p.pk) for p in procs)  # both still booked
    assert (killed.ts_kill is not None, killed.str_kill) == (True, "FRAME")
    assert (other.ts_kill, other.str_kill, other.b_unbooked) == (None, None, False)
    assert Frame.objects.get(pk=killed.frame_id).str_state == "RUNNING"  # until the host reports the end
    (row,) = FarmAction.objects.filter(str_action="kill").values(
        "str_target_kind", "str_target", "int_changed", "detail"
    )
    assert (row["str_target_kind"], row["str_target"], row["int_changed"]) == ("frame", job.pk, 1)
    assert row["detail"]["frames"] == [killed.frame_id]
    assert [a[0] for a in audit_rows()] == ["kill"]

    ok(clients.pycue("import opencue\n[q] = opencue.api.getProcs(host=['demo-h1'])\nq.unbook(kill=True)\n"))
    other.refresh_from_db()
    assert (other.ts_kill is not None, other.str_kill) == (True, "FRAME")
    assert [a[0] for a in audit_rows()] == ["kill", "kill"]


def test_set_allocation_moves_the_host_its_alloc_tag_and_its_running_procs(clients: Clients, running) -> None:
    _job, _procs, render = running
    general = Alloc.objects.get(str_name="local.general")
    sub = {a: Subscription.objects.get(alloc__str_name=a) for a in ("local.general", "local.render")}
    assert (sub["local.general"].int_cores, sub["local.render"].int_cores) == (200, 0)
    ok(
        clients.pycue(
            "import opencue\n"
            "h = opencue.api.findHost('demo-h0')\n"
            "h.setAllocation(opencue.api.findAllocation('local.render'))\n"
            "print('alloc', opencue.api.findHost('demo-h0').data.alloc_name)\n"
        )
    )
    host = Host.objects.get(str_name="demo-h0")
    assert host.alloc_id == render.pk
    tags = set(HostTag.objects.filter(host=host).values_list("str_tag_type", "str_tag"))
    assert tags == {("ALLOC", "render")}
    assert host.str_tags == "render"
    # The running proc went with the host: its cores are now the render subscription's.
    for s in sub.values():
        s.refresh_from_db()
    assert (sub["local.general"].int_cores, sub["local.render"].int_cores) == (100, 100)
    assert audit_rows() == [("set_allocation", "demo-h0", "opencue-api", 1)]
    (detail,) = FarmAction.objects.filter(str_action="set_allocation").values_list("detail", flat=True)
    assert detail == {"from": "local.general", "to": "local.render"}
    assert "local.render" in ok(clients.cueadmin("-lh", "demo-h0"))
    assert general.hosts.count() == 1


def test_add_and_remove_tags_are_audited_and_what_dispatch_reads(clients: Clients, running) -> None:
    ok(
        clients.pycue(
            "import opencue\n"
            "h = opencue.api.findHost('demo-h1')\n"
            "h.addTags(['gpu', 'nuke'])\n"
            "h.addTags(['gpu'])\n"  # pycue drops a tag the host has: an empty request, nothing written
            "opencue.api.findHost('demo-h1').addTags(['gpu'])\n"
            "stub = opencue.cuebot.Cuebot.getStub('host')\n"
            "pb = opencue.api.host_pb2\n"
            "stub.AddTags(pb.HostAddTagsRequest(host=h.data, tags=['gpu']))\n"  # sent anyway: changes nothing
            "h.removeTags(['nuke', 'absent'])\n"
            "print('tags', opencue.api.findHost('demo-h1').data.tags)\n"
        )
    )
    host = Host.objects.get(str_name="demo-h1")
    tags = set(HostTag.objects.filter(host=host).values_list("str_tag_type", "str_tag"))
    assert tags == {("ALLOC", "general"), ("MANUAL", "gpu")}
    assert host.str_tags == "general gpu"
    assert audit_rows() == [
        ("add_tags", "demo-h1", "opencue-api", 2),
        ("add_tags", "demo-h1", "opencue-api", 0),
        ("remove_tags", "demo-h1", "opencue-api", 1),
    ]


def test_bad_host_and_proc_requests_name_the_field_and_write_nothing(clients: Clients, running) -> None:
    def snapshot():
        return (
            audit_rows(),
            sorted(HostTag.objects.values_list("host__str_name", "str_tag")),
            sorted(Host.objects.values_list("str_name", "alloc__str_name", "str_tags")),
            sorted(Proc.objects.values_list("pk", "ts_kill")),
        )

    before = snapshot()
    out = ok(
        clients.pycue(
            "import opencue\n"
            "from opencue.exception import EntityNotFoundException\n"
            "def code(call):\n"
            "    try:\n"
            "        call()\n"
            "        print('ACCEPTED')\n"
            "    except EntityNotFoundException:\n"
            "        print('NOT_FOUND')\n"
            "    except Exception as e:\n"  # a raw stub's grpc error, or pycue's CueException around it
            "        print(*((e.code().name, e.details()) if hasattr(e, 'code') else (type(e).__name__, e)))\n"
            "h = opencue.api.findHost('demo-h1')\n"
            "stub = opencue.cuebot.Cuebot.getStub('host')\n"
            "pb = opencue.api.host_pb2\n"
            "code(lambda: stub.SetAllocation(pb.HostSetAllocationRequest(host=h.data, allocation_id='nosuch')))\n"
            "code(lambda: stub.SetAllocation(pb.HostSetAllocationRequest(host=h.data, allocation_id='')))\n"
            "code(lambda: h.addTags(['two words']))\n"
            "code(lambda: h.addTags(['a|b']))\n"
            "code(lambda: h.removeTags(['general']))\n"
            "code(lambda: h.removeTags(['demo-h1x', 'general']))\n"
            "gone = pb.Host(id='nosuch', name='nosuch')\n"
            "code(lambda: stub.AddTags(pb.HostAddTagsRequest(host=gone, tags=['gpu'])))\n"
            "code(lambda: opencue.wrappers.proc.Proc(pb.Proc(id='nosuch')).kill())\n"
            "code(lambda: opencue.wrappers.proc.Proc(pb.Proc(id='nosuch')).unbook())\n"
            "code(lambda: opencue.api.getProcs(memory='4-2'))\n"
        )
    )
    lines = out.splitlines()
    assert lines[0] == "NOT_FOUND no allocation 'nosuch'"
    assert lines[1].startswith("INVALID_ARGUMENT allocation_id")
    assert lines[2].startswith("INVALID_ARGUMENT tags: 'two words'")
    assert lines[3].startswith("INVALID_ARGUMENT tags: 'a|b'")
    assert lines[4].startswith("INVALID_ARGUMENT tags: 'general'")
    assert lines[5].startswith("INVALID_ARGUMENT tags: 'general'")
    assert lines[6] == "NOT_FOUND no host 'nosuch'"
    assert lines[7] == lines[8] == "NOT_FOUND no proc with id 'nosuch' (its frame may have ended)"
    assert lines[9].startswith("CueException") and "memory_range: 4-2 is not a range" in lines[9]
    assert snapshot() == before
