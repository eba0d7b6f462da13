"""Host scoring: how much of a host a booking would strand, the lower the better.

Tightest fit on idle cores alone packs cores and ignores memory: a 1-core, 48 GB frame and a
1-core, 2 GB frame both go to the host with the fewest idle cores, so a host with many cores
and little memory fills with big-memory frames (its cores stranded: idle, with no memory
left to run anything) while a host with much memory and few cores fills with small ones (its
memory stranded). The score here is the Rust scheduler's E-PVM placement score
(`rust/crates/scheduler/src/pipeline/placement.rs`, `placement_score`), the same formula and
default weights:

* `more` is how many more frames of the same shape the host could take after this one, the
  least over the dimensions the frame asks for (cores, memory, GPUs, GPU memory);
* each dimension's waste is what would be left of it once those `more` frames ran too,
  counted in frames of this shape: ``((idle - ask) - more * ask) / ask``. A host whose idle
  resources are in the frame's proportions wastes nothing on any dimension and scores 0;
* a frame that asks for no GPU pays instead for the GPUs a host would keep idle under it
  (per idle GPU and per idle GB of GPU memory), so CPU work goes to GPU hosts last.

Booking the frame does not change its host's score (idle and `more` fall together), so the
host chosen for a layer stays the layer's choice for its next frame: the loop places a layer's
frames on one host without a new search (see `HostView.fits`).

Pure arithmetic on numbers, no import of placement: the unit tests pin it without a host view.
"""

from __future__ import annotations

from dataclasses import dataclass

KB_PER_GB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Weights:
    """Per-dimension weights; the Rust scheduler's defaults (`ScoreWeights::default`)."""

    cores: float = 1.0
    mem: float = 1.0
    gpus: float = 2.0
    gpu_mem: float = 1.0
    # Soft reservation of GPU hosts for GPU work: per idle GPU and per idle GB of GPU memory.
    gpu_count_reservation: float = 2.0
    gpu_mem_reservation: float = 2.0


DEFAULT_WEIGHTS = Weights()


def frames_more(idle: tuple[int, int, int, int], ask: tuple[int, int, int, int]) -> int:
    """Frames of this shape the host could still take after this one (0 if none, or no ask at all).

    `idle` and `ask` are (cores in centicores, memory KB, GPUs, GPU memory KB); a dimension the
    frame does not ask for bounds nothing.
    """
    bounds = [(i - a) // a for i, a in zip(idle, ask, strict=True) if a > 0]
    return max(0, min(bounds)) if bounds else 0


def stranding_score(
    idle: tuple[int, int, int, int], ask: tuple[int, int, int, int], weights: Weights = DEFAULT_WEIGHTS
) -> float:
    """The E-PVM score of booking `ask` on a host with `idle` free: 0 is a perfect fit.

    Both are (cores in centicores, memory KB, GPUs, GPU memory KB), `ask` what the frame would
    really book on this host (its cores after sizing).
    """
    more = frames_more(idle, ask)

    def waste(i: int, a: int) -> float:
        return ((i - a) - more * a) / a if a > 0 else 0.0

    score = weights.cores * waste(idle[0], ask[0]) + weights.mem * waste(idle[1], ask[1])
    if ask[2] > 0:
        score += weights.gpus * waste(idle[2], ask[2]) + weights.gpu_mem * waste(idle[3], ask[3])
    else:
        score += weights.gpu_count_reservation * idle[2] + weights.gpu_mem_reservation * idle[3] / KB_PER_GB
    return score
