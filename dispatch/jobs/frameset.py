"""Frame ranges, chunks and command tokens, as Cuebot and RQD read them (reference §3.7). Pure.

Range syntax (Cuebot's `FrameRange` / `FrameSet`), parts joined by commas:

| part | frames |
|---|---|
| `N` | N (may be negative: `-5`) |
| `a-b` | a..b inclusive; counts down when b < a (`10-1` is 10, 9, ..., 1) |
| `a-bxS` | every S-th frame from a (`1-10x3` is 1, 4, 7, 10); S < 0 counts down (`10-1x-3`) |
| `a-byS` | the frames of `a-b` that `a-bxS` leaves out (`1-10y3` is 2, 3, 5, 6, 8, 9) |
| `a-b:S` | every frame of a..b, interleaved: `a-bxS`, then the new frames of `(a+1)-bx(S/2)`, ... to step 1 |

Like Cuebot, a step must point from a to b (a positive step above 1 with b < a, or a negative
step with b >= a, is an error), a step of 0 is an error, and duplicate frames are dropped,
keeping the first (`1-100x10,1-100` renders every tenth frame first, then the rest). Unlike
Cuebot, a part that yields no frame (`10-1x1`) is an error rather than silently nothing, and
spaces around commas are allowed. Interleave example: `1-10:5` is 1, 6, 2, 4, 8, 10, 3, 5, 7, 9.

Chunking (Cuebot's `normalizeFrameRange`): with chunk size C, one frame row is made for every
C-th frame of the (deduplicated) list; it runs itself and the C-1 frames after it in list
order. The chunk's frame spec is written compactly (`1-5`, `1-9x2`, `1,4,10`). Cuebot's
`getChunk` drops the last frame of a chunk that reaches the end of the list; we do not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

INT4_MAX = 2**31 - 1  # frame.int_number is an integer column
DEFAULT_MAX_FRAMES = 1_000_000  # frame numbers one range may expand to
ZFILL = 4  # #ZFRAME# and frame names: %04d, as Cuebot

_NUM = r"-?\d+"
_PART_RE = re.compile(rf"^(?P<a>{_NUM})(?:-(?P<b>{_NUM})(?:(?P<sep>[xy:])(?P<step>{_NUM}))?)?$")

TOKENS = ("ZFRAME", "IFRAME", "FRAME_START", "FRAME_END", "FRAME_CHUNK", "LAYER", "JOB", "FRAMESPEC", "FRAME")
# One pass over the command: a substituted value (a job name with '#FRAME#' in it) is never re-read.
_TOKEN_RE = re.compile("#(" + "|".join(TOKENS) + ")#")


class FrameRangeError(ValueError):
    """A range that cannot be parsed or expanded; the message says which part and why."""


class _TooMany(Exception):
    """A part would take the expansion past its budget."""


def _fits_alone(part: str, max_frames: int) -> bool:
    try:
        _expand_part(part, max_frames)
    except _TooMany:
        return False
    return True


def _int(text: str, part: str) -> int:
    value = int(text)
    if abs(value) > INT4_MAX:
        raise FrameRangeError(f"{part!r}: {value} is outside the frame number range (+/-{INT4_MAX})")
    return value


def _stepped(a: int, b: int, step: int) -> range:
    """Cuebot's getIntRange: from a towards b by |step|, the direction given by the step's sign."""
    return range(a, b + 1, step) if step > 0 else range(a, b - 1, step)


def _check_step(a: int, b: int, step: int, part: str) -> None:
    if step == 0:
        raise FrameRangeError(f"{part!r}: the step cannot be 0")
    if step > 1 and b < a:
        raise FrameRangeError(f"{part!r}: a positive step needs the end frame >= the start frame ({b} < {a})")
    if step < 0 and b >= a:
        raise FrameRangeError(f"{part!r}: a negative step needs the end frame < the start frame ({b} >= {a})")


def _part_count(a: int, b: int | None, sep: str | None, step: int | None) -> int:
    """Upper bound of the frames a part yields, without expanding it."""
    if b is None:
        return 1
    span = abs(b - a) + 1
    if sep == "x" and step:
        return span // abs(step) + 1
    return span


def _expand_part(part: str, max_frames: int) -> list[int]:
    m = _PART_RE.match(part)
    if m is None:
        raise FrameRangeError(
            f"{part!r} is not a frame range: use N, A-B, A-BxSTEP, A-BySTEP or A-B:STEP (e.g. '1-100x5')"
        )
    a = _int(m["a"], part)
    if m["b"] is None:
        return [a]
    b = _int(m["b"], part)
    sep = m["sep"]
    step = _int(m["step"], part) if m["step"] is not None else None
    if _part_count(a, b, sep, step) > max_frames:
        raise _TooMany
    if sep is None:
        frames = list(_stepped(a, b, 1 if b >= a else -1))
    else:
        assert step is not None
        _check_step(a, b, step, part)
        if sep == "x":
            frames = list(_stepped(a, b, step))
        elif sep == "y":
            skipped = set(_stepped(a, b, step))
            frames = [n for n in _stepped(a, b, 1 if step > 0 else -1) if n not in skipped]
        else:  # ':' interleave, Cuebot's getInterleavedRange
            seen: dict[int, None] = {}
            unit = 1 if step > 0 else -1
            start = a
            while step != 0:
                for n in _stepped(start, b, step):
                    seen.setdefault(n, None)
                start += unit
                step = int(step / 2)  # Java's division truncates toward zero
            frames = list(seen)
    if not frames:
        raise FrameRangeError(f"{part!r} has no frames")
    return frames


def parse_frames(spec: str, *, max_frames: int = DEFAULT_MAX_FRAMES) -> list[int]:
    """The frame numbers of a range spec, in order, duplicates dropped (first kept).

    Raises FrameRangeError naming the offending part. `max_frames` bounds the frames all
    parts expand to (repeats included), checked before each part's list is built, so
    '1-2000000000' fails fast instead of eating memory.
    """
    if not isinstance(spec, str):
        raise FrameRangeError(f"a frame range must be a string such as '1-100', not {spec!r}")
    text = spec.strip()
    if not text:
        raise FrameRangeError("the frame range is empty")
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise FrameRangeError(f"{spec!r} has an empty part between commas")
    seen: dict[int, None] = {}
    budget = max_frames  # frames expanded so far, repeats included: bounds the work, not just the result
    for part in parts:
        try:
            frames = _expand_part(part, budget)
        except _TooMany:
            whole = spec if len(parts) > 1 and _fits_alone(part, max_frames) else part
            raise FrameRangeError(f"{whole!r} has more than {max_frames} frames") from None
        budget -= len(frames)
        for n in frames:
            seen.setdefault(n, None)
    return list(seen)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One frame row: its number (the chunk's first frame), its place in the layer, and its frames."""

    index: int  # 0-based position of the row in the layer's dispatch order
    frames: tuple[int, ...]

    @property
    def number(self) -> int:
        return self.frames[0]

    @property
    def start(self) -> int:
        return self.frames[0]

    @property
    def end(self) -> int:
        return self.frames[-1]

    @property
    def spec(self) -> str:
        return compact_spec(self.frames)


