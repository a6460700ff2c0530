"""Where vLLM's worker keeps a Mamba group's recurrent states in ``align``
mode (prefix caching on), as slots of the worker's block table (the model
runner's row, :class:`model.observations.ReqStep` ``tables`` of a Mamba
group). The checker (:mod:`properties.invariants`) and the attention replay
(:mod:`confirm.attention`) both read states through these functions.

A step computing ``[a, e)`` with ``K`` drafts (the last ``K`` positions;
``base = e - K`` the first draft) writes, in this order, its running state
(after ``base - 1``) into slot ``s = (e - 1) // B`` and the state after each
draft into the ``K`` slots after it (``mamba_get_block_table_tensor``).
Once its output is processed with ``acc`` drafts accepted, the count is
``n = base + acc``; where ``n`` crossed a block edge past ``base`` the
postprocess (``postprocess_mamba_fused_kernel``) copies the state after the
edge's last position into the slot of the block that edge closes. The next
step starts from slot ``s + acc`` (``preprocess_mamba``), or from ``s``
where the copy went there. K = 2, B = 4, a decode computing ``[5, 8)``,
both drafts accepted (n = 8)::

    tokens    [ 0..3 | 4..7 |      |      ]
    slots        0      1      2      3
    states              5      6      7          written (after 5, 6, 7)
    copy                7 <---------- 7          the edge at 8 closes slot 1
    next step [8, ..) starts from slot 1 (s, where the copy went)

A step with no step of the request before it (a new or resumed request)
starts from the slot of position ``a - 1``: a prefix hit's state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # model.events imports the kinds, which use this module
    from .events import Config


def worker_slots(cfg: Config) -> bool:
    """Whether ``cfg``'s Mamba groups keep their states in the worker's slots
    (vLLM's align mode: a Mamba group with prefix caching on). Without prefix
    caching a state lives in the block of its position (the reference's
    block-sized states)."""
    return cfg.prefix_caching and any(g.spec.holds_state for g in cfg.groups)


def running_slot(end: int, block_size: int) -> int:
    """The slot of the running state of a step ending at ``end``."""
    return (end - 1) // block_size


def written(end: int, spec: int, block_size: int) -> list[tuple[int, int]]:
    """``(slot, position)`` pairs a step ending at ``end`` with ``spec`` drafts
    writes, in the order it writes them: the slot holds the state after that
    position (one block named at two slots keeps the later state)."""
    s = running_slot(end, block_size)
    base = end - spec
    return [(s + j, base - 1 + j) for j in range(spec + 1)]


def checkpoint_copy(end: int, spec: int, count: int,
                    block_size: int) -> tuple[int, int] | None:
    """``(src, dest)`` slots of the postprocess copy after a step ending at
    ``end`` with ``spec`` drafts is processed and the request's count is
    ``count`` (``end - spec`` plus the accepted drafts): the state after the
    block edge ``count`` reached, from the slot it was written to into the
    slot of the block the edge closes. None: no edge past the first draft,
    or the running slot is already that slot."""
    base = end - spec
    s = running_slot(end, block_size)
    aligned = count // block_size * block_size
    if aligned < base or (aligned == base and aligned // block_size - 1 == s):
        return None
    return s + aligned - base, aligned // block_size - 1


def start_slot(start: int, block_size: int, prev_end: int | None = None,
               prev_spec: int = 0) -> int | None:
    """The slot through which a step computing from ``start`` reads the state
    after ``start - 1``: given the request's step before it (ending at
    ``prev_end`` with ``prev_spec`` drafts), its running slot plus the drafts
    it accepted, or its running slot where that step's postprocess copied the
    state there (:func:`checkpoint_copy`); without one (or when ``start`` is
    not among that step's outcomes) the slot of position ``start - 1``.
    None: it starts at position 0, from no state.
    K = 4, B = 4: the step before computed [3, 8), running state after 3 in
    slot s = 1, drafts' states after 4..7 in slots 2..5; two accepted::

        slots        0    1    2    3    4    5
        states            3    4    5    6    7
                                    ^ the next step, [6, 11), starts here"""
    if start <= 0:
        return None
    if prev_end is not None:
        base = prev_end - prev_spec
        j = start - base
        if 0 <= j <= prev_spec:
            s = running_slot(prev_end, block_size)
            if start // block_size * block_size >= base and start // block_size - 1 == s:
                return s
            return s + j
    return (start - 1) // block_size
