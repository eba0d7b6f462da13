"""Frame ranges (every syntax of reference §3.7), chunks, compact specs and command tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatch.jobs.frameset import (
    Chunk,
    FrameRangeError,
    chunk_frames,
    compact_spec,
    frame_name,
    parse_frames,
    substitute_tokens,
)


@pytest.mark.parametrize(
    ("spec", "frames"),
    [
        ("7", [7]),
        ("-3", [-3]),
        ("1-5", [1, 2, 3, 4, 5]),
        ("5-1", [5, 4, 3, 2, 1]),  # b < a counts down
        ("-2-2", [-2, -1, 0, 1, 2]),
        ("-5--3", [-5, -4, -3]),
        ("1-10x3", [1, 4, 7, 10]),
        ("1-10x4", [1, 5, 9]),
        ("3-3x5", [3]),
        ("10-1x-3", [10, 7, 4, 1]),  # negative step counts down
        ("10-1x-1", list(range(10, 0, -1))),
        ("1-10y3", [2, 3, 5, 6, 8, 9]),  # the frames 1-10x3 leaves out
        ("10-1y-3", [9, 8, 6, 5, 3, 2]),
        ("1-10:5", [1, 6, 2, 4, 8, 10, 3, 5, 7, 9]),  # Cuebot's documented interleave
        ("1-20:5", [1, 6, 11, 16, 2, 4, 8, 10, 12, 14, 18, 20, 3, 5, 7, 9, 13, 15, 17, 19]),
        ("1-5:1", [1, 2, 3, 4, 5]),
        ("10-1:-4", [10, 6, 2, 9, 7, 5, 3, 1, 8, 4]),
        ("1,3,7-9", [1, 3, 7, 8, 9]),
        (" 1 , 3 ", [1, 3]),
        ("1-100x10,1-10", [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 2, 3, 4, 5, 6, 7, 8, 9, 10]),  # repeats dropped
        ("5,5,5", [5]),
    ],
)
def test_every_range_syntax(spec: str, frames: list[int]) -> None:
    assert parse_frames(spec) == frames


def test_interleave_covers_every_frame_once() -> None:
    frames = parse_frames("1-100:8")
    assert sorted(frames) == list(range(1, 101))
    assert frames[:13] == [1, 9, 17, 25, 33, 41, 49, 57, 65, 73, 81, 89, 97]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("1,,2", "empty part"),
        ("1,", "empty part"),
        ("a", "is not a frame range"),
        ("1-", "is not a frame range"),
        ("1-10x", "is not a frame range"),
        ("1-10z2", "is not a frame range"),
        ("1.5", "is not a frame range"),
        ("1-10x0", "step cannot be 0"),
        ("1-10:0", "step cannot be 0"),
        ("10-1x2", "positive step needs the end frame >= the start frame"),
        ("1-10x-2", "negative step needs the end frame < the start frame"),
        ("1-10y-2", "negative step needs the end frame < the start frame"),
        ("10-1x1", "has no frames"),
        ("1-10y1", "has no frames"),
        ("1-3000000000", "outside the frame number range"),
        ("1-2000000", "more than 1000000 frames"),
    ],
)
def test_bad_ranges_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(FrameRangeError, match=message):
        parse_frames(spec)


def test_the_frame_limit_counts_every_part_before_expanding_it() -> None:
    assert len(parse_frames("1-600", max_frames=1000)) == 600
    with pytest.raises(FrameRangeError, match="more than 1000 frames"):
        parse_frames("1-600,1-600", max_frames=1000)  # repeats still cost work
    with pytest.raises(FrameRangeError, match="more than 10 frames"):
        parse_frames("1-1000000000", max_frames=10)


def test_a_range_must_be_a_string() -> None:
    with pytest.raises(FrameRangeError, match="must be a string"):
        parse_frames(100)  # type: ignore[arg-type]


def test_chunks_take_every_nth_frame_in_list_order() -> None:
    chunks = chunk_frames(parse_frames("1-10"), 4)
    assert [(c.index, c.frames) for c in chunks] == [(0, (1, 2, 3, 4)), (1, (5, 6, 7, 8)), (2, (9, 10))]
    assert [(c.number, c.start, c.end, c.spec) for c in chunks] == [
        (1, 1, 4, "1-4"),
        (5, 5, 8, "5-8"),
        (9, 9, 10, "9-10"),  # the last frame is kept (Cuebot's getChunk drops it)
    ]
    interleaved = chunk_frames(parse_frames("1-10:5"), 3)
    assert [c.frames for c in interleaved] == [(1, 6, 2), (4, 8, 10), (3, 5, 7), (9,)]
    assert chunk_frames(parse_frames("1-3"), 100) == [Chunk(0, (1, 2, 3))]
    assert len(chunk_frames(parse_frames("1-3"), 1)) == 3


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2"])
def test_a_chunk_size_is_a_whole_number_of_at_least_one(size: object) -> None:
    with pytest.raises(FrameRangeError, match="chunk size"):
        chunk_frames([1, 2], size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("frames", "spec"),
    [
        ([1], "1"),
        ([1, 2, 3], "1-3"),
        ([1, 3, 5, 7], "1-7x2"),
        ([1, 4], "1,4"),
        ([3, 2, 1], "3-1"),
        ([10, 8, 6], "10-6x-2"),
        ([1, 2, 3, 10, 20, 30], "1-3,10-30x10"),
        ([1, 6, 2, 4, 8, 10, 3, 5, 7, 9], "1,6,2,4,8,10,3-9x2"),
    ],
)
def test_compact_spec(frames: list[int], spec: str) -> None:
    assert compact_spec(frames) == spec
    assert parse_frames(spec) == frames


@given(st.lists(st.integers(-10_000, 10_000), min_size=1, max_size=60, unique=True))
def test_compact_spec_parses_back_to_the_same_frames(frames: list[int]) -> None:
    assert parse_frames(compact_spec(frames)) == frames


@given(
    st.integers(-500, 500),
    st.integers(-500, 500),
    st.integers(-40, 40).filter(bool),
    st.sampled_from("xy:"),
)
def test_stepped_parts_stay_inside_their_bounds(a: int, b: int, step: int, sep: str) -> None:
    try:
        frames = parse_frames(f"{a}-{b}{sep}{step}")
    except FrameRangeError:
        return
    assert frames and len(frames) == len(set(frames))
    assert all(min(a, b) <= n <= max(a, b) for n in frames)
    if sep == ":":
        assert sorted(frames) == list(range(min(a, b), max(a, b) + 1))


def test_frame_names_are_cuebots() -> None:
    assert frame_name(1, "render") == "0001-render"
    assert frame_name(12345, "render") == "12345-render"
    assert frame_name(-5, "sim") == "-005-sim"


def test_tokens_are_replaced_once_each() -> None:
    chunk = chunk_frames(parse_frames("1-10"), 4)[1]
    command = "r #ZFRAME# #IFRAME# #FRAME_START#-#FRAME_END# c#FRAME_CHUNK# #LAYER# #JOB# #FRAMESPEC# #FRAME# #NOPE#"
    out = substitute_tokens(command, job="shot_#FRAME#", layer="beauty", chunk=chunk, chunk_size=4)
    # A job name holding a token is not read again; unknown tokens are left alone.
    assert out == "r 0005 5 5-8 c4 beauty shot_#FRAME# 5-8 0005-beauty #NOPE#"
