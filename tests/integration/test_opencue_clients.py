"""OpenCue's own 1.37 clients (cueadmin, pycue) set up a farm on cuesched, unmodified (issue 30).

Each client runs as a user runs it, in its own environment, pointed at our server by CUEBOT_HOSTS.
Every result is checked against the database and the audit, and every refused request leaves the
database as it was.
"""

from __future__ import annotations

import pytest

from dispatch.models import Alloc, Facility, FarmAction, Folder, Frame, Host, Job, JobResource, Show, Subscription
from opencue_api import server
from ops.models import JobCapEvent, SubscriptionCapEvent
from tests.integration.opencue_clients import Clients, ok

pytestmark = pytest.mark.django_db(transaction=True)


def refused(result, *words: str) -> str:
    text = result.stdout + result.stderr
    assert result.returncode != 0 or "error" in text.lower(), f"accepted:\n{text}"
    for word in words:
        assert word in text, f"{word!r} not in:\n{text}"
    return text


def farm_rows() -> tuple[int, int, int, int, int]:
    return (
        Facility.objects.count(),
        Alloc.objects.count(),
        Show.objects.count(),
        Subscription.objects.count(),
        FarmAction.objects.count(),
    )


def test_cueadmin_sets_up_a_farm_from_an_empty_database(clients: Clients) -> None:
    ok(clients.pycue("import opencue; print(opencue.api.createFacility('studio').name)"))
    ok(clients.cueadmin("-create-show", "Big-Show", "-force"))
    ok(clients.cueadmin("-create-alloc", "studio", "general", "general", "-force"))
    ok(clients.cueadmin("-create-sub", "big_show", "studio.general", "10", "20", "-force"))

    show = Show.objects.get(str_name="big_show")  # Cuebot's conformName: lowercase, dashes to underscores
    (folder,) = Folder.objects.filter(show=show)
    assert (folder.str_name, folder.b_default, folder.parent_folder_id) == ("big_show", True, None)
    alloc = Alloc.objects.get(str_name="studio.general")
    assert (alloc.str_tag, alloc.facility.str_name) == ("general", "studio")
    sub = Subscription.objects.get(show=show, alloc=alloc)
    assert (sub.int_size, sub.int_burst) == (1000, 2000)  # whole cores in, centicores stored
    audit = list(FarmAction.objects.order_by("id").values_list("str_action", "str_target_name", "str_username"))
    assert audit == [
        ("create_facility", "studio", "opencue-api"),
        ("create_show", "big_show", "opencue-api"),
        ("create_allocation", "studio.general", "opencue-api"),
        ("create_subscription", "studio.general.big_show", "opencue-api"),
    ]

    listed = ok(clients.cueadmin("-ls"))
    assert "big_show" in listed
    assert "studio.general" in ok(clients.cueadmin("-la"))
    subs = ok(clients.cueadmin("-lb", "big_show"))
    assert "studio.general" in subs and "10" in subs and "20" in subs


def test_cueadmin_size_and_burst_go_through_the_audited_cap_action(clients: Clients) -> None:
    ok(clients.pycue("import opencue; opencue.api.createFacility('studio')"))
    ok(clients.cueadmin("-create-show", "capshow", "-force"))
    ok(clients.cueadmin("-create-alloc", "studio", "general", "general", "-force"))
    ok(clients.cueadmin("-create-sub", "capshow", "studio.general", "10", "20", "-force"))
    sub = Subscription.objects.get(show__str_name="capshow")

    # Cuebot's SetSize/SetBurst take centicores as sent: 1500 is 15 cores.
    ok(clients.cueadmin("-size", "capshow", "studio.general", "1500"))
    ok(clients.cueadmin("-burst", "capshow", "studio.general", "3000"))
    sub.refresh_from_db()
    assert (sub.int_size, sub.int_burst) == (1500, 3000)
    events = SubscriptionCapEvent.objects.filter(pk_subscription=sub.pk).order_by("pgh_id")
    assert [(e.old_int_burst, e.int_burst) for e in events] == [(2000, 2000), (2000, 3000)]
    assert {e.pgh_context.metadata["username"] for e in events} == {"opencue-api"}

    # A burst of 20.5 cores cuesched cannot keep: refused with the reason, nothing written.
    refused(clients.cueadmin("-burst", "capshow", "studio.general", "2050"), "whole cores")
    sub.refresh_from_db()
    assert sub.int_burst == 3000