def chunk_frames(frames: Sequence[int], chunk_size: int) -> list[Chunk]:
    """Split a frame list into chunks of `chunk_size` frames, in list order (the last may be shorter)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise FrameRangeError(f"the chunk size must be a whole number >= 1, not {chunk_size!r}")
    return [
        Chunk(index=i, frames=tuple(frames[pos : pos + chunk_size]))
        for i, pos in enumerate(range(0, len(frames), chunk_size))
    ]


def _run_text(start: int, end: int, stride: int) -> str:
    if start == end:
        return str(start)
    if stride in (1, -1):
        return f"{start}-{end}"  # b < a counts down
    return f"{start}-{end}x{stride}"


def compact_spec(frames: Sequence[int]) -> str:
    """A range spec that parses back to exactly `frames`, in order (runs of one stride merged).

    Runs of two frames with a stride other than 1 are written as two single frames ('1,4'),
    as fileseq and Cuebot's FrameSet do. Descending runs use a negative stride.
    """
    out: list[str] = []
    i = 0
    n = len(frames)
    while i < n:
        start = frames[i]
        if i + 1 == n:
            out.append(str(start))
            break
        stride = frames[i + 1] - start
        j = i + 1
        while j + 1 < n and frames[j + 1] - frames[j] == stride:
            j += 1
        count = j - i + 1
        if stride == 0 or (count == 2 and stride not in (1, -1)):
            out.append(str(start))
            i += 1
            continue
        out.append(_run_text(start, frames[j], stride))
        i = j + 1
    return ",".join(out)


def frame_name(number: int, layer: str) -> str:
    """Cuebot's frame name, `%04d-<layer>` ('0001-render', '-005-render')."""
    return f"{number:0{ZFILL}d}-{layer}"


def substitute_tokens(command: str, *, job: str, layer: str, chunk: Chunk, chunk_size: int) -> str:
    """The command RQD runs for one frame row, tokens replaced as Cuebot does.

    #ZFRAME# / #IFRAME# / #FRAME_START#: the row's frame number (zero-padded to 4 / plain /
    plain); #FRAME_END#: the chunk's last frame; #FRAME_CHUNK#: the layer's chunk size;
    #FRAMESPEC#: the chunk's frames as a range; #LAYER#, #JOB#; #FRAME#: the frame name.
    """
    values = {
        "ZFRAME": f"{chunk.number:0{ZFILL}d}",
        "IFRAME": str(chunk.number),
        "FRAME_START": str(chunk.start),
        "FRAME_END": str(chunk.end),
        "FRAME_CHUNK": str(chunk_size),
        "LAYER": layer,
        "JOB": job,
        "FRAMESPEC": chunk.spec,
        "FRAME": frame_name(chunk.number, layer),
    }
    return _TOKEN_RE.sub(lambda m: values[m.group(1)], command)
