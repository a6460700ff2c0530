"""The ``vllm@VERSION`` / ``vllm@PATH`` target: vLLM's real scheduler and
KV-cache manager behind kvcheck's Target protocol.

Nothing of vLLM is mocked. ``VllmTarget(spec)`` runs vLLM in a worker process
(:mod:`impl.vllm.worker`; one per vLLM, started lazily, shared by targets of
that vLLM, kept across ``reset``), so one kvcheck process can drive 0.25.1 and
0.33.0 side by side and a crash of vLLM becomes :class:`TargetCrash` with the
traceback (or the worker's log if the process died). ``spec`` is a release
(``0.33.0``: the copy installed by ``scripts/install-vllm.sh`` in
``.vllm/0.33.0``) or a path to a source checkout (its ``vllm/`` tree goes first
on ``sys.path``, over the installed release of the same line, else the newest).
``apply_many(events)`` applies a batch in one round trip. The driver
(:mod:`impl.vllm.driver`) maps configs and events onto vLLM and reads the
observations off the real objects; :mod:`impl.vllm.compat` holds every
difference between releases; :mod:`impl.vllm.connector` is kvcheck's own KV
connector, registered with vLLM's ``KVConnectorFactory``.

How a config runs
-----------------
* layout: one layer per group, with vLLM's own spec classes
  (``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``,
  ``RSWASpec``, ``SinkFullAttentionSpec``, ``MambaSpec``) and block size ``B``
  (a group stated with ``r * B`` tokens per block gets an ``r`` times smaller
  head, and vLLM's page-size unification gives it ``r * B``);
  the ``KVCacheConfig`` is what vLLM's engine core plans from those layer
  specs (``get_kv_cache_configs`` with ``num_gpu_blocks_override =
  num_blocks``, then ``resolve_kv_cache_block_sizes``; see
  :func:`compat.plan_kv_cache`), so grouping, page sizes, retained tokens and
  the startup check that the pool serves one request of ``max_model_len`` are
  vLLM's. A layout vLLM refuses is refused with vLLM's reason; one the model
  cannot state (groups merged or reordered, block sizes, scheduler or hash
  block other than the config's) is refused with one line. vLLM's NULL block is id 0
  in every supported release. Mamba runs in ``mamba_cache_mode="align"``
  (prefix caching on), its page padded to the attention page as a
  hybrid model's config does, with a state block per draft token
  (``num_speculative_blocks``); ``"none"`` mode (one block of
  ``max_model_len``) is refused, and so are as many drafts as a block has
  tokens. A speculative block ``_relocate_speculative_block`` moves past the
  new running state is a MoveObs.
* depth 1: ``Scheduler`` (no async scheduling); depth 2: ``AsyncScheduler``;
  depth 3-4: where the release allows it (0.33: Model Runner V2),
  ``AsyncScheduler`` with ``pipeline_parallel_size = depth - 1``
  (``max_concurrent_batches == depth``; a request decodes at most every
  ``depth - 1`` steps, so steps in between can be empty); elsewhere (0.25.1,
  0.26.0 here) the synchronous ``Scheduler`` with ``pipeline_parallel_size =
  depth`` (one decode step of a request in flight, prefill chunks overlap).
* spec tokens: ``SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=K,
  prompt_lookup_min=1, prompt_lookup_max=3)``. Async: vLLM's own ``-1``
  placeholders (the worker would fill them). Depth 1: after each Process the
  engine's ``post_step`` path, ``update_draft_token_ids`` with K drafts for the
  step's running requests (vLLM drops them for prefill chunks). 0.33 then sets
  its own token budget net of draft slots, and pads a request's first decode
  in a decode batch to 1 + K tokens. ``drafter`` ``eagle`` / ``mtp``:
  ``SpeculativeConfig(method="eagle" | "mtp")`` over ``tiny-eagle`` /
  ``tiny-mtp`` (two MTP modules: a multi-module MTP drafter, whose prefill
  lookahead of K gives sliding windows ``extra_retained_tokens = K - 1``), a
  draft layer in the first group.
* hazard ``unordered``: our connector as a KV consumer (``kv_role="kv_consumer"``,
  ``kv_load_failure_policy="recompute"``), which also turns on vLLM's deferred
  frees (``defer_block_free``) when two or more batches are in flight. No
  connector otherwise.
* ``config.policy`` is ignored: vLLM implements ``capabilities.fixed_policy``
  (``optimistic`` without ``num_in_flight_tokens``, 0.25.1; ``settled`` from
  0.26.0), read from the tree's source. ``Counters.bound`` is vLLM's
  per-request admission cap of each group, or ``cdiv(max_model_len, B)`` where
  it has none (full, Mamba).

How an event runs
-----------------
* AddRequest: ``Request`` with prompt token ``(t*7919 + 17) % 32000`` (the
  reference's stream), ``max_tokens = max_new_tokens``, EOS ignored. External
  tokens need the connector (hazard ``unordered``); otherwise Unsupported
  (``can_apply`` is False).
* Schedule: ``schedule()``, called only while the scheduler has requests
  (``has_requests()``: live ones, or an ended one not yet told to the
  workers). A step that schedules nothing is queued too (StepObs with no
  requests), as the engine queues its empty batch, and its empty output is
  processed in turn.
* Process: ``update_from_output`` of the oldest scheduled step, with a
  ``ModelRunnerOutput`` sampling ``1 + a`` tokens (token 7) for each request
  the step samples for (none for a partial prefill chunk), ``a`` = accepted.
* Preemption: only where vLLM's engine preempts: inside ``schedule()`` under
  pool pressure, at an abort, and at ResetPrefixCache, the engine's
  ``reset_prefix_cache(reset_running_requests=True)`` utility call, taken
  between two steps of its loop (fewer than ``depth`` in flight); its
  RuntimeError where the reset fails with blocks still held is returned to
  the caller and the loop goes on. A trace's Preempt of one chosen request is
  refused: vLLM has no such call.
* FailLoad: reported with that step's output as ``invalid_block_ids``: the
  physical blocks (group 0) from logical ``k`` to the end of the loaded range
  as the loading step was scheduled with them (what a worker-side connector
  knows); vLLM's recovery does the rest.
* Finish / Abort: ``finish_requests(id, FINISHED_STOPPED / FINISHED_ABORTED)``.
  At depth 1 vLLM's engine never ends a request while its step runs: a
  Finish / Abort arriving then is held and applied at the next Process,
  after the step ran and before its output is processed (the engine's abort
  queue). The held event's own Observed is empty.

Observations
------------
Tables are read from each single-type manager right after ``schedule()``;
AllocObs from the tables' growth across ``allocate_slots`` (``cached``: the
block did not come from ``get_new_blocks``); FreeObs when
``BlockPool.free_blocks`` takes the block back, the reason from the call
path: inside ``remove_skipped_blocks`` -> ``window`` (whoever called it: the
allocation, or the connector's finish hook), blocks popped under
``_preempt_request`` -> ``preempt``, under ``_free_blocks`` of a finished
request -> ``finish`` / ``abort``; counters from the ``Request`` objects
(finished requests stay, status ``finished``). A table differing from the one
the observations built, or a free no path explains, is a crash, never a guess.

Where vLLM differs from docs/SEMANTICS.md (measured on 0.25.1, 0.26.0, 0.33.0)
------------------------------------------------------------------------------
1. Deferred request-level frees (hazard ``unordered``, depth >= 2): the blocks
   leave the request's table at the preempt / finish / abort but reach the
   pool only when the latest step scheduled by then is processed. FreeObs
   comes then (in that Process); the blocks leave the request's ``live`` at
   once (a block in the deferred-free queue belongs to no live request). A
   preempted request re-admitted before that (0.25.1 and 0.26.0 at
   once, 0.33 once its stale output is processed) is handed new blocks at the
   same logical slots while the old ones are still on their way to the pool.
2. Preemption does not discard in-flight outputs. 0.25.1 / 0.26.0 append the
   tokens of a preempted request's in-flight steps and apply their
   rejections (``c -= rejected`` if ``c > 0``), even after it resumed; 0.33
   delivers them as "stale" tokens without touching the counters and does
   not resume the request until all are processed. ProcessObs.discarded lists
   a request only when vLLM dropped its output (ended, failed load, 0.33's
   drop-mode stale output).
3. ``num_in_flight_tokens`` after a preemption (0.26.0, 0.33): it keeps
   counting the preempted steps until they are processed (``c = 0``, ``f > 0``;
   vLLM frees on ``max(0, c - f)``). 0.26.0 resumes at once, so ``f`` is the
   stale steps plus the new ones.
4. A failed load frees nothing: vLLM keeps the request's table and recomputes
   into the same blocks; no FreeObs ``failed_load`` ever comes from vLLM. At
   the Process of the loading step ``c`` becomes ``j * B`` for the first
   invalid block ``j`` it finds in the table (ProcessObs.failed carries that
   ``j``), and the step's output is discarded.
5. Later in-flight steps of a request whose load failed are not discarded:
   their outputs are delivered and ``num_in_flight_tokens`` counts them until
   processed. Under async scheduling the failed step's output placeholder is
   never resolved, so the recompute step schedules one position more (e.g.
   ``[32, 102)`` where ``[32, 101)`` is due).
6. Window kinds and loads: vLLM allocates NULL for external blocks already out
   of the window of position E, so part of the loaded range shows NULL; a
   FailLoad at such a block is reported to vLLM from the first loaded block at
   or after it; the recompute from ``j * B`` then reads NULL below the window
   (those positions were never loaded): a real null read on SWA / chunked-local.
7. FailLoad on several KV-cache groups: vLLM maps ``invalid_block_ids`` to
   requests only with one (0.33 raises ``RuntimeError``, 0.25.1 fails to
   unpack: a crash, findings/); its per-request ``failed_recving`` covers
   asynchronous loads only. A replayed trace reaches the crash (exit 3); the
   fuzzer draws FailLoad on hybrids only where the tree survives it
   (``can_apply``, ``hybrid_failed_loads``), so campaigns run past it; there
   Mamba joins the hybrids it draws with connector loads too
   (``FuzzSpec.mamba_loads``).
8. With a connector, vLLM's finish path first calls ``remove_skipped_blocks``
   on the finished request (0.25.1 on ``c``, later on ``c - f``): those frees
   are ``window`` frees, before the request-level ones.
9. ``loaded`` is vLLM's ``num_external_computed_tokens`` (E minus the local
   prefix hit, block-aligned on 0.33); the connector offers E once, so a retry
   after a preemption or a failed load recomputes.
10. Chunked-local with prefix caching: vLLM counts the chunks before the last
    one as a cache hit (NULL blocks) even in an empty cache; such a request's
    first step starts at the chunk boundary.
11. A length stop inside accepted drafts: 0.33 trims the extra tokens and
    lowers ``c`` by them.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import weakref
from pathlib import Path
from typing import Any

from impl.target import Capabilities, TargetCrash, TargetError, Unsupported
from impl.vllm import layouts
from impl.worker import WorkerDied, WorkerProcess, flight_from_env, in_worker
from model.events import AddRequest, Config, Event, FailLoad, Preempt, Trace
from model.observations import Observed
from model.streams import EngineState

from . import compat

__all__ = ["VllmTarget", "resolve"]

READY_TIMEOUT_S = float(os.environ.get("KVCHECK_VLLM_START_TIMEOUT", "300"))
# (tree, kv_load_failure_policy) -> whether FailLoad on several groups leaves vLLM running
_HYBRID_FAILED_LOADS: dict[tuple[tuple[str, ...], str], bool] = {}


# ------------------------------------------------------------ which vLLM


class _Install:
    """Where one vLLM comes from: ``path`` (sys.path entries, first wins), the
    release line, and a label for messages."""

    def __init__(self, label: str, version: str, path: list[Path], pkg: Path):
        self.label = label
        self.version = version
        self.path = path
        self.pkg = pkg  # the vllm/ package directory that will be imported

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(str(p) for p in self.path)


def resolve(spec: str) -> _Install:
    """``0.33.0`` -> the release installed in .vllm/0.33.0; a path -> that vLLM
    source checkout (its ``vllm/`` tree first on sys.path, over the installed
    release of the same line, else the newest installed one, for metadata);
    ``0.33.0+FIX.diff`` -> the release with that diff applied, and
    ``0.33.0+A.diff+B.diff`` with a series applied in turn
    (:mod:`impl.vllm.overlay`), run as a checkout."""
    spec = spec.strip()
    release, plus, patch = spec.partition("+")
    checkout = bool(plus) and compat.parse_release(release) is None and "/" in release
    if plus and (compat.parse_release(release) is not None or checkout):
        from .overlay import _stem, overlay_tree, series

        problem = None if checkout else compat.release_problem(release)
        if problem:
            raise TargetError(problem)
        diffs = [Path(d).expanduser() for d in series(patch)]
        tree = overlay_tree(release, diffs)
        inst = resolve(str(tree))
        inst.label = "+".join([Path(release).name if checkout else release,
                               *(_stem(d) + ".diff" for d in diffs)])
        return inst
    if compat.parse_release(spec) is not None:
        problem = compat.release_problem(spec)
        if problem:
            raise TargetError(problem)
        d = compat.install_dir(spec)
        if not (d / "vllm" / "__init__.py").is_file():
            raise TargetError(
                f"vllm {spec} is not installed; run: {compat.install_command(spec)}")
        return _Install(spec, spec, [d], d / "vllm")
    if re.fullmatch(r"v?\d+(\.\d+)*(\.x)?", spec):
        raise Unsupported(f"vllm@{spec}: not a release number like 0.33.0 (three parts)")
    tree = Path(spec).expanduser()
    if tree.name == "vllm" and (tree / "__init__.py").is_file():
        tree = tree.parent
    if not tree.is_dir():
        raise Unsupported(f"vllm@{spec}: neither a vLLM release number (like 0.33.0) nor a "
                          f"folder")
    if not (tree / "vllm" / "__init__.py").is_file():
        raise Unsupported(f"vllm@{spec}: {tree} is not a vLLM source checkout (no "
                          f"vllm/__init__.py in it)")
    tree = tree.resolve()
    line = compat.checkout_version(tree)
    installed = compat.installed_releases()
    base = None
    if line is not None:
        same = [v for v in installed if v.split(".")[:2] == line.split(".")[:2]]
        base = same[-1] if same else None
    if base is None and installed:
        base = installed[-1]
    if base is None:
        raise TargetError(
            f"a vLLM checkout runs over an installed release (for its metadata); none is "
            f"installed: run {compat.install_command('.'.join(map(str, compat.TESTED[-1:])))}")
    version = line or base
    return _Install(f"{tree} ({version})", version, [tree, compat.install_dir(base)],
                    tree / "vllm")


# --------------------------------------------------------------- the worker


def worker_env(inst: _Install) -> dict[str, str]:
    """The environment of a worker process of ``inst`` (beside PYTHONPATH)."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": dict(os.environ).get("KVCHECK_VLLM_LOG_LEVEL", "ERROR"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "KVCHECK_WORKER_VLLM": os.pathsep.join(inst.key),
    }