def test_bad_requests_are_refused_with_the_reason_and_write_nothing(clients: Clients) -> None:
    ok(clients.pycue("import opencue; opencue.api.createFacility('studio')"))
    ok(clients.cueadmin("-create-show", "realshow", "-force"))
    before = farm_rows()

    refused(clients.cueadmin("-create-show", "ab", "-force"), "at least 3 characters")
    refused(clients.cueadmin("-create-show", "realshow", "-force"), "already exists")
    dup = ok(
        clients.pycue(
            "import opencue\nfrom opencue.exception import EntityAlreadyExistsException\n"
            "try:\n    opencue.api.createShow('realshow')\nexcept EntityAlreadyExistsException:\n    print('EXISTS')\n"
        )
    )
    assert "EXISTS" in dup
    refused(clients.cueadmin("-create-show", "has.dot", "-force"), "dot")
    refused(clients.cueadmin("-create-alloc", "nowhere", "general", "general", "-force"), "nowhere")
    refused(clients.cueadmin("-create-sub", "noshow", "studio.general", "10", "20", "-force"))
    refused(clients.cueadmin("-size", "realshow", "studio.nosuch", "100"))
    assert farm_rows() == before

    # pycue's own exception classes come from the status codes: NOT_FOUND, INVALID_ARGUMENT.
    out = ok(
        clients.pycue(
            "import opencue\n"
            "from opencue.exception import EntityNotFoundException\n"
            "try:\n    opencue.api.findShow('nosuchshow')\n"
            "except EntityNotFoundException as e:\n    print('NOT_FOUND')\n"
        )
    )
    assert "NOT_FOUND" in out
    assert farm_rows() == before


def test_pycue_reads_shows_allocations_and_subscriptions_as_the_database_has_them(clients: Clients) -> None:
    ok(clients.pycue("import opencue; opencue.api.createFacility('studio')"))
    ok(clients.cueadmin("-create-show", "readshow", "-force"))
    ok(clients.cueadmin("-create-alloc", "studio", "render", "render", "-force"))
    ok(clients.cueadmin("-create-sub", "readshow", "studio.render", "5", "8", "-force"))
    out = ok(
        clients.pycue(
            "import opencue\n"
            "s = opencue.api.findShow('readshow')\n"
            "print('show', s.name(), s.data.active, s.data.default_max_cores, s.data.scheduler_managed)\n"
            "print('active', [x.name() for x in opencue.api.getActiveShows()])\n"
            "for sub in s.getSubscriptions():\n"
            "    print('sub', sub.data.name, sub.data.size, sub.data.burst, sub.data.reserved_cores)\n"
            "a = opencue.api.findAllocation('studio.render')\n"
            "print('alloc', a.data.name, a.data.tag, a.data.facility, a.data.stats.hosts)\n"
        )
    )
    show = Show.objects.get(str_name="readshow")
    assert f"show readshow True {show.int_default_max_cores / 100} False" in out
    assert "active ['readshow']" in out
    assert "sub studio.render.readshow 500 800 0" in out
    assert "alloc studio.render render studio 0" in out


def test_the_server_listens_on_loopback_unless_told_in_words_that_anyone_may_control_the_farm() -> None:
    with pytest.raises(ValueError, match="anyone-who-reaches-the-port"):
        server.start("0.0.0.0:0")
    api = server.start("0.0.0.0:0", open_to_network=True)
    api.stop()


# --------------------------------------------------------------------------- jobs, layers, frames


@pytest.fixture
def job():
    """One submitted job on a fresh farm: layer 'main', 4 frames, nothing booked."""
    from dispatch.jobs.submit import submit_job
    from tests.integration.submit_support import simple_spec, submit_farm

    submit_farm()
    result = submit_job(simple_spec("demo-sh010-cue_v1", frames=4), user="alice")
    return Job.objects.get(pk=result.job_id)


