"""Read windows and freeing rules of one KV-cache group, as functions.

A thin layer over the kind classes of :mod:`model.kinds` (where the windows
are drawn): position ``t`` is a token index of one request; logical block
``i`` holds positions ``[i*B, (i+1)*B)``; ``prompt_len`` is the request's
prompt length (R-SWA reads its whole prompt; the other kinds ignore it).

* :func:`window` ``(g, t)``: the inclusive range ``(lo, t)`` ending at ``t``
  that ``t`` reads (R-SWA reads its prompt besides: :func:`reads`);
* :func:`reads` ``(g, t, P)``: every range ``t`` reads, half-open;
* :func:`skipped` ``(g, n)``: leading tokens no position ``>= n`` reads;
* :func:`freeable` ``(g, n, B)``: whole leading blocks before ``skipped(g, n)``;
* :func:`freeable_blocks` ``(g, n, B, P)``: every block no position ``>= n``
  reads (R-SWA's gap included);
* :func:`read_blocks` ``(g, start, end, B, P)``: blocks a step computing
  ``[start, end)`` reads;
* :func:`cached_reads` ``(g, a, P)``: what a step starting at ``a`` reads
  from the cache, the ranges below ``a``;
* :func:`live_bound`: most live blocks per request (the admission bound).
"""

from __future__ import annotations

from collections.abc import Sequence

from .events import Config, Group
from .kinds import Ranges, cdiv


def window(g: Group, t: int, prompt_len: int | None = None) -> tuple[int, int]:
    """Inclusive range ``(lo, t)`` of the positions ending at ``t`` that ``t`` reads."""
    return g.spec.window(t, prompt_len if prompt_len is not None else t + 1)[-1][0], t


def reads(g: Group, t: int, prompt_len: int | None = None) -> Ranges:
    return g.spec.window(t, prompt_len)


def skipped(g: Group, n: int) -> int:
    """Leading tokens no longer needed when ``n`` tokens are computed.

    Equals ``window(g, n)[0]`` for the kinds that drop a head prefix."""
    return g.spec.skipped(n)


def freeable(g: Group, n: int, block_size: int) -> int:
    """Number of leading logical blocks that lie wholly before ``skipped(g, n)``."""
    return g.spec.skipped(n) // block_size


def freeable_blocks(g: Group, n: int, block_size: int,
                    prompt_len: int | None = None) -> range:
    """Logical blocks wholly outside the window of every position ``>= n``."""
    return g.spec.freeable(n, block_size, prompt_len)


def read_blocks(g: Group, start: int, end: int, block_size: int,
                prompt_len: int | None = None) -> Sequence[int]:
    """Logical blocks read by computing positions ``[start, end)`` (empty if none)."""
    if end <= start:
        return range(0)
    return g.spec.span_blocks(start, end, block_size, prompt_len)


def cached_reads(g: Group, a: int, prompt_len: int | None = None) -> Ranges:
    """The positions below ``a`` that a step computing from ``a`` reads (its own
    positions it writes first)."""
    if a <= 0:
        return ()
    return tuple((x, min(y, a)) for x, y in g.spec.window(a, prompt_len) if x < a)


def blocks_for(tokens: int, block_size: int) -> int:
    """Logical blocks needed to hold ``tokens`` positions."""
    return cdiv(tokens, block_size)


def live_bound(g: Group, block_size: int, max_model_len: int, tokens_ahead: int) -> int:
    """Most live (non-NULL) blocks one request can hold in group ``g`` when the
    manager may be up to ``tokens_ahead`` tokens beyond the count it frees on.

    Freeing on count ``s`` keeps positions ``[skipped(s), s + tokens_ahead)``:
    for sliding that span is at most ``W - 1 + tokens_ahead`` tokens, for
    chunked-local ``C - 1 + tokens_ahead``, for Mamba ``1 + tokens_ahead``.
    A span of ``L`` tokens not aligned to blocks touches ``cdiv(L, B) + 1``
    blocks at most. Never more than the full request needs (full, R-SWA,
    sink).
    """
    return g.spec.live_bound(block_size, max_model_len, tokens_ahead)


def startup_blocks(cfg: Config) -> int:
    """Pool size (NULL block included) below which vLLM's engine refuses to
    start: ``get_kv_cache_configs`` checks that the usable pool serves one
    request of ``max_model_len`` in every group at once
    (``_check_enough_kv_cache_memory``), each group at its per-request cap
    with ``max_in_flight_tokens = depth * max_num_batched_tokens``. Taken here
    as the larger of the checker's own :func:`live_bound` and the kind's
    admission cap per group (vLLM's sliding cap may pass the whole request by
    one block; a kind without a cap admits only a request whose whole
    sequence fits, as vLLM's gate does), plus the blocks a kind holds for
    drafts or reserves for itself; or a kind's own share where vLLM's check
    sets aside another figure (:meth:`Kind.startup_share`: cross attention's
    encoder budget). A config at or above it is one the engine
    builds; the config strategy draws pools from here up."""
    L = cfg.max_model_len
    ahead = cfg.depth * cfg.max_num_batched_tokens

    def need(g: Group, B: int) -> int:
        share = g.spec.startup_share(B, cfg.max_num_batched_tokens)
        if share is not None:
            return share
        cap = g.spec.admission_cap(B, L, ahead)
        return (max(live_bound(g, B, L, ahead), blocks_for(L, B) if cap is None else cap)
                + g.spec.speculative_blocks(cfg.spec_tokens)
                + len(g.spec.reserved_blocks(B)))

    return 1 + sum(need(g, B) for g, B in zip(cfg.groups, cfg.block_sizes, strict=True))
