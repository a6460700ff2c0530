"""Differential mode: one trace on two targets, the first disagreement.

Used to keep the reference manager faithful to vLLM: run the same trace on
``reference`` (set to the policy the vLLM version implements) and on
``vllm@VERSION`` and compare, event by event:

* the steps scheduled: which requests, which positions, drafts, loads;
* the block tables' shape: which logical slots are NULL;
* the blocks let go: (request, group, logical block, reason);
* with ``physical=True`` also the physical block ids.

Physical ids agree only if both pools hand out blocks in the same order, which
vLLM does not promise; the default compares the logical picture.

``view="letgo"`` compares what property 6's twin compares on a vLLM target at
depth 1 (:func:`properties.invariants.compare_letgo`): the steps, and while
they agree the blocks let go; a difference in the steps ends the comparison
as ``parted`` (a :class:`Difference` whose ``what`` starts with it), not as a
disagreement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from impl.target import Target, make_target
from model.events import Config, Trace, config_for
from model.observations import NULL, FreeObs, Observed, StepObs
from model.streams import Driver


@dataclass
class Difference:
    index: int  # event index
    what: str
    left: str
    right: str

    def __str__(self) -> str:
        return f"event {self.index}: {self.what}\n  left:  {self.left}\n  right: {self.right}"


def _steps(obs: Observed, physical: bool):
    out = []
    for it in obs.items:
        if isinstance(it, StepObs):
            for rs in it.reqs:
                tables = tuple(
                    tuple(b if physical else (b == NULL) for b in t) for t in rs.tables)
                out.append((rs.rid, rs.start, rs.end, rs.spec, rs.loaded, tables))
    return sorted(out, key=lambda x: x[0])


def _frees(obs: Observed, physical: bool):
    return sorted((f.rid, f.group, f.logical, f.reason) + ((f.block,) if physical else ())
                  for f in obs.items if isinstance(f, FreeObs))


def _fmt_steps(rows) -> str:
    if not rows:
        return "no step"
    parts = []
    for rid, a, b, spec, loaded, tables in rows:
        t = " | ".join("".join("." if x is True else "#" if x is False else f"{x}," for x in tb)
                       for tb in tables)
        parts.append(f"{rid} [{a},{b}) spec {spec} loaded {loaded} table {t}")
    return "; ".join(parts)


def diff(trace: Trace, left: Target | str, right: Target | str, physical: bool = False,
         align_policy: bool = True, view: str = "all") -> tuple[list[Difference], int]:
    """Run ``trace`` on both; returns (differences, events compared). With
    ``align_policy`` a reference side takes the policy the other side implements.
    ``view="letgo"``: property 6's comparison, ``right`` the target, ``left``
    its twin (the reference under ``settled``; ``align_policy`` is off)."""
    if view == "letgo":
        align_policy = False
    lt = make_target(left) if isinstance(left, str) else left
    rt = make_target(right) if isinstance(right, str) else right
    lcfg = rcfg = trace.config
    if align_policy:
        for mine, other in ((lt, rt), (rt, lt)):
            fixed = other.capabilities.fixed_policy
            if fixed and mine.name == "reference":
                if mine is lt:
                    lcfg = replace(lcfg, policy=fixed)
                else:
                    rcfg = replace(rcfg, policy=fixed)
    lt.reset(lcfg)
    rt.reset(rcfg)
    diffs: list[Difference] = []
    for i, ev in enumerate(trace.events):
        try:
            lo, ro = lt.apply(ev), rt.apply(ev)
        except ValueError as e:  # a target refused the event: the trace is not valid for it
            from properties.replay import InvalidEvent

            raise InvalidEvent(f"event {i} ({type(ev).__name__}) is not valid here: {e}") \
                from None
        if view == "letgo":
            from properties.invariants import compare_letgo

            v, why = compare_letgo(ev, ro, lo, rt.name, i)
            if why is not None:
                diffs.append(Difference(i, f"parted: {why.split(':')[0]}", why, ""))
                break
            if v is not None:
                diffs.append(Difference(i, f"{type(ev).__name__}: blocks let go differ",
                                        str(v), ""))
                break
            continue
        ls, rs = _steps(lo, physical), _steps(ro, physical)
        if ls != rs:
            diffs.append(Difference(i, f"{type(ev).__name__}: scheduled steps differ",
                                    _fmt_steps(ls), _fmt_steps(rs)))
            break
        lf, rf = _frees(lo, physical), _frees(ro, physical)
        if lf != rf:
            diffs.append(Difference(i, f"{type(ev).__name__}: blocks let go differ",
                                    str(lf) or "none", str(rf) or "none"))
            break
    return diffs, (diffs[0].index + 1 if diffs else len(trace.events))


def random_config(kind: str, rng, policy: str = "settled", **over) -> Config:
    """The differential sweep's config space (tests/test_differential.py,
    scripts/diff_sweep.py): requests of at most ``8B`` tokens
    (:func:`random_trace`) in a pool vLLM's engine starts with. Prefix caching
    on full attention only: vLLM 0.33.0 keeps sliding-window and Mamba blocks
    in the prefix cache only at its retained checkpoints
    (``prefix_cache_retention_interval``, default 0), which the reference,
    caching every full block, does not mirror (docs/DIFFERENCES.md, 5).
    ``over``: fields set after the draws (``depth=1``, ``prefix_caching=True``),
    so a seed draws the same config otherwise."""
    from model.windows import startup_blocks

    B = rng.choice([4, 16])
    cfg = config_for(
        kind, block_size=B, num_blocks=rng.randint(8, 48),
        max_num_batched_tokens=rng.choice([16, 32, 64]), depth=rng.choice([1, 2]),
        spec_tokens=rng.choice([0, 2]), policy=policy,
        hazard=rng.choice(["ordered", "unordered"]),
        prefix_caching=rng.random() < 0.3 and kind == "full",
        window=rng.choice([4, 16, 24]), chunk=32, max_model_len=8 * B)
    cfg = replace(cfg, **over)
    return replace(cfg, num_blocks=max(cfg.num_blocks, startup_blocks(cfg)))


def random_trace(cfg: Config, rng, length: int, targets: list[Target]) -> Trace:
    """A random trace of ``length`` events for ``cfg`` that every one of
    ``targets`` accepts, drawn by the one random driver
    (:class:`model.streams.Driver`: each event valid for the engine and for
    each target as it is applied); shorter if no event is valid any more."""
    return Driver(cfg, targets, rng).run(length)