def test_cueadmin_and_pycue_list_jobs_layers_and_frames_as_the_database_has_them(clients: Clients, job) -> None:
    assert ok(clients.cueadmin("-lj", "cue_v1")).split() == [job.str_name]
    out = ok(
        clients.pycue(
            "import opencue\n"
            "j = opencue.api.findJob('demo-sh010-cue_v1')\n"
            "print('job', j.name(), j.data.show, j.data.user, j.data.state, j.data.job_stats.total_frames)\n"
            "print('jobs', [x.name() for x in opencue.api.getJobs(show=['demo'], user=['alice'])])\n"
            "print('none', [x.name() for x in opencue.api.getJobs(show=['nosuch'])])\n"
            "for l in j.getLayers():\n"
            "    print('layer', l.name(), l.data.min_cores, l.data.min_memory, l.data.layer_stats.waiting_frames)\n"
            "print('frames', [(f.data.name, f.data.state) for f in j.getFrames(range='2-3')])\n"
        )
    )
    from opencue_proto import job_pb2

    assert f"job demo-sh010-cue_v1 demo alice {job_pb2.PENDING} 4" in out
    assert "jobs ['demo-sh010-cue_v1']" in out and "none []" in out
    assert "layer main 1.0 1048576 4" in out  # 1 core, 1 GB in KB, 4 waiting
    waiting = job_pb2.WAITING
    assert f"frames [('0002-main', {waiting}), ('0003-main', {waiting})]" in out
    # cueman -lf sends a duration filter by default, which (in Cuebot too) leaves WAITING frames out.
    assert "0003-main" not in ok(clients.cueman("-lf", job.str_name))
    from dispatch.jobs.controls import eat_frames

    eat_frames(job.pk, ["0003-main"], actor="test")
    assert "0003-main" in ok(clients.cueman("-lf", job.str_name))


def test_job_controls_from_pycue_and_cueman_go_through_the_audited_actions(clients: Clients, job) -> None:
    ok(
        clients.pycue(
            "import opencue\n"
            "j = opencue.api.findJob('demo-sh010-cue_v1')\n"
            "j.pause()\n"
            "j.setPriority(77)\n"
            "j.setMaxCores(12)\n"
        )
    )
    job.refresh_from_db()
    assert job.b_paused is True
    res = JobResource.objects.get(job=job)
    assert (res.int_priority, res.int_max_cores) == (77, 1200)
    ok(clients.pycue("import opencue; opencue.api.findJob('demo-sh010-cue_v1').resume()"))
    job.refresh_from_db()
    assert job.b_paused is False

    # pycue eats frames 1-2 of the layer: EATEN, the others untouched. (cueman -eat sends its
    # default duration filter, which leaves WAITING frames out, in Cuebot as here: it eats nothing.)
    ok(clients.cueman("-eat", job.str_name, "-range", "1-2", "-force"))
    assert set(Frame.objects.filter(job=job).values_list("str_state", flat=True)) == {"WAITING"}
    ok(clients.pycue("import opencue; opencue.api.findJob('demo-sh010-cue_v1').eatFrames(range='1-2')"))
    states = dict(Frame.objects.filter(job=job).values_list("str_name", "str_state"))
    assert states == {"0001-main": "EATEN", "0002-main": "EATEN", "0003-main": "WAITING", "0004-main": "WAITING"}
    listed = ok(clients.cueman("-lf", job.str_name, "-state", "EATEN"))
    assert "0001-main" in listed and "0002-main" in listed and "0004-main" not in listed
    audit = list(FarmAction.objects.filter(str_target=job.pk).order_by("id").values_list("str_action", "str_username"))
    # The submit's own row first (the fixture submits as alice), then the client's controls.
    assert audit[0] == ("submit", "alice")
    assert [a for a, _ in audit[1:]] == ["pause", "priority", "resume", "eat"]
    assert {u for _, u in audit[1:]} == {"opencue-api"}
    # The cap history, as for the console's (the first event is the submit's own).
    cap = JobCapEvent.objects.filter(pk_job_resource=res.pk).order_by("pgh_id").last()
    assert (cap.int_max_cores, cap.pgh_context.metadata["username"]) == (1200, "opencue-api")

    # A kill names the user the client says it runs for, marked as said (nothing authenticates it).
    ok(clients.pycue("import opencue; opencue.api.findJob('demo-sh010-cue_v1').kill(reason='test')"))
    job.refresh_from_db()
    assert job.str_state == "FINISHED"
    (_, who) = (
        FarmAction.objects.filter(str_target=job.pk, str_action="kill").values_list("str_action", "str_username").get()
    )
    assert who.startswith("opencue-api (as ")


