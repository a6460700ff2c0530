"""Read windows and freeing rules, as pure functions of one KV-cache group.

Vocabulary: position ``t`` is a token index of one request; logical block
``i`` holds positions ``[i*B, (i+1)*B)``. ``window(g, t)`` is the inclusive
range of positions that computing position ``t`` reads. ``skipped(g, n)`` is
how many leading tokens a manager may drop when ``n`` tokens are computed and
position ``n`` is the next one to compute; ``freeable(g, n, B)`` is the number
of whole leading logical blocks that may be replaced by the NULL block.

full::

    t = 9            [ 0  1  2  3  4  5  6  7  8  9 ]
                     |------------ read -----------|      nothing skipped

sliding(W=4), n = 7 computed, next position 7::

    tokens           [ 0  1  2  3  4  5  6  7 ]
                     |---- computed ----|
                                 |--- read --|            skipped = n - W + 1 = 4

chunked_local(C=8), n = 13, next position 13::

    tokens           [ 0 .. 7 | 8  9 10 11 12 13 14 15 ]
                              |------ read ----|          skipped = floor(n/C)*C = 8

mamba: the recurrent state after position ``t-1`` is all that position ``t``
reads; vLLM's Mamba manager keeps "the state of the last computed token"
(``get_num_skipped_tokens(n) = n - 1``), so in token terms it is a window of 2::

    n = 7            [ 0  1  2  3  4  5  6 | 7 ]
                                       |-read-|           skipped = n - 1 = 6

(Assumption, written down: the state for the last computed token lives in the
logical block of that token's position; spec tokens need the states of the
positions they follow, which this window covers.)
"""

from __future__ import annotations

from .events import Group


def window(g: Group, t: int) -> tuple[int, int]:
    """Inclusive range ``(lo, t)`` of positions read when computing position ``t``."""
    if t < 0:
        raise ValueError("position must be >= 0")
    if g.kind == "full":
        return 0, t
    if g.kind == "sliding":
        return max(0, t - g.param + 1), t
    if g.kind == "chunked_local":
        return (t // g.param) * g.param, t
    if g.kind == "mamba":
        return max(0, t - 1), t
    raise ValueError(f"unknown kind {g.kind!r}")


def skipped(g: Group, n: int) -> int:
    """Leading tokens no longer needed when ``n`` tokens are computed.

    Equals ``window(g, n)[0]``: the lowest position the next token reads."""
    if n <= 0:
        return 0
    return window(g, n)[0]


def freeable(g: Group, n: int, block_size: int) -> int:
    """Number of leading logical blocks that lie wholly before ``skipped(g, n)``."""
    return skipped(g, n) // block_size


def read_blocks(g: Group, start: int, end: int, block_size: int) -> range:
    """Logical blocks read by computing positions ``[start, end)`` (empty if none)."""
    if end <= start:
        return range(0)
    lo = window(g, start)[0]
    return range(lo // block_size, (end - 1) // block_size + 1)


def blocks_for(tokens: int, block_size: int) -> int:
    """Logical blocks needed to hold ``tokens`` positions."""
    return -(-tokens // block_size)


def live_bound(g: Group, block_size: int, max_model_len: int, tokens_ahead: int) -> int:
    """Most live (non-NULL) blocks one request can hold in group ``g`` when the
    manager may be up to ``tokens_ahead`` tokens beyond the count it frees on.

    Freeing on count ``s`` keeps positions ``[skipped(s), s + tokens_ahead)``:
    for sliding that span is at most ``W - 1 + tokens_ahead`` tokens, for
    chunked-local ``C - 1 + tokens_ahead``, for Mamba ``1 + tokens_ahead``.
    A span of ``L`` tokens not aligned to blocks touches ``cdiv(L, B) + 1``
    blocks at most. Never more than the full request needs.
    """
    full = blocks_for(max_model_len, block_size)
    if g.kind == "full":
        return full
    if g.kind == "sliding" or g.kind == "chunked_local":
        span = g.param - 1 + tokens_ahead
    elif g.kind == "mamba":
        span = 1 + tokens_ahead
    else:
        raise ValueError(f"unknown kind {g.kind!r}")
    return min(full, blocks_for(span, block_size) + 1)
