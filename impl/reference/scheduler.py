"""The async scheduler: steps in flight, chunked prefill, spec tokens, preemption.

Mirrors the parts of ``vllm/v1/core/sched/scheduler.py`` and
``async_scheduler.py`` that decide which blocks a request holds, speaking the
event language of ``docs/SEMANTICS.md``. Per request it keeps the three
counts the freeing rule can see::

    computed  c   vLLM's num_computed_tokens: advanced when a step is
                  scheduled, lowered by rejected drafts
    in_flight f   scheduled tokens of unprocessed steps that still count
                  (vLLM >= 0.26 num_in_flight_tokens)
    loading       tokens a connector is loading in an unprocessed step

and the freeing basis handed to each group's manager is
``model.policy.basis(config.policy, group, Counts(c, f, loading, spec))``.

A timeline at depth 2, sliding(W=16), B=16, budget 64, one 100-token prompt::

    Schedule   step 0 computes [0, 64)        c = 64,  f = 64
    Schedule   step 1 computes [64, 100)      frees first, on the basis:
                 optimistic: c = 64       -> skipped 49: slots 0..2 -> NULL
                                             (step 0 still reads them!)
                 settled:    c - f = 0    -> nothing freed
               then                        c = 100, f = 100
    Process    step 0 done                 f = 36
    Process    step 1 done                 f = 0, first token sampled

Steps run on the device in schedule order, so "processed" is a prefix of the
scheduled steps. A step's output for a request is *discarded* when the
request was preempted, finished or failed a load after the step was
scheduled; its tokens stop counting in ``f`` at that moment, and the
request is not scheduled again until those steps are processed (vLLM 0.33
holds a preempted request back while its stale output is in flight).

Request-level frees (finish, abort, preempt, failed load) under
``hazard = unordered`` (a KV-consumer connector may write a block as soon as
it is in the pool) are deferred until the request's last scheduled step is
processed: vLLM's deferred-free queue (``defer_block_free``), whose fence is
the coarser "latest step scheduled when the free happened".
"""

from __future__ import annotations

from collections import deque

from model.events import Config
from model.observations import FinishObs, Item, ProcessObs, ReqCounters, ReqStep, StepObs
from model.policy import Counts, basis
from model.windows import live_bound

from .block_pool import BlockPool
from .coordinator import Coordinator, Held


class Request:
    __slots__ = (
        "rid", "prompt_len", "max_new", "external", "status", "computed", "in_flight",
        "loading", "spec", "generated", "offered", "load_from", "entries", "stale",
        "last_step",
    )

    def __init__(self, rid: str, prompt_len: int, max_new: int, external: int) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.max_new = max_new
        self.external = external
        self.status = "waiting"  # waiting | running | preempted | finished
        self.computed = 0  # c
        self.in_flight = 0  # f
        self.loading = 0  # tokens being loaded in an unprocessed step
        self.spec = 0  # draft tokens among the in-flight tokens
        self.generated = 0  # output tokens known (processed)
        self.offered = False  # the connector offers external tokens once, at first admission
        self.load_from = 0  # the prefix-cache hit the load started from
        self.entries: deque[Entry] = deque()  # unprocessed, still counting
        self.stale = 0  # unprocessed entries whose output is discarded
        self.last_step = -1  # index of the last step that scheduled the request


class Entry:
    """One request's share of one step: positions ``[start, end)``, the last
    ``spec`` of them drafts, ``loaded`` positions before ``start`` loaded."""

    __slots__ = ("rid", "start", "end", "spec", "loaded", "tables", "shift", "discarded", "fail")

    def __init__(self, rid: str, start: int, end: int, spec: int, loaded: int,
                 tables: tuple[tuple[int, ...], ...]) -> None:
        self.rid = rid
        self.start = start
        self.end = end
        self.spec = spec
        self.loaded = loaded
        self.tables = tables
        self.shift = 0  # positions rolled back by rejections in earlier steps
        self.discarded = False
        self.fail: int | None = None  # first bad block of a failed load


class Step:
    __slots__ = ("idx", "entries")

    def __init__(self, idx: int, entries: list[Entry]) -> None:
        self.idx = idx
        self.entries = entries