def test_bad_job_requests_are_refused_and_change_nothing(clients: Clients, job) -> None:
    before = (FarmAction.objects.count(), list(Frame.objects.order_by("pk").values_list("str_state", flat=True)))
    out = ok(
        clients.pycue(
            "import opencue\n"
            "from opencue.exception import EntityNotFoundException\n"
            "try:\n    opencue.api.findJob('nosuch-job')\nexcept EntityNotFoundException:\n    print('NOT_FOUND')\n"
            "j = opencue.api.findJob('demo-sh010-cue_v1')\n"
            # pycue maps only some codes to its exceptions; INVALID_ARGUMENT arrives as grpc's own error.
            "try:\n    j.setMaxCores(1.5)\nexcept Exception as e:\n    print('REFUSED', e.details())\n"
            "try:\n    opencue.api.getJobs(regex=['(unclosed'])\n"
            "except Exception as e:\n    print('REGEX', getattr(e, 'details', lambda: str(e))())\n"
        )
    )
    assert "NOT_FOUND" in out and "REFUSED" in out and "whole cores" in out
    assert "REGEX" in out and "not a regular expression" in out
    assert (
        FarmAction.objects.count(),
        list(Frame.objects.order_by("pk").values_list("str_state", flat=True)),
    ) == before


# --------------------------------------------------------------------------- hosts


def test_cueadmin_lists_hosts_and_locks_them_through_the_audited_host_control(clients: Clients) -> None:
    from tests.integration.submit_support import submit_farm

    submit_farm(hosts=2)  # demo-h0, demo-h1 in local.general, 16 cores, 64 GB each
    listed = ok(clients.cueadmin("-lh"))
    assert "demo-h0" in listed and "demo-h1" in listed and "local.general" in listed

    ok(clients.cueadmin("-lock", "-host", "demo-h1", "-force"))
    states = dict(Host.objects.values_list("str_name", "str_lock_state"))
    assert states == {"demo-h0": "OPEN", "demo-h1": "LOCKED"}
    out = ok(
        clients.pycue(
            "import opencue\n"
            "h = opencue.api.findHost('demo-h1')\n"
            "lock = opencue.api.host_pb2.LockState.Name(h.data.lock_state)\n"
            "print('host', h.data.name, h.data.cores, h.data.memory, lock)\n"
            "h.unlock()\n"
        )
    )
    assert "host demo-h1 16.0 67108864 LOCKED" in out
    assert Host.objects.get(str_name="demo-h1").str_lock_state == "OPEN"
    audit = list(FarmAction.objects.filter(str_target_kind="host").order_by("id").values_list("str_action", flat=True))
    assert audit == ["lock", "unlock"]


def test_a_port_another_server_holds_is_refused_not_shared() -> None:
    # grpc's default SO_REUSEPORT would let two servers (say the RQD gateway on 8443) split the
    # clients' connections between them; the API must fail to start instead.
    first = server.start("127.0.0.1:0")
    try:
        with pytest.raises(OSError, match="cannot listen"):
            server.start(f"127.0.0.1:{first.port}")
    finally:
        first.stop()


# --------------------------------------------------------------------------- CueGUI's Cuetopia calls


