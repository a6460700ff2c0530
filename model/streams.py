"""Valid event streams: which events an engine can take next, and a seeded
random driver of them.

:class:`EngineState` reads observations only and says which events are valid
in the engine's order (docs/DESIGN.md, events): a ``Schedule`` while fewer than
``depth`` steps are in flight (an empty one counts: the engine queues its
empty batch) and the scheduler has requests (a live one, or one ended since
the last ``Schedule``, whose end the next step tells the workers), a
``Process`` of the oldest step naming only its own drafts, an ``AddRequest``
of a new id that fits ``max_model_len``, a ``Preempt`` of a running request
holding blocks (where the target has such a call), a ``ResetPrefixCache``
between two steps of the loop (fewer than ``depth`` in flight), a
``FailLoad`` of a block a step in flight loads, a ``Finish``/``Abort`` of a
live request. A target
adds its own refusals (``Target.can_apply``: what its engine cannot take);
the reference's own guard refuses on ``apply`` as an engine asserts.

:class:`Driver` is the one random driver of targets: every event it applies
is valid for the state and for each of its targets, so one stream runs on
several targets at once (the differential sweep), and it keeps each
target's observations. Its :meth:`Driver.tick` is the engine's loop (schedule
while the batch queue has room, else take the oldest output) for steady
workloads (``make bench``). The Hypothesis state machine
(``properties/machine.py``) draws its events through its rules instead, so
that Hypothesis shrinks them.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from model.events import (
    Abort,
    AddRequest,
    Config,
    Event,
    FailLoad,
    Finish,
    Preempt,
    Process,
    ResetPrefixCache,
    Schedule,
    Trace,
)
from model.observations import Observed, ProcessObs, ReqStep, StepObs


class EngineState:
    """What an engine can take next, mirrored from its observations."""

    def __init__(self, cfg: Config, loop: str = "vllm") -> None:
        self.cfg = cfg
        # "vllm": the engine calls schedule() only while it has requests, and
        # queues an empty step; "sglang": its loop runs an empty iteration too
        self.loop = loop
        self.pending: deque[StepObs] = deque()  # unprocessed steps, oldest first
        self.status: dict[str, str] = {}  # every request seen: its last status
        self.holding: dict[str, int] = {}  # live blocks of each listed request
        self.computed: dict[str, int] = {}  # num_computed_tokens of each listed request
        self.scheduled = 0  # steps scheduled so far
        self.ended_since_schedule = False  # a request ended since the last step

    def observe(self, obs: Observed) -> None:
        for it in obs.items:
            if type(it) is StepObs:
                self.pending.append(it)
                self.scheduled += 1
                self.ended_since_schedule = False
            elif type(it) is ProcessObs:
                self.pending.popleft()
        if obs.counters is not None:
            for rid, rc in obs.counters.reqs.items():
                if rc.status == "finished" and self.status.get(rid, "finished") != "finished":
                    self.ended_since_schedule = True
                self.status[rid] = rc.status
                self.holding[rid] = sum(rc.live)
                self.computed[rid] = rc.computed

    def live(self) -> list[str]:
        """Requests added and not finished, in order of arrival."""
        return [r for r, s in self.status.items() if s != "finished"]

    def has_requests(self) -> bool:
        """vLLM's ``Scheduler.has_requests()``: the engine calls ``schedule()``
        only then (a live request, or an ended one not yet told to the workers)."""
        return self.ended_since_schedule or any(s != "finished" for s in self.status.values())

    def busy(self) -> bool:
        """Whether a step in flight schedules anything (not only empty ones)."""
        return any(s.reqs for s in self.pending)

    def loading(self) -> list[ReqStep]:
        """The in-flight steps' shares that load external tokens."""
        return [r for s in self.pending for r in s.reqs if r.loaded]

    def why_not(self, ev: Event) -> str | None:
        """Why ``ev`` is not valid now, or None."""
        cfg = self.cfg
        t = type(ev)
        if t is Schedule or t is ResetPrefixCache:
            if len(self.pending) >= cfg.depth:
                return f"{len(self.pending)} steps in flight already (depth {cfg.depth})"
            if t is Schedule and self.loop == "vllm" and not self.has_requests():
                return "no request to schedule (the engine does not call schedule())"
            return None
        if t is Process:
            if not self.pending:
                return "no step in flight"
            drafts = {r.rid: r.spec for r in self.pending[0].reqs}
            for rid, a in ev.accepted.items():
                if rid in drafts and not 0 <= a <= drafts[rid]:
                    return f"accepted[{rid!r}] = {a}, but the oldest step has {drafts[rid]} drafts"
            return None
        if t is AddRequest:
            if ev.id in self.status:
                return f"request {ev.id!r} exists already"
            if ev.prompt_len < 1 or ev.max_new_tokens < 1:
                return "prompt_len and max_new_tokens must be >= 1"
            if not 0 <= ev.external_tokens < ev.prompt_len:
                return "external_tokens must be in [0, prompt_len)"
            if ev.prompt_len + ev.max_new_tokens > cfg.max_model_len:
                return f"prompt_len + max_new_tokens exceeds max_model_len {cfg.max_model_len}"
            return None
        status = self.status.get(getattr(ev, "id", None), "finished")
        if status == "finished":
            return f"no live request {getattr(ev, 'id', None)!r}"
        if t is Preempt:
            if status != "running" or not self.holding.get(ev.id):
                return f"request {ev.id!r} holds no blocks"
            return None
        if t is FailLoad:
            lo = ev.first_bad_block * cfg.block_size
            if not any(r.rid == ev.id and r.start - r.loaded <= lo < r.start
                       for r in self.loading()):
                return f"no load in flight for {ev.id!r} covers block {ev.first_bad_block}"
            return None
        if t is Finish or t is Abort:
            return None
        return f"unknown event {ev!r}"


