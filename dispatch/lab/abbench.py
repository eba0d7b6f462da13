"""The A/B bench: `manage.py bench` of two revisions, alternated on one machine, figure by figure.

Why: a figure taken on another day or another machine is not a comparison. This shared
machine's load moves by tens of percent within minutes, so the two revisions run in
alternation (old, new, old, new, ...), each round once per side with the same arguments, each
side on its own freshly migrated database beside the configured one; a figure's ratio is the
new side's median over the old side's, and its spread is the range of the per-round ratios
(round i's new over round i's old, taken minutes apart), which shows how much of a difference
the load alone makes.

How a side is built: the old revision's tree is exported with `git archive` into a scratch
directory (not `git worktree add`: the repository's worktree list is shared by every checkout
of it, and a crashed run would leave an entry behind). It runs on this interpreter when its
requirements.txt is this checkout's; otherwise the report says so (and `--python` names
another interpreter). The new side is this checkout as it is, uncommitted changes included,
unless a revision is given for it too.

How figures are read: from bench's text output, the one form every revision prints (old ones
included): each summary line `<name>: <median> <unit> (min <a>, max <b>, <k> runs)`, the shares
of the floor, the Store/database ratios and the notification delays. Indented lines (single
runs) and anything else are not figures.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql

from cuesched_project.dburl import database_from_url, url_from_settings

FIGURE_RE = re.compile(
    r"^(?P<name>\S.*?): (?P<median>-?\d+(?:\.\d+)?) (?P<unit>[^\s(]+) "
    r"\(min -?\d+(?:\.\d+)?, max -?\d+(?:\.\d+)?, (?P<runs>\d+) (?:runs?|calls)\)$"
)
SHARE_RE = re.compile(r"^(?P<name>\S.*) as a share of the floor: (?P<value>-?\d+(?:\.\d+)?)%$")
RATIO_RE = re.compile(r"^ratio (?P<name>.+): (?P<value>-?\d+(?:\.\d+)?)x$")
NOTIFY_RE = re.compile(
    r"^notification-to-Store delay over \d+ releases: p50 (?P<p50>[\d.]+) ms, p99 (?P<p99>[\d.]+) ms, "
    r"max (?P<max>[\d.]+) ms$"
)
# Parts of a name that count what a run happened to do, not what it measured.
VARYING_RE = re.compile(r" \(\d+ booked\)")
HIGHER = {"frames/s", "completions/s", "pairs/s", "%"}
LOWER = {"s", "ms"}


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str

    @property
    def better(self) -> str:
        """Which way is better: `higher`, `lower`, or `` for ratios between two modes."""
        return "higher" if self.unit in HIGHER else "lower" if self.unit in LOWER else ""


def parse_bench_output(text: str) -> dict[str, Figure]:
    """Every figure of one `bench` run's standard output, by name (the last one wins)."""
    figures: dict[str, Figure] = {}

    def add(name: str, value: str, unit: str) -> None:
        name = VARYING_RE.sub("", name)
        figures[name] = Figure(name, float(value), unit)

    for line in text.splitlines():
        line = line.rstrip()
        if not line or line[0].isspace():
            continue  # one run of a figure, not the figure
        if m := SHARE_RE.match(line):
            add(f"{m['name']} as a share of the floor", m["value"], "%")
        elif m := RATIO_RE.match(line):
            add(f"ratio {m['name']}", m["value"], "x")
        elif m := NOTIFY_RE.match(line):
            for q in ("p50", "p99", "max"):
                add(f"notification-to-Store delay {q}", m[q], "ms")
        elif m := FIGURE_RE.match(line):
            add(m["name"], m["median"], m["unit"])
    return figures


@dataclass
class Comparison:
    """One figure on both sides: per-round values (None where a round lacks it), medians, ratios."""

    name: str
    unit: str
    better: str
    old: list[float | None]
    new: list[float | None]

    @staticmethod
    def _median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    @property
    def old_median(self) -> float | None:
        return self._median(self.old)

    @property
    def new_median(self) -> float | None:
        return self._median(self.new)

    @property
    def ratio(self) -> float | None:
        """new median / old median."""
        old, new = self.old_median, self.new_median
        return new / old if old and new is not None else None

    @property
    def round_ratios(self) -> list[float]:
        """new / old of every round that has the figure on both sides."""
        return [n / o for o, n in zip(self.old, self.new, strict=True) if o and n is not None]

    @property
    def spread(self) -> tuple[float, float] | None:
        ratios = self.round_ratios
        return (min(ratios), max(ratios)) if ratios else None