def test_cuetopia_job_list_reads_what_the_database_has(clients: Clients) -> None:
    """What CueGUI's Cuetopia polls (JobMonitorTree, FrameMonitorTree, LayerMonitorTree): jobs by
    id, user and regex; what depends on a job (its add-job path); the updated frames since the
    last check; the layers and a layer's frames; a show's groups and their jobs."""
    import time
    from datetime import timedelta

    from django.db.models.functions import Now

    from dispatch.jobs.controls import eat_frames
    from dispatch.jobs.submit import submit_job
    from tests.integration.submit_support import make_spec, submit_farm

    submit_farm()
    job = Job.objects.get(pk=submit_job(make_spec(), user="alice").job_id)
    # The submit changed every frame; as of CueGUI's last check (10 s ago) none has changed since.
    Frame.objects.filter(job=job).update(ts_updated=Now() - timedelta(seconds=10))
    before = int(time.time()) - 5
    eat_frames(job.pk, ["0001-sim"], actor="test")
    out = ok(
        clients.pycue(
            "import opencue, time\n"
            f"j = opencue.api.getJobs(id=['{job.pk}'], include_finished=True)[0]\n"
            "print('byid', j.name(), j.data.group)\n"
            "print('mine', [x.name() for x in opencue.api.getJobs(user=['alice'])])\n"
            "print('regex', [x.name() for x in opencue.api.getJobs(regex=['light_v'], include_finished=True)])\n"
            "deps = sorted((d.data.depend_er_layer, d.data.depend_on_layer, d.isInternal(), d.isActive())"
            " for d in j.getWhatDependsOnThis())\n"
            "print('deps', deps)\n"
            f"u = j.getUpdatedFrames({before})\n"
            "print('updated', u.state, [(f.id, f.state) for f in u.updated_frames.updated_frames])\n"
            "print('server_time', u.server_time <= int(time.time()))\n"
            "sim = [l for l in j.getLayers() if l.name() == 'sim'][0]\n"
            "print('layerframes', [f.data.name for f in sim.getFrames()])\n"
            "show = opencue.api.findShow('demo')\n"
            "root = show.getRootGroup()\n"
            "print('root', root.data.name, root.data.level, root.data.group_stats.pending_jobs)\n"
            "print('groups', sorted((g.data.name, g.data.level) for g in show.getGroups()))\n"
            "print('children', [g.data.name for g in root.getGroups()])\n"
            "print('groupjobs', [x.name() for x in root.getJobs()])\n"
            "print('find', opencue.api.findGroup('demo', 'lighting').data.default_job_priority)\n"
            "try:\n    j.getUpdatedFrames(int(time.time()) - 120)\n"
            "except Exception as e:\n    print('STALE', e.details())\n"
        )
    )
    eaten = Frame.objects.get(job=job, str_name="0001-sim")
    assert f"byid {job.str_name} demo" in out
    assert f"mine ['{job.str_name}']" in out and f"regex ['{job.str_name}']" in out
    # render waits on sim frame by frame (one Depend, folded), movie on render layer on layer:
    # both internal to the job, both active.
    assert "deps [('movie', 'render', True, True), ('render', 'sim', True, True)]" in out
    from opencue_proto import job_pb2

    # Eating sim's first chunk released render's frames 1-5 (DEPEND to WAITING): they changed too.
    released = Frame.objects.filter(job=job, layer__str_name="render", int_number__lte=5).order_by("int_number")
    changed = [(eaten.pk, job_pb2.EATEN)] + [(f.pk, job_pb2.WAITING) for f in released]
    assert all(f.str_state == "WAITING" for f in released)
    assert f"updated {job_pb2.PENDING} {changed}" in out, out
    assert "server_time True" in out
    # Nothing changed since a later check: none is answered. (The frames are put back 10 s first:
    # the eat may have been in the very second of the check, which Cuebot answers again on purpose.)
    Frame.objects.filter(job=job).update(ts_updated=Now() - timedelta(seconds=10))
    since = ok(
        clients.pycue(
            "import opencue, time\n"
            f"j = opencue.api.getJobs(id=['{job.pk}'], include_finished=True)[0]\n"
            "u = j.getUpdatedFrames(int(time.time()) - 5)\n"
            "print('since', [f.id for f in u.updated_frames.updated_frames])\n"
        )
    )
    assert "since []" in since
    assert "layerframes ['0001-sim', '0006-sim']" in out  # chunk size 5: frames 1 and 6
    assert "root demo 0 1" in out
    assert "groups [('demo', 0), ('lighting', 1)]" in out
    assert "children ['lighting']" in out and f"groupjobs ['{job.str_name}']" in out
    assert "find 50" in out
    assert "STALE" in out and "over a minute off" in out


