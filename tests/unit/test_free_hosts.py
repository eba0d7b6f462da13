"""The feed's free-host summary may say yes too often, never no (issue 19, head-of-line)."""

from __future__ import annotations

from dispatch.engine.feed import FreeHosts
from dispatch.engine.placement import HostRec


def host(pk: str, alloc: str, tags: tuple[str, ...], cores_idle: int, mem: int, gpus: int = 0) -> HostRec:
    return HostRec(
        pk=pk, name=pk, alloc=alloc, facility="fac", os="linux", thread_mode=0, tags=tags,
        cores_total=3200, cores_idle=cores_idle, mem_idle=mem, mem_free=mem, mem_total=mem,
        gpus_idle=gpus, gpu_mem_idle=gpus * 16, gpu_mem_free=gpus * 16,
    )  # fmt: skip


def test_each_resource_is_the_largest_free_value_per_allocation_and_tag() -> None:
    shapes = FreeHosts.of(
        [
            host("h1", "a1", ("x", "y"), cores_idle=800, mem=100),
            host("h2", "a1", ("x",), cores_idle=250, mem=900, gpus=2),
            host("h3", "a2", ("x",), cores_idle=1600, mem=10),
        ]
    ).shapes
    by_key = {(alloc, tag): (cores, mem, gpus) for alloc, _f, _os, tag, cores, mem, gpus, _gm in shapes}
    # h1's cores and h2's memory and GPUs: no single host has all three (the summary says yes too often).
    assert by_key[("a1", "x")] == (800, 900, 2)
    assert by_key[("a1", "y")] == (800, 100, 0)
    assert by_key[("a2", "x")] == (1600, 10, 0)


def test_a_host_without_a_whole_idle_core_is_not_free() -> None:
    shapes = FreeHosts.of([host("h1", "a1", ("x",), cores_idle=99, mem=100)]).shapes
    assert shapes == ()
    # Partly used cores count by whole cores, as placement books them.
    (shape,) = FreeHosts.of([host("h2", "a1", ("x",), cores_idle=250, mem=100)]).shapes
    assert shape[4] == 200
