"""The Target protocol: one interface for every manager under test.

A target takes a config and events and reports observations
(:mod:`model.observations`). Properties read only observations, so one
property serves every target.

``make_target("reference")`` or ``make_target("vllm@0.33.0")`` /
``make_target("vllm@/path/to/checkout")`` or ``make_target("sglang@0.5.23")``
builds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from model.events import KINDS, Config, Event
from model.observations import Observed

# the block sizes a fuzz draws on a target that names none of its own
# (Capabilities.small_blocks): vLLM's default 16 first, then 4 and 8, whose
# edges a run of 30 events reaches in decode
SMALL_BLOCKS = (16, 4, 8)


class TargetError(RuntimeError):
    """The target cannot run (unsupported version, missing install): exit 3."""


class TargetCrash(RuntimeError):
    """The target raised while applying an event: exit 3 with the trace."""


class Unsupported(ValueError):
    """The config asks for something this target cannot do (exit 2)."""


@dataclass(frozen=True)
class Capabilities:
    kinds: frozenset[str] = frozenset({*KINDS, "hybrid"})
    max_depth: int = 4
    fixed_policy: str | None = None  # the policy the target implements, if not configurable
    # per kind, fuzz options the target needs: (FuzzSpec field, value, why); a
    # field left to be drawn takes the value, one set otherwise is refused
    pinned: dict[str, tuple[tuple[str, object, str], ...]] = field(default_factory=dict)
    # per kind, values fuzz options take where left to be drawn (FuzzSpec
    # field, value), which a run may still set otherwise
    defaults: dict[str, tuple[tuple[str, object], ...]] = field(default_factory=dict)
    # with prefix caching on, Mamba states live in the worker's slots
    # (model.mamba_slots: vLLM's align mode); otherwise in the block of their
    # position (the reference). The attention replay reads them accordingly.
    mamba_align: bool = False
    # kinds the target runs with an in-order hazard only (no KV connector), and why
    ordered_only: dict[str, str] = field(default_factory=dict)
    # kinds the target runs at fewer steps in flight than max_depth: (depth, why)
    kind_max_depth: dict[str, tuple[int, str]] = field(default_factory=dict)
    # whether the target takes ResetPrefixCache
    resets: bool = True
    # its engine loop (model.streams.EngineState): "vllm" schedules only while
    # it has requests and queues empty steps; "sglang" runs empty iterations
    loop: str = "vllm"
    # the block sizes its engine builds (--block-size engine): for attention
    # layouts, and those it pads a Mamba hybrid to (impl.vllm.layouts); None:
    # the target has no engine to build them
    engine_blocks: tuple[int, tuple[int, ...]] | None = None
    # the block (page) sizes a fuzz draws where none is given (the first is
    # where shrinking goes): small ones whose edges a short run reaches
    small_blocks: tuple[int, ...] = SMALL_BLOCKS
    # the engine's call that preempts one chosen request (a Preempt event), if
    # it has one; None: preemption only inside schedule(), at an abort, at a
    # ResetPrefixCache (vLLM), or in update_running_batch (SGLang)
    preempt_call: str | None = None
    # per kind, witnesses the target's engine does not reach in runs of a
    # fuzz's size, so a run is not judged vacuous for lacking them: (witness,
    # why); the run names them (RunStats.unrequired)
    unrequired: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)


def fit_spec(target_name: str, caps: Capabilities, spec) -> None:
    """Fit a fuzz spec to what the target can run, or raise Unsupported: the
    kind, the policy it implements, the options a kind needs on it."""
    if spec.kind not in caps.kinds:
        raise Unsupported(f"target {target_name} does not support kind {spec.kind}")
    if spec.depth is not None and spec.depth > caps.max_depth:
        raise Unsupported(f"target {target_name} runs at most {caps.max_depth} step(s) in "
                          f"flight; --depth {spec.depth} is over it")
    if caps.fixed_policy and spec.policy not in ("settled", caps.fixed_policy):
        raise Unsupported(f"target {target_name} implements the {caps.fixed_policy} policy; "
                          f"--policy {spec.policy} applies to the reference target only")
    if caps.fixed_policy:
        spec.policy = caps.fixed_policy
    spec.small_blocks = caps.small_blocks
    if spec.layout == "engine":
        if caps.engine_blocks is None:
            raise Unsupported(f"target {target_name} has no engine whose block sizes "
                              "--block-size engine could draw; name a vLLM target")
        spec.engine_blocks = caps.engine_blocks
    for name, value in caps.defaults.get(spec.kind, ()):
        if getattr(spec, name) is None:
            setattr(spec, name, value)
    for name, value, why in caps.pinned.get(spec.kind, ()):
        have = getattr(spec, name)
        if have is None:
            setattr(spec, name, value)
        elif have != value:
            raise Unsupported(f"target {target_name}, kind {spec.kind}: {why}")


class Target(Protocol):
    name: str
    capabilities: Capabilities

    def reset(self, config: Config) -> Observed:
        """Start afresh with ``config``; raises Unsupported for a config it can't run."""

    def apply(self, event: Event) -> Observed:
        """Apply one (valid) event; returns what happened."""

    def can_apply(self, event: Event) -> bool:
        """Whether ``event`` is valid now (preconditions of the state machine)."""


def layout_note(target_name: str, config: Config) -> str | None:
    """One line where ``config``'s layout is one the target's engine builds
    for no published model (vLLM: :func:`impl.vllm.layouts.note`)."""
    if target_name.partition("@")[0] == "vllm":
        from impl.vllm.layouts import note

        return note(config)
    return None


def make_target(spec: str) -> Target:
    if spec == "reference":
        from impl.reference import ReferenceTarget

        return ReferenceTarget()
    if spec.startswith("vllm@"):
        from impl.vllm import VllmTarget

        return VllmTarget(spec[len("vllm@"):])
    if spec.startswith("sglang@"):
        from impl.sglang.target import SglangTarget

        return SglangTarget(spec[len("sglang@"):])
    raise Unsupported(f"unknown target {spec!r} (use 'reference', 'vllm@VERSION', 'vllm@PATH' "
                      f"or 'sglang@VERSION')")


def worker_for(spec: str, slot: int = 0):
    """A worker process (:class:`impl.worker.WorkerProcess`, started and
    ready) that runs jobs beside target ``spec``: for a vLLM, one that imported
    it; for the reference, a plain one. ``slot`` picks one of several."""
    if spec.startswith("vllm@"):
        from impl.vllm import worker_for as vllm_worker

        return vllm_worker(spec[len("vllm@"):], slot)
    if spec.startswith("sglang@"):
        from impl.sglang.target import worker_for as sglang_worker

        return sglang_worker(spec[len("sglang@"):], slot)
    if spec != "reference":
        make_target(spec)  # raises Unsupported for a name no target has
    from impl.worker import plain_worker

    return plain_worker(slot)