def test_cuetopia_job_and_layer_edits_go_through_the_audited_actions(clients: Clients, job) -> None:
    """The job and layer property dialogs: min cores, max retries, auto-eat; a layer's min cores
    and memory; a group's max cores. Each is one audited action; what cuesched cannot do (auto-eat)
    is refused as UNIMPLEMENTED and writes nothing. (Comments, refused here before, are served:
    test_pycue_comments_on_a_job_and_a_host_are_cuebots_rows_and_audited.)"""
    from dispatch.models import FolderResource, Layer

    out = ok(
        clients.pycue(
            "import opencue\n"
            "j = opencue.api.findJob('demo-sh010-cue_v1')\n"
            "j.setMinCores(2.5)\n"
            "j.setMaxRetries(5)\n"
            "l = j.getLayers()[0]\n"
            "l.setMinCores(400)\n"  # pycue's Layer.setMinCores takes centicores and sends cores
            "l.setMinMemory(2097152)\n"
            "opencue.api.findShow('demo').getRootGroup().setMaxCores(40)\n"
            "try:\n    j.setAutoEating(True)\nexcept Exception as e:\n"
            "    print('REFUSED', getattr(e, 'code', lambda: e)(), getattr(e, 'details', lambda: e)())\n"
            "print('job', j.data.min_cores if False else opencue.api.findJob('demo-sh010-cue_v1').data.min_cores)\n"
        )
    )
    job.refresh_from_db()
    res = JobResource.objects.get(job=job)
    layer = Layer.objects.get(job=job)
    assert (res.int_min_cores, job.int_max_retries, job.b_autoeat) == (250, 5, False)
    assert (layer.int_cores_min, layer.int_mem_min) == (400, 2097152)
    root = Folder.objects.get(show__str_name="demo", parent_folder=None)
    assert FolderResource.objects.get(folder=root).int_max_cores == 4000
    assert "job 2.5" in out
    assert out.count("REFUSED") == 1 and "auto-eat is not supported" in out, out
    assert "UNIMPLEMENTED" in out, out
    audit = list(
        FarmAction.objects.filter(str_target=job.pk).order_by("id").values_list("str_action", "detail", "str_username")
    )
    # The submit's own row first (the fixture submits as alice), then the client's edits.
    assert audit[0][::2] == ("submit", "alice")
    assert [a for a, _, _ in audit[1:]] == ["min_cores", "max_retries", "layer_min_cores", "layer_min_memory"]
    assert audit[3][1] == {"layer": "main", "min_cores": 4.0}
    assert {u for _, _, u in audit[1:]} == {"opencue-api"}

    # Refused values write nothing: a negative min cores, retries out of range, an unknown layer id.
    before = FarmAction.objects.count()
    out = ok(
        clients.pycue(
            "import opencue\n"
            "j = opencue.api.findJob('demo-sh010-cue_v1')\n"
            "for call in (lambda: j.setMinCores(-1), lambda: j.setMaxRetries(100000)):\n"
            "    try:\n        call()\n    except Exception as e:\n        print('REFUSED', e.details())\n"
            "l = j.getLayers()[0]\n"
            "l.data.id = 'no-such-layer'\n"
            "try:\n    l.setMinMemory(1)\nexcept Exception as e:\n    print(e.code().name)\n"
        )
    )
    assert "cannot be negative" in out and "from 0 to 32767" in out and "NOT_FOUND" in out
    assert FarmAction.objects.count() == before


# --------------------------------------------------------------------------- comments