def compare(old_rounds: Sequence[dict[str, Figure]], new_rounds: Sequence[dict[str, Figure]]) -> list[Comparison]:
    """Each figure's rounds side by side, in the order bench prints them (new side first)."""
    if len(old_rounds) != len(new_rounds):
        raise ValueError(f"{len(old_rounds)} old rounds against {len(new_rounds)} new ones")
    names: dict[str, Figure] = {}
    for rounds in (new_rounds, old_rounds):
        for r in rounds:
            for name, fig in r.items():
                names.setdefault(name, fig)
    out = []
    for name, fig in names.items():
        old = [r[name].value if name in r else None for r in old_rounds]
        new = [r[name].value if name in r else None for r in new_rounds]
        out.append(Comparison(name, fig.unit, fig.better, old, new))
    return out


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def format_table(rows: Sequence[Comparison]) -> list[str]:
    """The comparison as aligned text: medians per side, new/old and the range of per-round ratios."""
    head = ("figure", "unit", "better", "old", "new", "new/old", "per-round new/old", "rounds")
    body = []
    for c in rows:
        spread = c.spread
        body.append(
            (
                c.name,
                c.unit,
                c.better or "-",
                _num(c.old_median),
                _num(c.new_median),
                f"{c.ratio:.2f}" if c.ratio is not None else "-",
                f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
                str(len(c.round_ratios)),
            )
        )
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in (head, *body)]


# --- the sides --------------------------------------------------------------------------------
class ABError(Exception):
    """The A/B run could not go on; the message says what failed and where its log is."""


