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
DEFAULT_POLICY = "settled"  # the fix: what a run uses unless told otherwise
# the policies `make check` expects proved on every kind (the others it expects
# refuted wherever a kind frees early): the fix, and SGLang's one-token-later rule
EXPECTED_SAFE = frozenset({"settled", "sglang"})


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


@register("sglang")
def sglang(group: Group, counts: Counts) -> int:
    """SGLang 0.5.23's decode-time sliding-window free (``maybe_evict_swa`` ->
    ``free_swa_out_of_window_slots``): below ``seqlen - 1 - W``, where
    ``seqlen`` counts prompt and *processed* output tokens, so the basis is the
    settled count less one token (the token sampled but not yet computed makes
    up the ``- 1``). Modelled at ``SGLANG_SWA_EVICTION_INTERVAL=1``; a larger
    interval frees the same slots later, never earlier. The overlap scheduler's
    skip of a request's first decode (``decode_batch_idx >= 1``) frees less
    still. docs/ENGINES.md has the derivation."""
    return counts.computed - counts.in_flight - counts.loading - 1


@register("trtllm")
def trtllm(group: Group, counts: Counts) -> int:
    """TensorRT-LLM's ``WindowBlockManager::adjustBlocksIfNeeded``: a block is
    detached once its end is at most ``numTokens - W``, ``numTokens`` grown at
    schedule time with the drafts, and a detached block is never re-attached
    when a rejection lowers ``numTokens``. Positions below ``numTokens - W``
    are the ones no position ``>= numTokens - 1`` reads: the optimistic count
    less one."""
    return counts.computed - 1
