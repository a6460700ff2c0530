"""``ReferenceTarget``: the reference manager behind the Target protocol.

Checks each event's preconditions (``docs/SEMANTICS.md``), runs it on the
scheduler, and hands back what happened (the items the scheduler, the
coordinator and the managers appended, in order) plus a counters snapshot.
"""

from __future__ import annotations

from impl.target import Capabilities, Unsupported
from model.events import (
    NO_PREEMPT_CALL,
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
    TraceError,
)
from model.observations import Counters, Observed, ReqCounters

from .scheduler import Scheduler


class ReferenceTarget:
    name = "reference"
    # Every registered policy, by name, is the freeing basis of every group.
    # hazard=unordered defers request-level frees, while the request has a step
    # in flight, until every step scheduled by then is processed. At depth 1 a
    # Finish or Abort arriving while the step runs is held until its output is
    # processed. Preemption only as vLLM's engine preempts (model.events'
    # ResetPrefixCache, pool pressure inside schedule()). A failed load
    # recomputes from the first bad block into the blocks held, or from
    # further back where that position's window reaches NULL slots.
    capabilities = Capabilities()

    def __init__(self) -> None:
        self._s: Scheduler | None = None

    # -------------------------------------------------------------- protocol

    def reset(self, config: Config) -> Observed:
        try:
            config.validate()
        except TraceError as e:
            raise Unsupported(str(e)) from None
        if config.drafter != "ngram":
            raise Unsupported(f"{self.name}: drafts come from prompt lookup here; drafter "
                              f"{config.drafter} (hit drop, prefill lookahead) runs on vllm@")
        self._s = Scheduler(config)
        return Observed([], self._counters())

    def can_apply(self, event: Event) -> bool:
        return self._why_not(event) is None

    def apply(self, event: Event) -> Observed:
        why = self._why_not(event)
        if why is not None:
            raise ValueError(f"{type(event).__name__}: {why}")
        s = self._s
        assert s is not None
        if isinstance(event, Schedule):
            s.schedule()
        elif isinstance(event, Process):
            s.process(event.accepted)
        elif isinstance(event, AddRequest):
            s.add_request(event.id, event.prompt_len, event.max_new_tokens, event.external_tokens,
                          event.variant)
        elif isinstance(event, ResetPrefixCache):
            s.reset_prefix_cache()
        elif isinstance(event, FailLoad):
            s.fail_load(event.id, event.first_bad_block)
        else:
            why = "finish" if isinstance(event, Finish) else "abort"
            if not s.hold(why, event.id):
                s.finish(event.id, why)
        items = list(s.sink)
        s.sink.clear()
        counters = self._counters(event)
        s.retire()
        return Observed(items, counters)

    # --------------------------------------------------------- preconditions

    def _why_not(self, ev: Event) -> str | None:
        s = self._s
        if s is None:
            return "reset(config) first"
        cfg = s.cfg
        if isinstance(ev, (Schedule, ResetPrefixCache)):
            if len(s.steps) >= cfg.depth:
                return f"{len(s.steps)} steps in flight already (depth {cfg.depth})"
            if isinstance(ev, Schedule) and not s.has_requests():
                return "no request to schedule (the engine does not call schedule())"
            return None
        if isinstance(ev, Process):
            if not s.steps:
                return "no step in flight"
            drafts = {e.rid: e.spec for e in s.steps[0].entries}
            for rid, a in ev.accepted.items():
                k = drafts.get(rid, 0)
                if not isinstance(a, int) or a < 0 or a > k:
                    return f"accepted[{rid!r}] = {a!r}, but step {s.steps[0].idx} has {k} drafts"
            return None
        if isinstance(ev, AddRequest):
            if not isinstance(ev.id, str) or not ev.id:
                return "the id must be a non-empty string"
            if ev.id in s.requests or ev.id in s.ended:
                return f"request {ev.id!r} exists already"
            if ev.prompt_len < 1 or ev.max_new_tokens < 1:
                return "prompt_len and max_new_tokens must be >= 1"
            if not 0 <= ev.external_tokens < ev.prompt_len:
                return "external_tokens must be in [0, prompt_len)"
            if ev.prompt_len + ev.max_new_tokens > cfg.max_model_len:
                return f"prompt_len + max_new_tokens exceeds max_model_len {cfg.max_model_len}"
            return None
        rid = getattr(ev, "id", None)
        r = s.requests.get(rid)
        if r is None:
            if isinstance(rid, str) and rid in s.ended:
                return f"request {rid!r} has finished"
            return f"no request {rid!r}"
        if r.status == "finished":
            return f"request {r.rid!r} has finished"
        if isinstance(ev, (Finish, Abort)):
            return None
        if isinstance(ev, Preempt):
            return NO_PREEMPT_CALL
        if isinstance(ev, FailLoad):
            if cfg.mixed_block_sizes:
                return ("a failed load names a block of one size; not modeled for groups of "
                        "different block sizes")
            e = s._loading_entry(r)
            if e is None:
                return f"request {r.rid!r} has no load in flight"
            lo, hi = e.start - e.loaded, e.start
            if not lo <= ev.first_bad_block * cfg.block_size < hi:
                return (f"block {ev.first_bad_block} starts at position "
                        f"{ev.first_bad_block * cfg.block_size}, outside the loaded [{lo}, {hi})")
            return None
        return f"unknown event {ev!r}"

    # --------------------------------------------------------------- counters

    def _counters(self, event: Event | None = None) -> Counters:
        """Counters of the requests this event may have changed
        (``docs/SEMANTICS.md``): the running ones (any event that runs the
        scheduler, processes an output or ends a request may change them; an
        AddRequest or a FailLoad, which only marks a load, does not), those
        that entered the waiting queue (added, preempted), and those that
        finished (listed once, then forgotten). A waiting request changes only
        when admitted, and then it runs."""
        s = self._s
        assert s is not None
        out: dict[str, ReqCounters] = {}
        groups = (s.just_waiting, s.just_finished) if isinstance(event, (AddRequest, FailLoad)) \
            else (s.running, s.just_waiting, s.just_finished)
        for group in groups:
            for r in group:
                out[r.rid] = s.req_counters(r)
        s.just_waiting.clear()
        s.just_finished.clear()
        return Counters(s.pool.num_free, s.cfg.num_blocks, out, s.bound)