def _here(inst: _Install) -> bool:
    """Whether this process is a worker that imported ``inst``'s vLLM."""
    return os.environ.get("KVCHECK_WORKER_VLLM") == os.pathsep.join(inst.key) and in_worker()


class _Worker:
    """One worker process for one vLLM (:class:`impl.worker.WorkerProcess`);
    ``slot`` tells apart several of the same vLLM (parallel fuzz runs)."""

    _all: dict[tuple[tuple[str, ...], int], _Worker] = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, inst: _Install, slot: int = 0) -> _Worker | _InProcess:
        if _here(inst):
            return _InProcess.get(inst)
        with cls._lock:
            w = cls._all.get((inst.key, slot))
            if w is None or not w.alive():
                w = cls._all[(inst.key, slot)] = cls(inst)
            return w

    def __init__(self, inst: _Install):
        self.inst = inst
        self.p = WorkerProcess(f"vllm {inst.label}", [str(p) for p in inst.path],
                               worker_env(inst), setup="impl.vllm.worker:setup")
        self.proc = self.p.proc
        self.sessions = itertools.count()
        self.pending_drops: list[Any] = []  # sessions dropped mid-call (_drop_session)

    def busy(self) -> bool:
        """A call on this worker is under way (its lock is not re-entrant)."""
        if self.p.lock.acquire(blocking=False):
            self.p.lock.release()
            return False
        return True

    @property
    def info(self) -> dict[str, Any] | None:
        return self.p.info

    def alive(self) -> bool:
        return self.p.alive()

    def log_tail(self, n: int = 4000) -> str:
        return self.p.log_tail(n)

    def ready(self) -> dict[str, Any]:
        try:
            return self.p.ready(READY_TIMEOUT_S)
        except WorkerDied:
            raise TargetError(f"vllm {self.inst.label}: the worker died while importing vLLM:\n"
                              f"{self.log_tail()}") from None
        except RuntimeError as e:
            raise TargetError(f"vllm {self.inst.label} cannot be imported:\n{e}") from None

    def call(self, op: str, session: Any, payload: Any) -> Any:
        self.ready()
        try:
            while self.pending_drops:
                self.p.call("drop", self.pending_drops.pop(), None)
            return self.p.call(op, session, payload)
        except WorkerDied as e:
            raise TargetCrash(str(e)) from None

    def close(self) -> None:
        self.p.close()


