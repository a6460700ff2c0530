"""Freeing policies: which count a manager hands to its freeing rule.

A policy is a function ``(group, counts) -> n``; the manager then frees the
leading ``windows.freeable(group, n, B)`` logical blocks of the request.
``counts`` carries, for one request at the moment of freeing:

* ``computed`` (``c``): the optimistic count, advanced at schedule time;
* ``in_flight`` (``f``): tokens of unprocessed steps (scheduled, spec included);
* ``loading``: tokens a connector is still loading (a load can still fail);
* ``spec``: draft tokens among the in-flight tokens.

Adding a policy is a few lines::

    from model.policy import register

    @register("one-block-late")
    def one_block_late(group, counts):
        return counts.computed - counts.in_flight - counts.loading - 16

and then ``./kvcheck fuzz --policy one-block-late`` and ``./kvcheck prove --policy
one-block-late`` judge it (the reference manager picks it up by name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .events import Group


@dataclass(frozen=True)
class Counts:
    computed: int
    in_flight: int = 0
    loading: int = 0
    spec: int = 0


PolicyFn = Callable[[Group, Counts], int]
REGISTRY: dict[str, PolicyFn] = {}


def register(name: str) -> Callable[[PolicyFn], PolicyFn]:
    def deco(fn: PolicyFn) -> PolicyFn:
        REGISTRY[name] = fn
        return fn

    return deco


def basis(policy: str, group: Group, counts: Counts) -> int:
    """The count the freeing rule sees, never below 0."""
    return max(0, REGISTRY[policy](group, counts))


@register("optimistic")
def optimistic(group: Group, counts: Counts) -> int:
    """Free on num_computed_tokens (vLLM <= 0.25.1)."""
    return counts.computed


@register("settled")
def settled(group: Group, counts: Counts) -> int:
    """Free on num_computed_tokens - num_in_flight_tokens - loading (the fix)."""
    return counts.computed - counts.in_flight - counts.loading


@register("mamba-local")
def mamba_local(group: Group, counts: Counts) -> int:
    """Subtract in-flight spec tokens for Mamba groups only (partial patch)."""
    if group.spec.holds_state:
        return counts.computed - counts.spec
    return counts.computed
