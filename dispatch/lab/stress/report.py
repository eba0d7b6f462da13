"""What a phase reports: its figures, its failures, and the lines `manage.py stress` prints."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PhaseReport:
    name: str
    frames: int = 0
    booked: int = 0
    window: float = 0.0
    wall: float = 0.0
    rejected: dict[str, int] = field(default_factory=dict)
    breaches: int = 0
    breach_keys: list[str] = field(default_factory=list)
    samples: int = 0
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and self.breaches == 0

    @property
    def throughput(self) -> float:
        return self.booked / self.window if self.window > 0 else 0.0

    def lines(self) -> list[str]:
        out = [
            f"== phase {self.name} ==",
            f"frames: {self.frames} seeded, {self.booked} booked ({100.0 * self.booked / max(self.frames, 1):.1f}%)",
            f"throughput: {self.throughput:.0f} frames/s over a {self.window:.2f}s booking window"
            f" (wall {self.wall:.2f}s)",
            "booked: " + str(self.booked),
            "rejected: " + (", ".join(f"{k} {v}" for k, v in sorted(self.rejected.items())) or "none"),
            f"cap breaches: {self.breaches}" + (f" ({', '.join(self.breach_keys[:5])})" if self.breach_keys else ""),
            f"watchdog samples: {self.samples}",
            *self.notes,
        ]
        out.append("audit: OK" if not self.failed else "audit: FAILED")
        out.extend(f"  {f}" for f in self.failed[:50])
        return out