class _InProcess:
    """The driver in this very process (a job running inside a vLLM worker):
    the same requests as :class:`_Worker`, as function calls, each config and
    event written to the flight recorder before it runs."""

    _one: _InProcess | None = None

    @classmethod
    def get(cls, inst: _Install) -> _InProcess:
        if cls._one is None:
            cls._one = cls(inst)
        return cls._one

    def __init__(self, inst: _Install):
        from . import worker

        assert worker.OPS is not None, "a vLLM worker's setup() runs first"
        self.inst = inst
        self.ops = worker.OPS
        self.info = self.ops.info()
        self.sessions = itertools.count(1_000_000)
        self.flight = flight_from_env()
        self.proc = None
        self.pending_drops: list[Any] = []  # sessions dropped mid-call (_drop_session)
        self._calls = 0

    def busy(self) -> bool:
        return self._calls > 0

    def alive(self) -> bool:
        return True

    def log_tail(self, n: int = 4000) -> str:
        return ""

    def ready(self) -> dict[str, Any]:
        return self.info

    def call(self, op: str, session: Any, payload: Any) -> Any:
        self._calls += 1
        try:
            while self.pending_drops:
                self.ops.handle("drop", self.pending_drops.pop(), None)
            f = self.flight
            if f is not None:
                if op == "reset":
                    f.reset(session, payload)
                elif op == "apply":
                    f.apply(session, payload)
            return self.ops.handle(op, session, payload)
        finally:
            self._calls -= 1

    def close(self) -> None:
        pass


