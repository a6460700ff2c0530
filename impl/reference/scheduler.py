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
scheduled steps. A step's share stops counting in ``f`` when its request is
preempted, ends or fails a load after the step was scheduled. The output of
an ended or failed request is dropped; a preempted request's output still
arrives and its tokens count (vLLM 0.33 delivers such "stale" output without
touching the counts), and the request is not scheduled again until those
steps are processed (vLLM 0.33 holds it back meanwhile).

What a step schedules for a running request is what vLLM's scheduler
computes: the known tokens plus its drafts plus the outputs still in flight,
minus the computed ones (see ``_num_new_tokens``). A waiting request is
admitted only if its whole known sequence fits (each window kind capped as
vLLM caps it), and a new one-token decode is padded to ``1 + spec_tokens``
when no prefill shares the step (vLLM 0.33's uniform decode batch).

Preemption happens where vLLM's engine preempts: inside ``schedule()`` under
pool pressure, and at ``reset_prefix_cache`` (every running request, taken
between two steps of the loop). At depth 1 a Finish or Abort arriving while
the step runs is held until its output (see ``hold``). A step that schedules
nothing is queued like any other (the engine queues its empty batch).

Request-level frees (finish, abort, preempt, failed load) under
``hazard = unordered`` (a KV-consumer connector may write a block as soon as
it is in the pool) are deferred, while a step that scheduled the request is
in flight, until every step scheduled by then is processed: vLLM's
deferred-free queue (``defer_block_free``) and its fence. With a connector, a
request that ends first frees its out-of-window blocks on the policy's basis
(vLLM's finish path hands the connector the trimmed table).
"""

from __future__ import annotations

from collections import deque

from model.events import Config
from model.observations import NULL, FinishObs, Item, ProcessObs, ReqCounters, ReqStep, StepObs
from model.policy import Counts, basis
from model.windows import cached_reads, live_bound

from .block_pool import BlockPool
from .coordinator import Coordinator, Held


class Request:
    __slots__ = (
        "rid", "prompt_len", "variant", "max_new", "external", "status", "computed", "in_flight",
        "loading", "spec", "generated", "offered", "entries", "stale",
        "last_step", "prefill_chunk", "drafts", "next_decode",
    )

    def __init__(self, rid: str, prompt_len: int, max_new: int, external: int,
                 variant: int = 0) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.variant = variant
        self.max_new = max_new
        self.external = external
        self.status = "waiting"  # waiting | running | preempted | finished
        self.computed = 0  # c
        self.in_flight = 0  # f
        self.loading = 0  # tokens being loaded in an unprocessed step
        self.spec = 0  # draft tokens among the in-flight tokens
        self.generated = 0  # output tokens known (processed)
        self.offered = False  # the connector offers external tokens once, at first admission
        self.entries: deque[Entry] = deque()  # unprocessed, still counting
        self.stale = 0  # unprocessed entries whose output is discarded
        self.last_step = -1  # index of the last step that scheduled the request
        self.prefill_chunk = False  # its last step stopped short of the known tokens
        self.drafts = 0  # drafts proposed for its next step (vLLM's spec_token_ids)
        self.next_decode = 0  # the first scheduler iteration it may be scheduled in again

    def placeholders(self) -> int:
        """Tokens its unprocessed sampling steps will output at most (vLLM's
        ``num_output_placeholders``): one sampled token plus the drafts each."""
        return sum(1 + e.spec for e in self.entries if e.samples)


class Entry:
    """One request's share of one step: positions ``[start, end)``, the last
    ``spec`` of them drafts, ``loaded`` positions before ``start`` loaded."""

    __slots__ = ("rid", "start", "end", "spec", "loaded", "tables", "shift", "discarded", "fail",
                 "samples", "spoiled")

    def __init__(self, rid: str, start: int, end: int, spec: int, loaded: int,
                 tables: tuple[tuple[int, ...], ...]) -> None:
        self.rid = rid
        self.start = start
        self.end = end
        self.spec = spec
        self.loaded = loaded
        self.tables = tables
        self.shift = 0  # positions rolled back by rejections in earlier steps
        self.discarded: str | None = None  # "dropped", "stale" (preempted), "reset"
        self.fail: int | None = None  # first bad block of a failed load
        self.samples = False  # reaches the known tokens: its output is a sampled token
        self.spoiled = False  # read blocks a failed load left without KV: output dropped


class Step:
    __slots__ = ("idx", "entries")

    def __init__(self, idx: int, entries: list[Entry]) -> None:
        self.idx = idx
        self.entries = entries


class Scheduler:
    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.B = config.block_size  # the unit of FailLoad's first_bad_block
        self.S = config.hit_alignment  # prefix hits end on its multiples
        self.groups = config.groups
        self.sink: list[Item] = []
        reserved = [b for g in config.groups for b in g.spec.reserved_blocks(config.block_size)]
        self.pool = BlockPool(config.num_blocks, config.prefix_caching, reserved)
        self.coord = Coordinator(config, self.pool, self.sink)
        # the requests not yet retired (see ``retire``); ``ended``: ids of retired ones
        self.requests: dict[str, Request] = {}
        self.ended: set[str] = set()
        self.finishing: list[Request] = []  # finished, still referenced by a step or hold
        self.running: list[Request] = []  # admission order; the last one is preempted first
        self.waiting: list[Request] = []  # arrival order; preempted ones go to the front
        self.steps: deque[Step] = deque()  # unprocessed, oldest first
        self.num_scheduled = 0
        self.last_busy = -1  # the latest step that scheduled anything
        self.ended_since_step = False  # a request ended since the last schedule()
        self.num_processed = 0
        self.iteration = 0  # schedule() calls, those that scheduled nothing included
        self.deferred: list[tuple[int, str, list[Held], str]] = []  # (fence step, rid, blocks, why)
        self.just_finished: list[Request] = []  # for the counters snapshot
        self.just_waiting: list[Request] = []  # entered the waiting queue (added, preempted)
        # (finish | abort | preempt, rid) held for the next Process (see ``hold``)
        self.held: list[tuple[str, str]] = []
        self.defer_request_frees = config.hazard == "unordered"
        self.no_hits: list[list[int]] = [[] for _ in config.groups]
        # What the pool is sized for: the settled basis keeps at most
        # depth * budget tokens beyond the count it frees on.
        ahead = config.depth * config.max_num_batched_tokens
        # Mamba also holds one speculative slot per spec token.
        self.bound = tuple(
            live_bound(g, B, config.max_model_len, ahead)
            + g.spec.speculative_blocks(config.spec_tokens)
            for g, B in zip(config.groups, config.block_sizes, strict=True)
        )

    # ================================================================ events

    def add_request(self, rid: str, prompt_len: int, max_new: int, external: int,
                    variant: int = 0) -> None:
        r = Request(rid, prompt_len, max_new, external, variant)
        self.coord.prompt_len[rid] = prompt_len
        self.requests[rid] = r
        self.waiting.append(r)
        self.just_waiting.append(r)

    def schedule(self) -> None:
        """One scheduler iteration: running requests first (decodes and
        prefill chunks), then, if nobody was preempted, waiting ones."""
        budget = self.cfg.max_num_batched_tokens
        entries: list[Entry] = []
        preempted = False
        self.iteration += 1
        self.ended_since_step = False
        self.coord.new_step_starts()
        prefill = False  # a running request's prefill chunk is in this step
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
            prefill |= r.prefill_chunk  # as its previous step left it
            entries.append(self._put_in_flight(r, n, spec, 0))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit_waiting(budget, entries, prefill)
        # a step that schedules nothing is queued too (the engine queues its
        # empty batch and takes its empty output in turn); it fences nothing
        idx = self.num_scheduled
        self.num_scheduled += 1
        self.steps.append(Step(idx, entries))
        if entries:
            self.last_busy = idx
        copies = self.coord.take_copies()
        self.sink.append(StepObs(idx, tuple(
            ReqStep(e.rid, e.start, e.end, e.spec, e.loaded, e.tables) for e in entries
        ), tuple((src, dst) for *_, src, dst in copies)))
        # a copy holds both its blocks until the step that runs it is processed
        for g, rid, slot, src, dst in copies:
            self.deferred.append((idx, rid, [(g, slot, dst), (g, slot, src)], "copy"))

    def process(self, accepted: dict[str, int]) -> None:
        """The oldest step's output: drafts accepted or rejected, tokens sampled,
        requests at their last token finished, failed loads rolled back."""
        held, self.held = self.held, []
        # Depth 1: requests ended while this step ran (their output is dropped).
        ending: dict[str, str] = {}
        for why, rid in held:
            if why != "preempt":
                ending.setdefault(rid, why)  # the first end counts
        step = self.steps.popleft()
        self.num_processed += 1
        acc: list[tuple[str, int]] = []
        discarded: list[str] = []
        failed: list[tuple[str, int]] = []
        after: list[tuple[Request, int | None]] = []  # (request, first bad block | None=finish)
        # A load that failed spoils its blocks also where the request that
        # loaded them ended or was preempted while the step ran (a prefix hit
        # may share them); only a request still running recovers.
        fails = {e.rid: e.fail for e in step.entries if e.fail is not None}
        if fails:
            gone = {e.rid for e in step.entries if e.discarded} | set(ending)
            fails, spoiled = self._spread_failures(fails, ending)
            fails = {rid: k for rid, k in fails.items() if rid not in gone}
            for st in (step, *self.steps):  # what already read them is garbage
                for e in st.entries:
                    e.spoiled = e.spoiled or self._read_any(e, spoiled)
        for e in step.entries:
            r = self.requests[e.rid]
            if e.discarded == "reset":
                discarded.append(e.rid)
                continue
            if e.discarded:
                r.stale -= 1
                if (e.discarded == "stale" and e.samples and r.status != "finished"
                        and not e.spoiled):
                    # A preempted request's output still arrives (vLLM 0.33
                    # delivers it): its tokens count, its rejections do not.
                    a = accepted.get(e.rid, e.spec)
                    acc.append((e.rid, a))
                    r.generated = min(r.max_new, r.generated + 1 + a)
                    if r.generated >= r.max_new:
                        after.append((r, None))
                else:
                    discarded.append(e.rid)
                continue
            r.entries.popleft()
            r.in_flight -= e.end - e.start
            r.spec -= e.spec
            r.loading -= e.loaded
            if e.rid in ending:
                discarded.append(e.rid)
                continue
            bad = fails.pop(e.rid, None) if fails else None
            if bad is not None:
                discarded.append(e.rid)
                failed.append((e.rid, bad))
                after.append((r, bad))
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
                out = end + 1 - r.prompt_len  # output tokens known after this step
                if out > r.max_new:
                    # A length stop inside accepted drafts: the tokens past
                    # it are dropped and no longer count as computed.
                    r.computed -= out - r.max_new
                r.generated = max(r.generated, min(r.max_new, out))
                if r.generated >= r.max_new:
                    after.append((r, None))
            if e.samples and self.cfg.prefix_caching and (
                    self.cfg.depth > 1 or self.cfg.spec_tokens):
                # vLLM also caches on the settled count once an output
                # with placeholders or drafts arrives.
                self._cache(r, r.computed - r.in_flight)
        for rid, bad in fails.items():  # holders of the bad blocks outside this step
            failed.append((rid, bad))
            after.append((self.requests[rid], bad))
        self.sink.append(ProcessObs(step.idx, tuple(acc), tuple(discarded), tuple(failed)))
        for rid, why in ending.items():
            if self.requests[rid].status != "finished":
                self._finish(self.requests[rid], why, window=False)
        for r, bad in after:
            if bad is None:
                self._finish(r, "length")
            elif self.cfg.kv_load_failure_policy == "fail":
                # vLLM's default: the request ends with an error (FINISHED_ERROR)
                # and its bad blocks leave the prefix cache
                self.coord.uncache_from(r.rid, bad)
                self._finish(r, "error", window=False)
            else:
                self._fail_load(r, bad)
        for why, rid in held:
            r = self.requests[rid]
            if why == "preempt" and r.status == "running":
                self.preempt(rid)
        if self.cfg.depth == 1 and self.cfg.spec_tokens:
            # Synchronous scheduling: the drafter proposes on the step's
            # output (a discarded one included) for the requests still running
            # that finished a prefill.
            for e in step.entries:
                r = self.requests[e.rid]
                if r.status == "running":
                    r.drafts = 0 if r.prefill_chunk else self.cfg.spec_tokens
        if self.deferred:
            self._drain_deferred()

    def hold(self, why: str, rid: str) -> bool:
        """vLLM's engine preempts only inside ``schedule()`` (or a utility call
        between engine steps), which it calls only while its batch queue has
        room: with ``depth`` steps in flight it first waits for the oldest
        output. A preemption that arrives then happens after that output.
        Synchronous scheduling (depth 1) also never ends a request while its
        one step runs: an abort or a stop that arrives meanwhile is applied
        after the step ran, right before its output is processed (the
        engine's aborts queue), and the output is dropped. Returns whether
        the event was held for the next Process.

        A held end skips a connector's out-of-window free on the finish path:
        on the settled count it frees nothing there (the count is the one the
        step was scheduled on, and that schedule freed already), and on any
        other count it would free, labelled ``window``, blocks that go back
        at the same moment anyway; so every policy behaves the same at depth 1
        (vLLM 0.25.1 does label them ``window``)."""
        if self.cfg.depth == 1 and self.steps:
            self.held.append((why, rid))
            return True
        return False

    def has_requests(self) -> bool:
        """vLLM's ``Scheduler.has_requests()``: a live request, or one ended
        since the last step (the next step tells the workers); its engine
        calls ``schedule()`` only then."""
        return self.ended_since_step or any(r.status != "finished"
                                            for r in self.requests.values())

    def reset_prefix_cache(self) -> None:
        """vLLM's ``reset_prefix_cache(reset_running_requests=True)``: every
        running request preempted, the last admitted first, its in-flight
        output dropped (it may resume at once); then the prefix cache emptied
        if no block is in use (else vLLM raises, and the engine's loop goes
        on). vLLM also keeps counting the dropped steps in flight until they
        are processed, so it frees a resumed request's window later: safe."""
        while self.running:
            self._preempt(self.running.pop(), drop=True)
        self.pool.reset_prefix_cache()

    def fail_load(self, rid: str, first_bad_block: int) -> None:
        e = self._loading_entry(self.requests[rid])
        assert e is not None
        e.fail = first_bad_block if e.fail is None else min(e.fail, first_bad_block)

    def finish(self, rid: str, reason: str) -> None:
        self._finish(self.requests[rid], reason)

    def retire(self) -> None:
        """Forget the finished requests nothing refers to any more (no step in
        flight scheduled them, no held event names them): a long run keeps
        only its live requests (and the ids of ended ones, to refuse reuse)."""
        if not self.finishing:
            return
        held = {rid for _, rid in self.held}
        keep = []
        for r in self.finishing:
            if self._in_flight(r) or r.rid in held:
                keep.append(r)
                continue
            rid = r.rid
            del self.requests[rid]
            self.coord.forget(rid)
            self.ended.add(rid)
        self.finishing = keep

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
        """Tokens (and drafts among them) to schedule for a running request:
        what it takes to catch up with its known tokens, its drafts and the
        outputs still in flight (vLLM's ``num_tokens_with_spec +
        num_output_placeholders - num_computed_tokens``)::

            prefill / recompute   [ 0 ...... c ........ known )       n = known - c
            decode                [ ... known-1+ph = c | drafts )    n = 1 + drafts

        capped by the budget and by ``max_model_len - 1`` (vLLM's cap on the
        bonus position) only: near the end of a request the drafts may reach
        past ``prompt_len + max_new_tokens``, as in vLLM (the tokens past the
        end are dropped when the output arrives). The drafts are the
        positions past the known tokens and the outputs in flight. A request
        is skipped when the steps in flight produce its last token even if
        all their drafts are rejected (vLLM's ``num_computed_tokens + 2 -
        num_output_placeholders`` test)."""
        if r.stale or self.iteration < r.next_decode:
            return 0, 0
        p, c = r.prompt_len, r.computed
        ph = r.placeholders()
        if ph and c + 2 - ph >= p + r.max_new:
            return 0, 0
        known = p + r.generated
        n = min(known + r.drafts + ph - c, budget, self.cfg.max_model_len - 1 - c)
        if n <= 0:
            return 0, 0
        n = self._stop_at_tail(r, c, n)
        return n, max(0, min(r.drafts, c + n - known - ph))

    def _stop_at_tail(self, r: Request, c: int, n: int) -> int:
        """With hits inside a block and a Mamba group, a prefill chunk stops at
        the prompt's last hash boundary, so that the state there exists to be
        kept (vLLM's ``tail_boundary`` stop in align mode)."""
        u = self.coord.unit
        if not u or not any(g.spec.holds_state for g in self.groups):
            return n
        T = (r.prompt_len - 1) // u * u
        return T - c if c < T < c + n and T % self.cfg.block_size else n

    def _put_in_flight(self, r: Request, n: int, spec: int, loaded: int) -> Entry:
        e = Entry(r.rid, r.computed, r.computed + n, spec, loaded, self.coord.tables(r.rid))
        e.samples = r.computed + n >= r.prompt_len + r.generated + r.placeholders()
        r.prefill_chunk = not e.samples
        # The drafts are used up. Under async scheduling the next decode gets
        # placeholders for the drafts this step's output will propose; a
        # synchronous one gets them when the output is processed.
        r.drafts = self.cfg.spec_tokens if e.samples and self.cfg.depth > 1 else 0
        if e.samples:
            # Pipeline parallelism (depth d > 2): a request decodes at most
            # every d - 1 iterations, as vLLM's async scheduler staggers them
            # to the pipeline's sampled-token ring.
            r.next_decode = self.iteration + max(1, self.cfg.depth - 1)
        r.computed += n
        r.in_flight += n
        r.spec += spec
        r.loading += loaded
        r.entries.append(e)
        r.last_step = self.num_scheduled
        if self.cfg.prefix_caching:
            # Cache the full blocks of the scheduled positions whose tokens are
            # known (not drafts, not the token still to be sampled), loaded
            # ones included: vLLM caches at schedule time.
            self._cache(r, r.computed)
        return e

    def _cache(self, r: Request, upto: int) -> None:
        known = r.prompt_len + r.generated
        self.coord.cache_blocks(r.rid, min(upto, known), self.coord.hashes(r.prompt_len, r.variant))

    def _admit_waiting(self, budget: int, entries: list[Entry], prefill: bool) -> int:
        """Admit waiting requests in order while budget and ``max_num_seqs``
        allow; the first whose blocks do not fit stops admission (no
        preemption for a waiting request, as in vLLM).

        A request admitted with one token left to compute (a prefix hit or a
        load covering all but the last token) is padded to a full decode of
        ``1 + spec_tokens`` positions when no prefill chunk is in the step,
        as vLLM 0.33 pads new decodes for a uniform decode batch."""
        cfg, S, K = self.cfg, self.S, self.cfg.spec_tokens
        waiting, running = self.waiting, self.running
        decodes = bool(entries)  # running requests scheduled in this step
        i = 0
        while i < len(waiting) and budget > 0 and len(running) < cfg.max_num_seqs:
            r = waiting[i]
            if r.stale:  # its discarded steps are still on the device
                i += 1
                continue
            known = r.prompt_len + r.generated
            if cfg.prefix_caching:
                # Recompute at least the last known token.
                max_len = (known - 1) // S * S
                hits, hit = self.coord.find_longest_cache_hit(
                    max_len, self.coord.hashes(r.prompt_len, r.variant))
            else:
                hits, hit = self.no_hits, 0
            ext = 0 if r.offered else r.external
            if ext > hit and hit % cfg.scheduler_block_size:
                # a load covers the hit's last block: the hit stops before it
                hit -= hit % cfg.scheduler_block_size
                hits = [h[:hit // B] for h, B in zip(hits, cfg.block_sizes, strict=True)]
            computed, loaded = (ext, ext - hit) if ext > hit else (hit, 0)
            n, spec = known - computed, 0
            if (K and n == 1 and not prefill and (decodes or computed)
                    and computed + K + 2 <= cfg.max_model_len):
                if budget < 1 + K:
                    break
                n, spec = 1 + K, K
            n = self._stop_at_tail(r, computed, min(n, budget))
            # The whole known sequence must fit (within each kind's cap), not
            # only this chunk: vLLM's full_sequence_must_fit admission gate.
            full = min(known, cfg.max_model_len)
            free = self.pool.num_free
            if (self.coord.admission_cost(hits, computed, full, capped=True) > free
                    or self.coord.admission_cost(hits, computed, computed + n) > free):
                break
            self.coord.admit(r.rid, hits, computed, computed + n)
            del waiting[i]
            running.append(r)
            r.status = "running"
            r.offered = True
            r.computed = computed
            entries.append(self._put_in_flight(r, n, spec, loaded))
            budget -= n
        return budget

    def _loading_entry(self, r: Request) -> Entry | None:
        for e in r.entries:
            if e.loaded:
                return e
        return None

    def _discard(self, r: Request, why: str = "dropped") -> None:
        """The request's unprocessed steps no longer count in its counts; their
        outputs are dropped, or, after a preemption, delivered as ``stale``."""
        for e in r.entries:
            e.discarded = why
        if why != "reset":  # a reset's are dropped, and do not hold its resumption
            r.stale += len(r.entries)
        r.entries.clear()
        r.in_flight = r.spec = r.loading = 0

    def _let_go(self, r: Request, groups: list[list[Held]], reason: str) -> None:
        """A request-level free: now, or, while a step that scheduled the
        request is in flight, once every step scheduled so far is processed
        (vLLM's deferred-free fence: the latest scheduled step).

        The slots a failed load drops (vLLM drops none) wait for the
        request's own last step only: the request stays running and is not
        scheduled again before that step is processed, so they are back
        before it takes new blocks at the same slots."""
        if self.defer_request_frees and self._in_flight(r):
            held = [h for g in groups for h in g]
            if held:
                fence = r.last_step if reason == "failed_load" else self.last_busy
                self.deferred.append((fence, r.rid, held, reason))
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

    def _preempt(self, r: Request, drop: bool = False) -> None:
        """``r`` is already out of ``running``. ``drop``: its in-flight output
        is dropped (vLLM's ``drop_stale_output``), else delivered as stale."""
        self._let_go(r, self.coord.pop_for_free(r.rid), "preempt")
        self._discard(r, "reset" if drop else "stale")
        r.computed = 0
        r.drafts = 0
        r.status = "preempted"
        self.waiting.insert(0, r)
        self.just_waiting.append(r)

    def _finish(self, r: Request, reason: str, window: bool = True) -> None:
        if r.status == "running":
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.status = "finished"
        self.ended_since_step = True
        self.just_finished.append(r)
        self.finishing.append(r)
        self.sink.append(FinishObs(r.rid, reason))
        if self.defer_request_frees and window:
            # With a KV connector, vLLM first frees the out-of-window blocks
            # (on the policy's basis) before handing the table to the
            # connector's request_finished hook: window frees, at once.
            self.coord.remove_skipped_blocks(r.rid, self._bases(r))
        self._let_go(r, self.coord.pop_for_free(r.rid),
                     {"length": "finish", "error": "failed_load"}.get(reason, reason))
        self._discard(r)

    def _read_any(self, e: Entry, blocks: set[int]) -> bool:
        """Whether a step entry read one of ``blocks`` from the cache (the window
        of its first position, below it)."""
        a = e.start - e.shift
        P = self.requests[e.rid].prompt_len
        for g, table, B in zip(self.groups, e.tables, self.cfg.block_sizes, strict=False):
            for x, y in cached_reads(g, a, P):
                if any(b in blocks for b in table[x // B:-(-y // B)]):
                    return True
        return False

    def _spread_failures(self, fails: dict[str, int],
                         ending: dict[str, str]) -> tuple[dict[str, int], set[int]]:
        """A failed load spoils the loading request's blocks from the first
        bad one on (the ones computed after it read them); a prefix-cache hit
        may share them. Every running request holding one recomputes from its
        first such slot, as vLLM reschedules every request holding an
        invalid block. Also returns the spoiled blocks: a preempted request's
        output that read one is dropped, not delivered."""
        bad = {b for rid, k in fails.items()
               for table in self.coord.tables(rid) for b in table[k:] if b != NULL}
        out = dict(fails)
        for r in self.running:
            if r.rid in ending:
                continue
            slots = [i for table in self.coord.tables(r.rid)
                     for i, b in enumerate(table) if b in bad]
            if slots:  # its own failure too may lie past a shared bad block
                out[r.rid] = min(out.get(r.rid, min(slots)), min(slots))
        return out, bad

    def _fail_load(self, r: Request, first_bad: int) -> None:
        """Recompute from the first bad block, into the blocks the request
        holds (as vLLM does). Where the window of that position reaches slots
        the request does not hold (NULL-padded at admission, or freed), go
        back to the nearest position whose window it holds, and drop the slots
        from the first NULL slot on (reason ``failed_load``): SEMANTICS' "c =
        k*B at most" (vLLM recomputes from the bad block and reads NULL
        there). The bad blocks leave the prefix cache."""
        self._discard(r)
        B = self.B
        j = first_bad
        while j > 0 and not self.coord.window_present(r.rid, j * B):
            j -= 1
        self.coord.uncache_from(r.rid, first_bad)
        # The recompute writes its slots from j on: from the first of them
        # that is NULL (padded or freed), they are dropped and allocated anew.
        keep = self.coord.first_null_from(r.rid, j)
        if keep is not None:
            self._let_go(r, self.coord.truncate(r.rid, keep), "failed_load")
        r.computed = min(r.computed, j * B)