class Driver:
    """Seeded random valid events, applied to every one of ``targets``.

    ``max_requests``: AddRequests in the stream at most; prompts of
    ``1..prompt`` tokens (default ``6B``), outputs of ``1..new`` (default
    ``2B``), both capped by ``max_model_len``; with ``external`` some prompts
    are partly loaded by a connector (a target that refuses that gets the
    request without). ``keep=False`` keeps neither events nor observations
    (a long stream checked as it is made: ``on_apply(event, observations)``
    sees each)."""

    WEIGHTS = {"add": 3, "schedule": 7, "process": 6, "preempt": 1, "reset": 1, "fail": 1,
               "end": 2}

    def __init__(self, cfg: Config, targets: list[Any], rng: random.Random | int = 0, *,
                 max_requests: int = 8, prompt: int | None = None, new: int | None = None,
                 external: bool = True, keep: bool = True, on_apply: Any = None) -> None:
        self.cfg = cfg
        self.targets = list(targets)
        self.rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        self.max_requests = max_requests
        B = cfg.block_size
        self.prompt = min(prompt or 6 * B, cfg.max_model_len - 1)
        self.new = new or 2 * B
        self.external = external
        self.keep = keep
        self.on_apply = on_apply
        self.state = EngineState(cfg)
        self.events: list[Event] = []
        self.obs: list[list[Observed]] = []  # per target: reset, then one per event
        for t in self.targets:
            o = t.reset(cfg)
            self.obs.append([o])
        self.state.observe(self.obs[0][0])
        self.added = 0

    # ------------------------------------------------------------ applying

    def valid(self, ev: Event) -> bool:
        return self.state.why_not(ev) is None and all(t.can_apply(ev) for t in self.targets)

    def apply(self, ev: Event) -> list[Observed]:
        """Apply ``ev`` to every target; their observations, in order."""
        out = [t.apply(ev) for t in self.targets]
        if self.keep:
            self.events.append(ev)
            for mine, o in zip(self.obs, out, strict=True):
                mine.append(o)
        self.state.observe(out[0])
        if self.on_apply is not None:
            self.on_apply(ev, out)
        if isinstance(ev, AddRequest):
            self.added += 1
        return out

    # ---------------------------------------------------------- drawing

    def _accepted(self, step: StepObs, every: bool = False) -> dict[str, int]:
        """Accepted drafts of the requests in ``step`` that have drafts: a
        random count for each (``every``), else for about 70% of them (the
        rest accept all)."""
        return {r.rid: self.rng.randint(0, r.spec) for r in step.reqs
                if r.spec and (every or self.rng.random() < 0.7)}

    def candidates(self) -> list[tuple[str, Event]]:
        """One drawn event of each kind, with its kind (:meth:`step` keeps the
        valid ones): an AddRequest while fewer than ``max_requests`` were
        added, a Schedule, with a step in flight a Process of it and a FailLoad
        of a block one of its loads covers, with a live request a Preempt and
        a Finish or Abort of it."""
        rng, st, B = self.rng, self.state, self.cfg.block_size
        out: list[tuple[str, Event]] = []
        if self.added < self.max_requests:
            p = rng.randint(1, self.prompt)
            n = rng.randint(1, max(1, min(self.new, self.cfg.max_model_len - p)))
            ext = rng.randint(0, p - 1) if self.external and rng.random() < 0.5 else 0
            out.append(("add", AddRequest(f"r{self.added}", p, n, ext)))
        out.append(("schedule", Schedule()))
        if st.pending:
            out.append(("process", Process(self._accepted(st.pending[0]))))
            loads = [(r, -(-(r.start - r.loaded) // B), (r.start - 1) // B)
                     for r in st.loading()]
            loads = [(r, lo, hi) for r, lo, hi in loads if lo <= hi]
            if loads:
                r, lo, hi = rng.choice(loads)
                out.append(("fail", FailLoad(r.rid, rng.randint(lo, hi))))
        live = st.live()
        if live:
            rid = rng.choice(live)
            out.append(("preempt", Preempt(rid)))
            out.append(("end", (Finish if rng.random() < 0.5 else Abort)(rid)))
            if rng.random() < 0.1:  # rarer than any other kind: it preempts every request
                out.append(("reset", ResetPrefixCache()))
        return out

    def step(self) -> Event | None:
        """Apply one random valid event and return it; None when no drawn
        event is valid (every request added has ended and nothing is in flight)."""
        cands = []
        for kind, ev in self.candidates():
            if (not self.valid(ev) and isinstance(ev, AddRequest) and ev.external_tokens):
                ev = AddRequest(ev.id, ev.prompt_len, ev.max_new_tokens, 0)
            if self.valid(ev):
                cands.append((kind, ev))
        if not cands:
            return None
        _, ev = self.rng.choices(cands, weights=[self.WEIGHTS[k] for k, _ in cands])[0]
        self.apply(ev)
        return ev

    def run(self, n: int) -> Trace:
        """``n`` random events (fewer if the stream ends); the trace so far."""
        for _ in range(n):
            if self.step() is None:
                break
        return self.trace()

    def trace(self) -> Trace:
        return Trace(self.cfg, list(self.events))

    # -------------------------------------------------------- the engine loop

    def tick(self, draw: bool = True) -> bool:
        """The engine's loop, one event: a Schedule while fewer than
        ``depth`` steps are in flight and the scheduler has requests, else a
        Process of the oldest step (each request's accepted drafts drawn;
        every draft accepted unless ``draw``). False: nothing scheduled and
        nothing in flight (the empty step is processed first)."""
        st = self.state
        if len(st.pending) < self.cfg.depth and st.has_requests():
            busy = st.busy()
            self.apply(Schedule())
            if st.pending[-1].reqs or (busy and len(st.pending) < self.cfg.depth):
                return True  # the engine schedules again while the queue has room
            if not busy:
                while st.pending:
                    self.apply(Process())
                return False
        if not st.pending:
            return False
        self.apply(Process(self._accepted(st.pending[0], every=True) if draw else {}))
        return True

    def settle(self, draw: bool = False) -> None:
        """Process every step in flight (every draft accepted, unless ``draw``)."""
        while self.state.pending:
            self.apply(Process(self._accepted(self.state.pending[0], every=True) if draw else {}))

    def end_all(self) -> None:
        """Abort every live request and process every step: each target's
        pool must be whole again."""
        for rid in self.state.live():
            if self.valid(Abort(rid)):
                self.apply(Abort(rid))
        self.settle()