def _shutdown_all() -> None:
    for w in list(_Worker._all.values()):
        w.close()
    _Worker._all.clear()


import atexit  # noqa: E402

atexit.register(_shutdown_all)


# ---------------------------------------------------------------- the target


class VllmTarget:
    """vLLM's real scheduler, one release or checkout (``spec``), in a worker."""

    def __init__(self, spec: str):
        self.inst = resolve(spec)
        self.spec = spec
        self.name = f"vllm@{spec}"
        self._worker: _Worker | None = None
        self._session: Any = None
        self._config: Config | None = None
        in_flight = compat.tracks_in_flight(self.inst.pkg)
        # config.policy is ignored: vLLM implements fixed_policy; external
        # tokens need hazard=unordered (a KV-consumer connector); FailLoad on
        # several KV-cache groups crashes the releases (findings/), so
        # can_apply refuses it unless the tree survives it
        # (hybrid_failed_loads); depth 3-4 is pipeline parallelism (the module
        # docstring)
        self.capabilities = Capabilities(
            fixed_policy="settled" if in_flight else "optimistic",
            pinned={"mamba": (
                ("prefix_caching", True, "without prefix caching vLLM sizes a Mamba block to "
                 "max_model_len ('none' mode), a layout with one slot per request; fuzz "
                 "Mamba with --prefix-caching on ('align' mode)"),
            )},
            mamba_align=True,
            ordered_only={"cross": "vLLM runs encoder-decoder models without KV connectors"},
            kind_max_depth={"cross": (2, "vLLM runs encoder-decoder models without "
                                         "pipeline parallelism")},
            engine_blocks=(layouts.attention_block_size(), layouts.hybrid_block_sizes()),
        )
        self._fail_hybrid = False  # FailLoad on this config's groups: see hybrid_failed_loads
        self._reset_mirror()

    # -- process management

    def _w(self) -> _Worker:
        """The worker, started (or restarted after a crash) if needed."""
        if self._worker is None or not self._worker.alive():
            self._worker = _Worker.get(self.inst)
            self._session = next(self._worker.sessions)
            weakref.finalize(self, _drop_session, self._worker, self._session)
        return self._worker

    def _live_worker(self) -> _Worker:
        """The worker this target's state lives in; a dead one is a crash (the
        next ``reset`` starts a fresh one)."""
        w = self._worker
        if w is None or self._config is None:
            raise TargetCrash(f"{self.name}: reset() first")
        if not w.alive():
            self._config = None
            raise TargetCrash(
                f"{self.name}: the worker process died (exit status {w.proc.poll()}):\n"
                f"{w.log_tail()}")
        return w

    def close(self) -> None:
        if self._worker is not None and self._worker.alive():
            _drop_session(self._worker, self._session)
        self._worker = None

    # -- the protocol

    def hybrid_failed_loads(self, policy: str = "recompute") -> bool:
        """Whether this tree survives a connector's block-level load failure on
        a model of several KV-cache groups (``invalid_block_ids``; 0.25.1 and
        0.33.0 end the engine: findings/08-failed-load-hybrid-ends-engine), under
        ``kv_load_failure_policy=policy``. Decided once per tree and policy by
        running that finding's shape on it (full + sliding, a 32-token load
        failing from block 1, in a session of its own): it survives if vLLM
        raises nothing."""
        key = (self.inst.key, policy)
        known = _HYBRID_FAILED_LOADS.get(key)
        if known is None:
            probe = Trace.from_json({"version": 1, "config": {
                "groups": [{"kind": "full"}, {"kind": "sliding", "param": 4}],
                "block_size": 16, "num_blocks": 24, "max_num_batched_tokens": 64,
                "max_num_seqs": 4, "max_model_len": 128, "spec_tokens": 0, "depth": 2,
                "policy": "settled", "hazard": "unordered", "prefix_caching": False,
                "kv_load_failure_policy": policy}, "events": [
                {"type": "AddRequest", "id": "r0", "prompt_len": 40, "max_new_tokens": 2,
                 "external_tokens": 32},
                {"type": "Schedule"}, {"type": "FailLoad", "id": "r0", "first_bad_block": 1},
                {"type": "Process", "accepted": {}}, {"type": "Schedule"}]})
            w = self._w()
            session = next(w.sessions)
            try:
                reply = w.call("reset", session, probe.config)
                if reply[0] == "ok":
                    reply = w.call("apply", session, list(probe.events))
                known = reply[0] == "ok"
            finally:
                _drop_session(w, session)
            _HYBRID_FAILED_LOADS[key] = known
        return known

    def reset(self, config: Config) -> Observed:
        if config.depth > self.capabilities.max_depth:
            raise Unsupported(f"{self.name}: depth {config.depth} > {self.capabilities.max_depth}")
        if config.stream_ordered:
            raise Unsupported(f"{self.name}: stream_ordered is SGLang's (vLLM's out-of-window "
                              f"frees are judged whatever the writers); set it false")
        self._fail_hybrid = (len(config.groups) > 1 and config.hazard == "unordered"
                             and self.hybrid_failed_loads(config.kv_load_failure_policy))
        w = self._w()
        reply = w.call("reset", self._session, config)
        self._reset_mirror()
        if reply[0] == "unsupported":
            raise Unsupported(f"{self.name}: {reply[1]}")
        if reply[0] == "crash":
            raise TargetCrash(f"{self.name}: reset raised:\n{reply[1]}")
        self._config = config
        self._observe(reply[1])
        return reply[1]

    def apply(self, event: Event) -> Observed:
        return self.apply_many([event])[0]

    def apply_many(self, events: list[Event]) -> list[Observed]:
        """Apply several events in one round trip; the same as one ``apply``
        each. On failure the exception carries ``.observed``: the results of
        the events before the one that failed."""
        try:
            reply = self._live_worker().call("apply", self._session, list(events))
        except TargetCrash:
            self._config = None
            raise
        kind = reply[0]
        done = reply[1] if kind == "ok" else reply[2]
        for obs in done:
            self._observe(obs)
        if kind == "ok":
            return done
        failed = events[len(done)]
        if kind == "unsupported":
            exc: Exception = Unsupported(f"{self.name}: {failed}: {reply[1]}")
        elif kind == "rejected":
            exc = Unsupported(f"{self.name}: {failed} is not valid here now: {reply[1]}")
        else:
            self._config = None
            exc = TargetCrash(f"{self.name}: vLLM raised while applying {failed}:\n{reply[1]}")
        exc.observed = done  # type: ignore[attr-defined]
        raise exc

    # -- preconditions: the engine's order (model/streams.py), and what vLLM cannot take

    def _reset_mirror(self) -> None:
        self._state: EngineState | None = None

    def _observe(self, obs: Observed) -> None:
        if self._state is None:
            self._state = EngineState(self._config)
        self._state.observe(obs)

    def can_apply(self, event: Event) -> bool:
        cfg, state = self._config, self._state
        if cfg is None or state is None or state.why_not(event) is not None:
            return False
        if type(event) is AddRequest:
            return not event.external_tokens or cfg.hazard == "unordered"
        if type(event) is Preempt:  # no vLLM call preempts one chosen request
            return False
        if type(event) is FailLoad:  # on hybrids a known crash of the releases
            return len(cfg.groups) == 1 or self._fail_hybrid
        return True


def worker_started(spec: str, slot: int = 0) -> bool:
    """Whether a worker of the vLLM ``spec`` names runs in ``slot`` already
    (a job there starts at once, with no import of vLLM first)."""
    try:
        inst = resolve(spec)
    except Exception:  # noqa: BLE001 - a spec that cannot resolve has no worker
        return False
    if _here(inst):
        return True
    w = _Worker._all.get((inst.key, slot))
    return w is not None and w.alive()


def worker_for(spec: str, slot: int = 0) -> WorkerProcess:
    """A started worker process of the vLLM ``spec`` names, for jobs
    (:func:`impl.target.worker_for`); ``slot`` picks one of several."""
    w = _Worker.get(resolve(spec), slot)
    assert isinstance(w, _Worker)
    w.ready()
    return w.p


def _drop_session(worker: _Worker | _InProcess, session: Any) -> None:
    """Drop a target's session in its worker; never waits on the worker. A
    target's finalizer can run in the middle of a call on the same worker (a
    garbage collection inside it), whose lock is not re-entrant: the drop then
    goes with the worker's next call."""
    if worker.busy():
        worker.pending_drops.append(session)
        return
    try:
        if worker.alive() and worker.info is not None:
            worker.call("drop", session, None)
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
