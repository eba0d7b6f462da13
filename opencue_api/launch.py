"""JobInterface.LaunchSpec and LaunchSpecAndWait: pyoutline's job submission (cuerun.launch).

Cuebot serves both on JobInterface (servant/ManageJob.java): the request carries the XML job spec
(opencue_api.xml_spec reads it into cuesched's JSON spec) and the answer is the new jobs' names
(LaunchSpec) or the jobs themselves (LaunchSpecAndWait, what pyoutline calls). The jobs go
through `dispatch.jobs.submit.submit_jobs`, the JSON API's own submit for several jobs: the same
validation, one transaction for every job of the spec (a refused job leaves none launched), and
each job's `submit` audit row, by `opencue-api (as <spec user>)`.

Cuebot's LaunchSpec queues the launch and answers at once; here both calls answer once the jobs
are committed, so a client that reads the job back right after LaunchSpec finds it.
"""

from __future__ import annotations

from typing import Any

from opencue_proto import job_pb2

from dispatch.jobs.plan import SpecError
from dispatch.jobs.submit import SubmitResult, submit_jobs
from opencue_api.jobs import JobServicer, find_job
from opencue_api.rpc import BadRequest, actor, unary
from opencue_api.xml_spec import XmlSpecError, read_spec


def launch(xml: str) -> list[SubmitResult]:
    """Submit every job of the XML spec, all or none; what was written, in the spec's order."""
    try:
        plan = read_spec(xml)
    except XmlSpecError as exc:
        raise BadRequest("; ".join(exc.errors)) from None
    try:
        results = submit_jobs(plan.jobs, user=plan.user, actor=actor(plan.user))
    except SpecError as exc:
        raise BadRequest("; ".join(exc.errors)) from None
    return results


class LaunchingJobServicer(JobServicer):
    """JobInterface with the launch calls (a subclass, so the JobInterface reads stay where they are)."""

    @unary
    def LaunchSpec(self, request: Any, context: Any) -> job_pb2.JobLaunchSpecResponse:
        return job_pb2.JobLaunchSpecResponse(names=[r.name for r in launch(request.spec)])

    @unary
    def LaunchSpecAndWait(self, request: Any, context: Any) -> job_pb2.JobLaunchSpecAndWaitResponse:
        jobs = [find_job(r.job_id) for r in launch(request.spec)]
        return job_pb2.JobLaunchSpecAndWaitResponse(jobs=job_pb2.JobSeq(jobs=jobs))
