"""Plain functions that build a small farm through the ORM, for any integration test.

Values are in the database's units (centicores, KB, GPU counts) and every row gets a fresh
UUID and a unique name, so tests can build several farms side by side. `tiny_farm()` gives
one of everything; the `create_*` functions build anything larger. The fan-out triggers make
each folder's folder_resource row and each job's and layer's resource and stat rows.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from dispatch.models import (
    Alloc,
    Dept,
    Facility,
    Folder,
    FolderResource,
    Frame,
    Host,
    HostStat,
    HostTag,
    Job,
    JobResource,
    Layer,
    Point,
    Proc,
    Show,
    Subscription,
)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def create_facility(name: str | None = None) -> Facility:
    return Facility.objects.create(str_name=name or unique("fac"))


def create_dept(name: str | None = None) -> Dept:
    return Dept.objects.create(str_name=name or unique("dept"))


def create_show(name: str | None = None, *, managed: bool = False) -> Show:
    return Show.objects.create(str_name=name or unique("show"), b_scheduler_managed=managed)


def create_alloc(facility: Facility, name: str | None = None, tag: str | None = None) -> Alloc:
    name = name or unique("alloc")
    return Alloc.objects.create(facility=facility, str_name=name, str_tag=tag or name[:24])


def create_subscription(show: Show, alloc: Alloc, *, int_burst: int = 100_000, int_size: int = 0) -> Subscription:
    """Burst in centicores (100_000 = 1000 cores); 0 freezes the subscription."""
    return Subscription.objects.create(show=show, alloc=alloc, int_burst=int_burst, int_size=int_size)


def create_folder(
    show: Show, dept: Dept | None = None, name: str | None = None, parent: Folder | None = None
) -> Folder:
    return Folder.objects.create(show=show, dept=dept, parent_folder=parent, str_name=name or unique("folder"))


def create_job(
    show: Show, folder: Folder, dept: Dept, facility: Facility, name: str | None = None, **fields: object
) -> Job:
    return Job.objects.create(
        show=show,
        folder=folder,
        dept=dept,
        facility=facility,
        str_name=name or unique("job"),
        str_show=show.str_name,
        **fields,
    )


def create_layer(job: Job, name: str | None = None, **fields: object) -> Layer:
    fields.setdefault("str_cmd", "echo #FRAME#")
    fields.setdefault("str_range", "1-100")
    return Layer.objects.create(job=job, str_name=name or unique("layer"), **fields)


def create_frames(layer: Layer, count: int, *, state: str = "WAITING", start: int = 1) -> list[Frame]:
    frames = [
        Frame(
            layer=layer,
            job_id=layer.job_id,
            str_name=f"{n:04d}-{layer.str_name}",
            int_number=n,
            int_dispatch_order=n,
            str_state=state,
        )
        for n in range(start, start + count)
    ]
    return Frame.objects.bulk_create(frames)


def create_host(
    alloc: Alloc,
    name: str | None = None,
    *,
    int_cores: int = 800,
    int_mem: int = 32 * 1024 * 1024,
    int_gpus: int = 0,
    os: str = "linux",
) -> Host:
    """An UP, OPEN host with its host_stat row and its ALLOC tag."""
    host = Host.objects.create(
        alloc=alloc,
        str_name=name or unique("host"),
        int_cores=int_cores,
        int_cores_idle=int_cores,
        int_mem=int_mem,
        int_mem_idle=int_mem,
        int_gpus=int_gpus,
        int_gpus_idle=int_gpus,
    )
    HostStat.objects.create(host=host, str_os=os, int_mem_total=int_mem, int_mem_free=int_mem)
    HostTag.objects.create(host=host, str_tag=alloc.str_tag or alloc.str_name, str_tag_type="ALLOC")
    return host


def create_proc(
    host: Host, frame: Frame, *, cores: int = 100, gpus: int = 0, local: bool = False, **fields: object
) -> Proc:
    """A proc of `cores` centicores on `frame`; show, job and layer come from the frame."""
    job = Job.objects.only("show_id").get(pk=frame.job_id)
    return Proc.objects.create(
        host=host,
        show_id=job.show_id,
        job_id=frame.job_id,
        layer_id=frame.layer_id,
        frame=frame,
        int_cores_reserved=cores,
        int_mem_reserved=fields.pop("int_mem_reserved", 1024 * 1024),
        int_gpus_reserved=gpus,
        b_local=local,
        **fields,
    )


@dataclass(frozen=True)
class Farm:
    facility: Facility
    dept: Dept
    show: Show
    alloc: Alloc
    subscription: Subscription
    folder: Folder
    job: Job
    layer: Layer
    host: Host
    frames: list[Frame]

    def folder_resource(self) -> FolderResource:
        return FolderResource.objects.get(folder=self.folder)

    def job_resource(self) -> JobResource:
        return JobResource.objects.get(job=self.job)

    def point(self) -> Point | None:
        return Point.objects.filter(show=self.show, dept=self.dept).first()


def tiny_farm(*, managed: bool, int_burst: int = 100_000, frames: int = 10, host_cores: int = 6400) -> Farm:
    """One of each row, `frames` WAITING frames in the one layer, caps left at their defaults."""
    facility = create_facility()
    dept = create_dept()
    show = create_show(managed=managed)
    alloc = create_alloc(facility)
    subscription = create_subscription(show, alloc, int_burst=int_burst)
    folder = create_folder(show, dept)
    job = create_job(show, folder, dept, facility)
    layer = create_layer(job)
    host = create_host(alloc, int_cores=host_cores)
    return Farm(
        facility=facility,
        dept=dept,
        show=show,
        alloc=alloc,
        subscription=subscription,
        folder=folder,
        job=job,
        layer=layer,
        host=host,
        frames=create_frames(layer, frames),
    )
