"""A scheduler built from the driver's caches is the scheduler a fresh driver builds.

The vLLM driver (impl/vllm/driver.py) builds a ``VllmConfig`` once per config
shape, a ``ModelConfig`` once per length (each build a copy of it), and plans
the KV-cache layout once per config (the last two shared by the drivers of a
process); each example still gets a new ``Scheduler``. Here, in a worker that
imported vLLM 0.33.0, one driver first runs the trace's own config, one of
another shape and one of the same shape with another pool, so that its next
build of the trace's config comes from its caches; a new ``Driver()``, with
the shared caches emptied, builds the same config from nothing. Both then
run the trace: the scheduler's state after the build, every observation, and
the state at the end must be equal (a refusal or a crash the same line).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gate.known import finding_traces
from model.events import Drain, Trace
from properties.jobs import _call

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
TARGET = "vllm@0.33.0"


def _traces() -> list[Path]:
    own = [p for p in finding_traces()
           if Trace.load(p).meta.get("target") == TARGET]
    return own + sorted((ROOT / "traces" / "attention").glob("*.json"))


def _plain(x: object) -> object:
    return x if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__


def _state(d: object) -> dict:
    """What a scheduler is built from and holds: its config objects' fields,
    its plain attributes, the layout, the pool's free queue, its managers."""
    s = d.sched  # type: ignore[attr-defined]
    vc = s.vllm_config
    out: dict = {"sched": {k: _plain(v) for k, v in sorted(vars(s).items())}}
    for name in ("cache_config", "scheduler_config", "model_config", "parallel_config",
                 "speculative_config", "kv_transfer_config"):
        c = getattr(vc, name, None)
        if c is not None and dataclasses.is_dataclass(c):
            # engine_id: a uuid per KVTransferConfig, different in every build
            out[name] = {f.name: _plain(getattr(c, f.name, None)) for f in dataclasses.fields(c)
                         if f.name != "engine_id"}
    out["kv_cache_config"] = repr(s.kv_cache_config)
    pool = d.pool  # type: ignore[attr-defined]
    out["free"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    out["managers"] = [(type(m).__name__, repr(m.kv_cache_spec)) for m in d.mgrs]  # type: ignore
    out["bound"] = d.bound  # type: ignore[attr-defined]
    return out


def _run(d: object, trace: Trace) -> tuple[list, dict | None]:
    """Reset, then the trace's events up to its first Drain: the observations
    (or the line it stopped with) and the state after the build."""
    out: list = []
    try:
        out.append(d.reset(trace.config))  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - a refusal is compared, not raised
        return [f"{type(e).__name__}: {e}"], None
    built = _state(d)
    for ev in trace.events:
        if isinstance(ev, Drain):
            break
        try:
            out.append(d.apply(ev))  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - vLLM's crash, compared
            out.append(f"{type(e).__name__}: {e}")
            break
    return out, built


def compare_job(paths: list[str]) -> dict[str, object]:
    """In the worker: per trace, the first difference (None: none), and
    whether the reused build took its VllmConfig and plan from the caches."""
    from dataclasses import replace

    from impl.vllm.driver import Driver

    warm = Driver()
    result: dict[str, object] = {}
    for path in paths:
        trace = Trace.load(path)
        cfg = trace.config
        # the config itself, one of another shape, then one of the same shape
        # (the same VllmConfig) with another pool: the build to compare then
        # takes its plan from the cache and a VllmConfig another plan used last
        for other in (cfg, replace(cfg, max_num_batched_tokens=cfg.max_num_batched_tokens + 1),
                      replace(cfg, num_blocks=cfg.num_blocks + 3)):
            try:
                warm.reset(other)
                for ev in trace.events[:3]:
                    if not isinstance(ev, Drain):
                        warm.apply(ev)
            except Exception:  # noqa: BLE001 - only the caches matter here
                pass
        plans, configs = len(warm._plans), dict(warm._vllm_configs)
        reused, reused_state = _run(warm, trace)
        # a fresh driver, with nothing cached in the process either
        cached_plans, cached_models = dict(warm._plans), dict(warm._model_configs)
        warm._plans.clear()
        warm._model_configs.clear()
        fresh_driver = Driver()
        fresh, fresh_state = _run(fresh_driver, trace)
        warm._plans.update(cached_plans)
        warm._model_configs.update(cached_models)
        cached = (len(warm._plans) == plans and warm.sched is not None
                  and any(warm.sched.vllm_config is v for v in configs.values()))
        diff = None
        if reused_state != fresh_state:
            keys = sorted(k for k in {*(reused_state or {}), *(fresh_state or {})}
                          if (reused_state or {}).get(k) != (fresh_state or {}).get(k))
            diff = f"the built schedulers differ in {keys}: " + "; ".join(
                f"{k}.{f}: {a.get(f)!r} != {b.get(f)!r}"
                for k in keys if isinstance(a := (reused_state or {}).get(k), dict)
                and isinstance(b := (fresh_state or {}).get(k), dict)
                for f in sorted({*a, *b}) if a.get(f) != b.get(f))
        else:
            for i, (a, b) in enumerate(zip(reused, fresh, strict=False)):
                if a != b:
                    diff = f"observation {i} differs: {a!r} != {b!r}"
                    break
            else:
                if len(reused) != len(fresh):
                    diff = f"{len(reused)} observations against {len(fresh)}"
                elif reused_state is not None and _state(warm) != _state(fresh_driver):
                    diff = "the schedulers differ after the trace"
        result[Path(path).name] = (diff, cached, len(reused))
    return result


def test_reused_build_equals_a_fresh_one():
    paths = _traces()
    assert len(paths) >= 10
    got = _call(TARGET, 0, "tests.test_vllm_reuse:compare_job", ([str(p) for p in paths],))
    assert set(got) == {p.name for p in paths}
    diffs = {name: d for name, (d, _, _) in got.items() if d is not None}
    assert not diffs, diffs
    # the comparison is of builds from the caches, over traces that ran
    built = [name for name, (_, cached, n) in got.items() if cached]
    assert len(built) >= len(paths) // 2, got
    assert sum(n for _, _, n in got.values()) > 200