@dataclass
class Side:
    label: str  # "old" or "new"
    revision: str  # a commit, or "this checkout (<sha>[, with uncommitted changes])"
    root: Path
    python: str
    database_url: str = ""
    rounds: list[dict[str, Figure]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ABError(f"git {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def resolve(repo: Path, revision: str) -> str:
    """The commit `revision` names (a clear error when it names none)."""
    try:
        return _git(repo, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    except ABError:
        raise ABError(f"{revision!r} names no commit of {repo} (try a sha, a branch, HEAD~1)") from None


def describe_checkout(repo: Path) -> str:
    sha = _git(repo, "rev-parse", "HEAD")
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    return f"this checkout ({sha[:12]}{', with uncommitted changes' if dirty else ''})"


def export_tree(repo: Path, commit: str, dest: Path) -> None:
    """The commit's files into `dest` (git archive piped into tar: no worktree registered)."""
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True, check=False)
    if archive.stdout is not None:
        archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise ABError(f"could not export {commit} into {dest}: {untar.stderr.decode(errors='replace').strip()}")


def requirement_lines(path: Path) -> list[str]:
    """requirements.txt without comments and blank lines (what pip would install)."""
    if not path.exists():
        return []
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return sorted(line for line in lines if line)


def scratch_url(base_url: str, name: str) -> str:
    return url_from_settings({**database_from_url(base_url), "NAME": name})


def create_database(base_url: str, name: str) -> str:
    """A new empty database `name` on the server of `base_url`; its URL."""
    with psycopg.connect(base_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return scratch_url(base_url, name)


def drop_database(base_url: str, name: str) -> None:
    with psycopg.connect(base_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def child_env(database_url: str) -> dict[str, str]:
    """This process's environment for a side's command: its database, and no path into this checkout."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE")}
    environ["DATABASE_URL"] = database_url
    return environ


def run_manage(side: Side, args: Sequence[str], log: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`manage.py <args>` of the side, stdout and stderr kept in `log`.out/.err; an error if it fails."""
    cmd = [side.python, str(side.root / "manage.py"), *args]
    try:
        done = subprocess.run(
            cmd,
            cwd=side.root,
            env=child_env(side.database_url),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ABError(f"{side.label}: `manage.py {' '.join(args)}` did not finish within {timeout:.0f}s") from exc
    log.with_suffix(".out").write_text(done.stdout)
    log.with_suffix(".err").write_text(done.stderr)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise ABError(f"{side.label}: `manage.py {' '.join(args)}` exited {done.returncode} (log {log}.err):\n{tail}")
    return done


@dataclass
class ABResult:
    old: Side
    new: Side
    bench_args: list[str]
    comparisons: list[Comparison]
    notes: list[str]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]


def run_ab(
    repo: Path,
    *,
    against: str,
    new_revision: str | None,
    rounds: int,
    bench_args: Sequence[str],
    base_url: str,
    scratch: Path,
    python: str | None = None,
    timeout: float = 3600.0,
    emit: Callable[[str], None] = print,
) -> ABResult:
    """Build the sides, migrate their databases, run bench on each in alternation, compare.

    The scratch databases are dropped whatever happens; `scratch` (trees and logs) is the
    caller's to remove.
    """
    if rounds < 1:
        raise ABError("--rounds must be at least 1")
    if "--out" in bench_args or any(a.startswith("--out=") for a in bench_args):
        raise ABError("bench's --out is the A/B's own (each run writes into the scratch directory): leave it out")
    notes: list[str] = []
    old_commit = resolve(repo, against)
    old = Side("old", old_commit, scratch / "old", sys.executable)
    export_tree(repo, old_commit, old.root)
    if new_revision is None:
        new = Side("new", describe_checkout(repo), repo, sys.executable)
    else:
        new_commit = resolve(repo, new_revision)
        new = Side("new", new_commit, scratch / "new", sys.executable)
        export_tree(repo, new_commit, new.root)
    here = requirement_lines(repo / "requirements.txt")
    for side in (old, new):
        if side.root == repo:
            continue
        theirs = requirement_lines(side.root / "requirements.txt")
        if theirs == here:
            notes.append(f"{side.label}: requirements.txt matches this checkout's: the shared interpreter runs it")
        elif python is not None:
            side.python = python
            notes.append(f"{side.label}: requirements.txt differs from this checkout's: runs on {python}")
        else:
            differ = sorted(set(theirs) ^ set(here))
            notes.append(
                f"{side.label}: requirements.txt DIFFERS from this checkout's ({', '.join(differ)}), and it runs on "
                f"this checkout's interpreter anyway ({sys.executable}); give --python for one with its requirements"
            )
    for line in notes:
        emit(line)
    base_name = database_from_url(base_url)["NAME"]
    names = {s.label: f"{base_name[:40]}_ab_{os.getpid()}_{s.label}" for s in (old, new)}
    load_before = os.getloadavg()
    try:
        for side in (old, new):
            side.database_url = create_database(base_url, names[side.label])
            started = time.monotonic()
            run_manage(side, ["migrate", "--noinput"], scratch / f"{side.label}-migrate", timeout)
            took = time.monotonic() - started
            emit(f"{side.label}: {side.revision}, database {names[side.label]} migrated in {took:.1f}s")
        for i in range(rounds):
            for side in (old, new):
                out = scratch / f"{side.label}-round{i + 1}"
                started = time.monotonic()
                done = run_manage(side, ["bench", *bench_args, "--out", str(out)], out, timeout)
                side.seconds.append(time.monotonic() - started)
                figures = parse_bench_output(done.stdout)
                if not figures:
                    raise ABError(f"{side.label}: bench printed no figure this parser reads (log {out}.out)")
                side.rounds.append(figures)
                emit(f"round {i + 1}/{rounds} {side.label}: {len(figures)} figures in {side.seconds[-1]:.1f}s")
    finally:
        for name in names.values():
            drop_database(base_url, name)
    return ABResult(old, new, list(bench_args), compare(old.rounds, new.rounds), notes, load_before, os.getloadavg())


def report_lines(result: ABResult) -> list[str]:
    load = ", ".join(f"{x:.1f}" for x in result.load_before)
    after = ", ".join(f"{x:.1f}" for x in result.load_after)
    lines = [
        f"A/B bench: old {result.old.revision}, new {result.new.revision}",
        f"bench {' '.join(result.bench_args) or '(its defaults)'}; {len(result.old.rounds)} rounds, old then new; "
        f"{os.cpu_count()} CPUs, load {load} before, {after} after",
        *format_table(result.comparisons),
    ]
    one_sided = [c.name for c in result.comparisons if c.old_median is None or c.new_median is None]
    if one_sided:
        lines.append(f"figures on one side only: {', '.join(one_sided)}")
    return lines


def cleanup(scratch: Path) -> None:
    shutil.rmtree(scratch, ignore_errors=True)


def result_json(result: ABResult) -> dict[str, object]:
    """The comparison as data (ab.json): every figure's per-round values, medians and ratios."""
    return {
        "old": result.old.revision,
        "new": result.new.revision,
        "bench_args": result.bench_args,
        "rounds": len(result.old.rounds),
        "notes": result.notes,
        "load_before": result.load_before,
        "load_after": result.load_after,
        "seconds": {"old": result.old.seconds, "new": result.new.seconds},
        "figures": [
            {
                "name": c.name,
                "unit": c.unit,
                "better": c.better,
                "old": c.old,
                "new": c.new,
                "old_median": c.old_median,
                "new_median": c.new_median,
                "ratio": c.ratio,
                "round_ratios": c.round_ratios,
            }
            for c in result.comparisons
        ],
    }