def test_pycue_comments_on_a_job_and_a_host_are_cuebots_rows_and_audited(clients: Clients, job) -> None:
    """CueGUI's comment dialog through pycue: Job and Host addComment / getComments, a comment's
    save and delete (CommentInterface). Each change is one audited action; job.b_comment and
    host.b_comment (the clients' has_comment) are true exactly while there is a comment."""
    from dispatch.models import Comment
    from tests.integration.farm_fixtures import create_host

    host = create_host(Alloc.objects.get(str_name="local.general"), "demo-h0", int_cores=1600, int_mem=64 * 1024**2)
    out = ok(
        clients.pycue(
            "import os, opencue\n"
            "os.environ['USER'] = 'carol'\n"  # pycue names the comment's author from $USER, as Cuebot records it
            "j = opencue.api.findJob('demo-sh010-cue_v1')\n"
            "j.addComment('retake', 'the hair sim pops at 1040')\n"
            "j.addComment('note', '')\n"  # pycue sends ' ' for an empty message
            "cs = j.getComments()\n"
            "print('job', [(c.subject(), c.message(), c.user()) for c in cs])\n"
            "print('stamps', [c.timestamp() for c in cs])\n"
            "print('has', opencue.api.findJob('demo-sh010-cue_v1').data.has_comment)\n"
            "cs[0].setSubject('retake v2')\n"
            "cs[0].setMessage('pops at 1040, fixed in v2')\n"
            "cs[0].save()\n"
            "cs[1].delete()\n"
            "print('after', [(c.subject(), c.message()) for c in j.getComments()])\n"
            "h = opencue.api.findHost('demo-h0')\n"
            "h.addComment('fan', 'loud fan, check on Monday')\n"
            "hc = h.getComments()\n"
            "print('host', [(c.subject(), c.user()) for c in hc], opencue.api.findHost('demo-h0').data.has_comment)\n"
            "hc[0].delete()\n"
            "print('hostafter', h.getComments(), opencue.api.findHost('demo-h0').data.has_comment)\n"
        )
    )
    assert "job [('retake', 'the hair sim pops at 1040', 'carol'), ('note', ' ', 'carol')]" in out, out
    assert "has True" in out
    assert "after [('retake v2', 'pops at 1040, fixed in v2')]" in out, out
    assert "host [('fan', 'carol')] True" in out and "hostafter [] False" in out, out

    (kept,) = Comment.objects.all()
    assert (kept.job_id, kept.host_id, kept.str_user, kept.str_subject, kept.str_message) == (
        job.pk,
        None,
        "carol",
        "retake v2",
        "pops at 1040, fixed in v2",
    )
    stamps = out.split("stamps [", 1)[1].split("]", 1)[0]
    assert int(stamps.split(",")[0]) == int(kept.ts_created.timestamp())  # epoch seconds, as Cuebot sends
    job.refresh_from_db()
    host.refresh_from_db()
    assert (job.b_comment, host.b_comment) == (True, False)
    audit = list(
        FarmAction.objects.filter(str_action__endswith="_comment")
        .order_by("id")
        .values_list("str_action", "str_target_kind", "str_target", "str_username")
    )
    assert audit == [
        ("add_comment", "job", job.pk, "opencue-api (as carol)"),
        ("add_comment", "job", job.pk, "opencue-api (as carol)"),
        ("save_comment", "job", job.pk, "opencue-api"),
        ("delete_comment", "job", job.pk, "opencue-api"),
        ("add_comment", "host", host.pk, "opencue-api (as carol)"),
        ("delete_comment", "host", host.pk, "opencue-api"),
    ]
    saved = FarmAction.objects.get(str_action="save_comment").detail
    assert saved["from"] == {"subject": "retake", "message": "the hair sim pops at 1040"}


def test_bad_comment_requests_are_refused_with_the_field_named_and_write_nothing(clients: Clients, job) -> None:
    from dispatch.models import Comment

    before = (Comment.objects.count(), FarmAction.objects.count())
    out = ok(
        clients.pycue(
            "import opencue\n"
            "from opencue_proto import comment_pb2\n"
            "from opencue.wrappers.comment import Comment\n"
            "j = opencue.api.findJob('demo-sh010-cue_v1')\n"
            "def attempt(what, call):\n"
            "    try:\n        call()\n        print(what, 'ACCEPTED')\n"
            "    except Exception as e:\n"
            "        code = getattr(e, 'code', None)\n"
            "        print(what, code().name if callable(code) else type(e).__name__,"
            " getattr(e, 'details', lambda: str(e))())\n"
            "attempt('empty', lambda: j.addComment('', 'm'))\n"
            "attempt('long', lambda: j.addComment('s' * 129, 'm'))\n"
            "attempt('huge', lambda: j.addComment('s', 'm' * 4001))\n"
            "gone = Comment(comment_pb2.Comment(id='no-such-comment', subject='s', message='m'))\n"
            "attempt('delete', gone.delete)\n"
            "attempt('save', gone.save)\n"
            "j.data.id = 'no-such-job'\n"
            "j.data.name = 'no-such-job'\n"
            "attempt('nojob', lambda: j.addComment('s', 'm'))\n"
            "attempt('nojobread', j.getComments)\n"
        )
    )
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert lines["empty"].startswith("INVALID_ARGUMENT subject: a comment needs a subject"), out
    assert lines["long"].startswith("INVALID_ARGUMENT subject: 129 characters"), out
    assert lines["huge"].startswith("INVALID_ARGUMENT message: 4001 characters"), out
    assert "ACCEPTED" not in out
    for what in ("delete", "save", "nojob", "nojobread"):
        assert "NOT_FOUND" in lines[what] or "EntityNotFound" in lines[what], out
    assert (Comment.objects.count(), FarmAction.objects.count()) == before