class Scheduler:
    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.B = config.block_size
        self.groups = config.groups
        self.sink: list[Item] = []
        self.pool = BlockPool(config.num_blocks, config.prefix_caching)
        self.coord = Coordinator(config, self.pool, self.sink)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # admission order; the last one is preempted first
        self.waiting: list[Request] = []  # arrival order; preempted ones go to the front
        self.steps: deque[Step] = deque()  # unprocessed, oldest first
        self.num_scheduled = 0
        self.num_processed = 0
        self.deferred: list[tuple[int, str, list[Held], str]] = []  # (fence step, rid, blocks, why)
        self.just_finished: list[Request] = []  # for the counters snapshot
        self.defer_request_frees = config.hazard == "unordered"
        self.no_hits: list[list[int]] = [[] for _ in config.groups]
        # What the pool is sized for: the settled basis keeps at most
        # depth * budget tokens beyond the count it frees on.
        ahead = config.depth * config.max_num_batched_tokens
        self.bound = tuple(
            live_bound(g, self.B, config.max_model_len, ahead) for g in config.groups
        )

    # ================================================================ events

    def add_request(self, rid: str, prompt_len: int, max_new: int, external: int) -> None:
        r = Request(rid, prompt_len, max_new, external)
        self.requests[rid] = r
        self.waiting.append(r)

    def schedule(self) -> None:
        """One scheduler iteration: running requests first (decodes and
        prefill chunks), then, if nobody was preempted, waiting ones."""
        budget = self.cfg.max_num_batched_tokens
        entries: list[Entry] = []
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n, spec = self._num_new_tokens(r, budget)
            if n == 0:
                i += 1
                continue
            # Free what the window no longer needs before allocating, even if
            # the allocation then fails (vLLM's allocate_slots).
            self.coord.remove_skipped_blocks(r.rid, self._bases(r))
            end = r.computed + n
            fits = True
            while self.coord.get_num_blocks_to_allocate(r.rid, end) > self.pool.num_free:
                victim = running[-1]  # lowest priority: admitted last
                if self.defer_request_frees and self._in_flight(victim):
                    fits = False  # its blocks would only come back later
                    break
                running.pop()
                self._preempt(victim)
                preempted = True
                if victim is r:
                    fits = False
                    break
            if not fits:
                break
            self.coord.allocate_new_blocks(r.rid, end)
            entries.append(self._put_in_flight(r, n, spec, 0))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit_waiting(budget, entries)
        if entries:
            idx = self.num_scheduled
            self.num_scheduled += 1
            self.steps.append(Step(idx, entries))
            self.sink.append(StepObs(idx, tuple(
                ReqStep(e.rid, e.start, e.end, e.spec, e.loaded, e.tables) for e in entries
            )))

    def process(self, accepted: dict[str, int]) -> None:
        """The oldest step's output: drafts accepted or rejected, tokens sampled,
        requests at their last token finished, failed loads rolled back."""
        step = self.steps.popleft()
        self.num_processed += 1
        acc: list[tuple[str, int]] = []
        discarded: list[str] = []
        failed: list[tuple[str, int]] = []
        after: list[tuple[Request, int | None]] = []  # (request, first bad block | None=finish)
        for e in step.entries:
            r = self.requests[e.rid]
            if e.discarded:
                r.stale -= 1
                discarded.append(e.rid)
                continue
            r.entries.popleft()
            r.in_flight -= e.end - e.start
            r.spec -= e.spec
            r.loading -= e.loaded
            if e.fail is not None:
                discarded.append(e.rid)
                failed.append((e.rid, e.fail))
                after.append((r, e.fail))
                continue
            a = accepted.get(e.rid, e.spec)
            acc.append((e.rid, a))
            rejected = e.spec - a
            if rejected:
                # The rollback: later steps of the request compute at
                # positions shifted down by the rejected drafts.
                r.computed -= rejected
                for later in r.entries:
                    later.shift += rejected
            end = e.end - e.shift - rejected  # last position really computed + 1
            if end >= r.prompt_len:
                r.generated = max(r.generated, min(r.max_new, end + 1 - r.prompt_len))
                if r.generated >= r.max_new:
                    after.append((r, None))
        self.sink.append(ProcessObs(step.idx, tuple(acc), tuple(discarded), tuple(failed)))
        for r, bad in after:
            if bad is None:
                self._finish(r, "length")
            else:
                self._fail_load(r, bad)
        if self.deferred:
            self._drain_deferred()

    def preempt(self, rid: str) -> None:
        r = self.requests[rid]
        self.running.remove(r)
        self._preempt(r)

    def fail_load(self, rid: str, first_bad_block: int) -> None:
        e = self._loading_entry(self.requests[rid])
        assert e is not None
        e.fail = first_bad_block if e.fail is None else min(e.fail, first_bad_block)

    def finish(self, rid: str, reason: str) -> None:
        self._finish(self.requests[rid], reason)

    # ============================================================== counters

    def req_counters(self, r: Request) -> ReqCounters:
        live = self.coord.live.get(r.rid)
        return ReqCounters(
            r.computed, r.in_flight, tuple(live) if live else (0,) * len(self.groups), r.status
        )

    # ============================================================== helpers

    def _in_flight(self, r: Request) -> bool:
        """Whether a step that scheduled ``r`` is still on the device."""
        return r.last_step >= self.num_processed

    def _bases(self, r: Request) -> list[int]:
        counts = Counts(r.computed, r.in_flight, r.loading, r.spec)
        policy = self.cfg.policy
        return [basis(policy, g, counts) for g in self.groups]

    def _num_new_tokens(self, r: Request, budget: int) -> tuple[int, int]:
        """Tokens (and drafts among them) to schedule for a running request.

        Prefill (or recompute) chunk while the prompt, or the known tokens of
        a recomputing request, are not all computed::

            [ 0 ............ c ............ known )      n = min(known - c, budget)

        otherwise a decode: the last sampled token (or the placeholder of a
        token still in flight) plus ``spec_tokens`` drafts, never past
        ``prompt_len + max_new_tokens`` (nor ``max_model_len - 1``, vLLM's
        cap on the bonus position), and not at all once the steps in flight
        produce the last token even if all their drafts are rejected."""
        if r.stale:
            return 0, 0
        p, c = r.prompt_len, r.computed
        known = p + r.generated
        if c < p or c < known - 1:
            return min(known - c, budget), 0
        if c - r.spec + 1 - p >= r.max_new:
            return 0, 0
        limit = min(p + r.max_new, self.cfg.max_model_len - 1)
        n = min(1 + self.cfg.spec_tokens, budget, limit - c)
        if n <= 0:
            return 0, 0
        return n, n - 1

    def _put_in_flight(self, r: Request, n: int, spec: int, loaded: int) -> Entry:
        e = Entry(r.rid, r.computed, r.computed + n, spec, loaded, self.coord.tables(r.rid))
        r.computed += n
        r.in_flight += n
        r.spec += spec
        r.loading += loaded
        r.entries.append(e)
        r.last_step = self.num_scheduled
        if self.cfg.prefix_caching:
            # Cache full prompt blocks of the scheduled positions (vLLM caches
            # at schedule time), but not loaded blocks before their load is
            # known to have succeeded.
            upto = min(r.computed, r.prompt_len)
            if r.loading:
                upto = min(upto, r.load_from)
            self.coord.cache_blocks(r.rid, upto)
        return e

    def _admit_waiting(self, budget: int, entries: list[Entry]) -> int:
        """Admit waiting requests in order while budget and ``max_num_seqs``
        allow; the first whose blocks do not fit stops admission (no
        preemption for a waiting request, as in vLLM)."""
        cfg, B = self.cfg, self.B
        waiting, running = self.waiting, self.running
        i = 0
        while i < len(waiting) and budget > 0 and len(running) < cfg.max_num_seqs:
            r = waiting[i]
            if r.stale:  # its discarded steps are still on the device
                i += 1
                continue
            known = r.prompt_len + r.generated
            if cfg.prefix_caching:
                # Recompute at least the last known token; hashes cover
                # full prompt blocks only.
                max_len = min((known - 1) // B, r.prompt_len // B) * B
                hits, hit = self.coord.find_longest_cache_hit(max_len)
            else:
                hits, hit = self.no_hits, 0
            ext = 0 if r.offered else r.external
            computed, loaded = (ext, ext - hit) if ext > hit else (hit, 0)
            n = min(known - computed, budget)
            if self.coord.admission_cost(hits, computed, computed + n) > self.pool.num_free:
                break
            self.coord.admit(r.rid, hits, computed, computed + n)
            del waiting[i]
            running.append(r)
            r.status = "running"
            r.offered = True
            r.computed = computed
            r.load_from = hit
            entries.append(self._put_in_flight(r, n, 0, loaded))
            budget -= n
        return budget

    def _loading_entry(self, r: Request) -> Entry | None:
        for e in r.entries:
            if e.loaded:
                return e
        return None

    def _discard(self, r: Request) -> None:
        """The outputs of the request's unprocessed steps no longer count."""
        for e in r.entries:
            e.discarded = True
        r.stale += len(r.entries)
        r.entries.clear()
        r.in_flight = r.spec = r.loading = 0

    def _let_go(self, r: Request, groups: list[list[Held]], reason: str) -> None:
        """A request-level free: now, or once the request's steps are processed."""
        if self.defer_request_frees and self._in_flight(r):
            held = [h for g in groups for h in g]
            if held:
                self.deferred.append((r.last_step, r.rid, held, reason))
            return
        for held in groups:  # per group, tail first (evicted first)
            self.coord.release(r.rid, held[::-1], reason)

    def _drain_deferred(self) -> None:
        done = self.num_processed - 1
        keep = []
        for item in self.deferred:
            fence, rid, held, reason = item
            if fence <= done:
                self.coord.release(rid, held[::-1], reason)
            else:
                keep.append(item)
        self.deferred = keep

    def _preempt(self, r: Request) -> None:
        """``r`` is already out of ``running``."""
        self._let_go(r, self.coord.pop_for_free(r.rid), "preempt")
        self._discard(r)
        r.computed = 0
        r.status = "preempted"
        self.waiting.insert(0, r)

    def _finish(self, r: Request, reason: str) -> None:
        if r.status == "running":
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.status = "finished"
        self.just_finished.append(r)
        self.sink.append(FinishObs(r.rid, reason))
        self._let_go(r, self.coord.pop_for_free(r.rid), "finish" if reason == "length" else reason)
        self._discard(r)

    def _fail_load(self, r: Request, first_bad: int) -> None:
        """Recompute from the first bad block, or from further back where the
        window of that position reaches slots the request does not hold
        (NULL-padded at admission, or freed): SEMANTICS' "c = k*B at most"."""
        self._discard(r)
        B = self.B
        j = first_bad
        while j > 0 and not self.coord.window_present(r.rid, j * B):
            j -= 1
        self._let_go(r, self.coord.truncate(r.rid, j), "failed_load")
        r.computed = min(r.computed, j * B)
