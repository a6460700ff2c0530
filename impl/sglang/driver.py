"""SGLang 0.5.23's scheduler-side objects driven by kvcheck's events.

Runs where SGLang imports (:func:`import_sglang` puts ``.sglang/VERSION`` on
``sys.path`` and installs the shims). SGLang's ``Scheduler`` needs a model
worker, so :class:`Driver` plays its loop (``event_loop_overlap`` at depth 2,
``event_loop_normal`` at depth 1) over SGLang's own objects: ``Req``,
``ReqToTokenPool``, the KV pools and allocators, ``UnifiedRadixCache``,
``PrefillAdder``, ``ScheduleBatch`` (``init_new``, ``prepare_for_extend``,
``prepare_for_decode``, ``filter_batch``, ``merge_batch``,
``check_decode_mem``, ``retract_decode``, ``release_req``),
``checkpoint_kv_cache`` and ``release_kv_cache``; with drafts SGLang's NGRAM
chain (``eagle_prepare_for_decode``, ``alloc_for_spec_decode``,
``SchedulerBatchResultProcessor._resolve_spec_v2_tokens``). The module docstring of
:mod:`impl.sglang.target` says how each event maps onto them.

Blocks are SGLang's pages: ``B = page_size`` (page size 1: a block is a
token slot). Physical block ``p`` is page ``p`` of the reported allocator
(SGLang hands out pages ``1..N``; page 0 is its padding slot, kvcheck's
NULL). Frees are read where the allocator really takes pages back
(``TokenToKVPoolAllocator.free`` outside a free group,
``PagedTokenToKVPoolAllocator._release_page_ids``), the reason from the call
SGLang made (eviction inside ``prepare_for_*`` or a checkpoint: ``window``;
``release_req``: ``preempt``; ``release_kv_cache`` at a finish: ``finish`` /
``abort``; the tree's ``insert``: ``dedup``), one FreeObs per request whose
row names the page. With the radix tree a page may be named by several rows
(a shared prefix) or by none while the tree keeps it (``parked``: counted
free, as evictable); a released row's pages the tree keeps are returned
(a reference dropped) when SGLang's release call returns, and a page the tree
evicts leaves ``parked`` when the allocator takes it back. Tables are read
off ``req_to_token`` (through ``full_to_swa_index_mapping`` for the SWA pool)
after each schedule; a page newly named there that another row names or the
tree keeps is a prefix hit (``AllocObs.cached``).
"""

from __future__ import annotations

import os
import sys
from array import array
from typing import Any

from model.events import (
    AddRequest,
    Config,
    Event,
    Finish,
    Preempt,
    Process,
    ResetPrefixCache,
    Schedule,
)
from model.observations import (
    NULL,
    AllocObs,
    Counters,
    FinishObs,
    FreeObs,
    Observed,
    ProcessObs,
    ReqCounters,
    ReqStep,
    StepObs,
)
from model.tokens import prompt_token

from . import compat

# SGLang frees a request's out-of-window SWA slots every
# SGLANG_SWA_EVICTION_INTERVAL tokens; kvcheck fuzzes every token
EVICTION_INTERVAL = "1"
SAMPLED = 7  # every sampled token (the reference's stream)
NO_RETRACT_CALL = ("SGLang has no call that retracts one chosen request: retract_decode "
                   "runs inside update_running_batch when check_decode_mem fails")


class ConfigUnsupported(ValueError):
    """A config this target does not drive (one line, exit 2)."""


class EventRejected(ValueError):
    """An event SGLang's loop cannot take now."""


def import_sglang(version: str) -> None:
    """Make ``import sglang`` load release ``version`` with kvcheck's shims."""
    os.environ["SGLANG_SWA_EVICTION_INTERVAL"] = EVICTION_INTERVAL
    # SGLang's Triton kernels on the scheduler's path (a verify's req_to_token
    # write, assign_req_to_token_pool) run in Triton's own CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    d = str(compat.install_dir(version))
    if d not in sys.path:
        sys.path.insert(0, d)
    from .shims import install

    install()


class Driver:
    def __init__(self, version: str) -> None:
        import_sglang(version)
        import torch

        self.torch = torch
        self.cfg: Config | None = None

    # ------------------------------------------------------------- reset

    def reset(self, cfg: Config) -> Observed:
        torch = self.torch
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )
        from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        why = unsupported(cfg)
        if why:
            raise ConfigUnsupported(why)
        self.cfg = cfg
        B = cfg.block_size
        g = cfg.groups[0]
        self.kind = g.kind
        K = self.K = cfg.spec_tokens
        spec = {}
        if K:
            # SGLang's NGRAM drafter as a chain (breadth 1, topk 1): each verify
            # computes the bonus token and K drafts, K + 1 positions
            spec = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=K + 1,
                        speculative_num_steps=K, speculative_eagle_topk=1,
                        speculative_ngram_max_bfs_breadth=1)
        set_global_server_args_for_scheduler(ServerArgs(
            model_path="dummy", page_size=B, chunked_prefill_size=cfg.max_num_batched_tokens,
            max_running_requests=cfg.max_num_seqs,
            disable_radix_cache=not cfg.prefix_caching, **spec))
        self.spec_algo = SpeculativeAlgorithm.NGRAM if K else SpeculativeAlgorithm.NONE
        # the scheduler's estimate of the tokens a running request will still
        # decode: 0.7 at start, decayed per decode, reset by each retraction
        self.ratio = NewTokenRatioTracker.from_config()
        # SGLang's req_to_token row: the context and get_req_to_token_extra_context_len
        # (the draft over-allocation); ours is 2B + 1 wider, so that a row SGLang would
        # overrun is seen (property 5, bound below) rather than written past
        self.extra = get_req_to_token_extra_context_len() if K else 0
        size = (cfg.num_blocks - 1) * B  # tokens; page 0 is SGLang's padding slot
        self.r2t = ReqToTokenPool(size=cfg.max_num_seqs + 1,
                                  max_context_len=cfg.max_model_len + self.extra + 2 * B + 1,
                                  device="cpu", enable_memory_saver=False)
        if g.kind == "sliding":
            kv = SWAKVPool(size=size, size_swa=size, page_size=B, dtype=torch.float32,
                           head_num=1, head_dim=4, swa_attention_layer_ids=[0],
                           full_attention_layer_ids=[1], device="cpu")
            self.alloc = SWATokenToKVPoolAllocator(size=size, size_swa=size, page_size=B,
                                                   dtype=torch.float32, device="cpu",
                                                   kvcache=kv, need_sort=False)
            self.pool = self.alloc.swa_attn_allocator  # the one group kvcheck sees
            comps: tuple = (ComponentType.FULL, ComponentType.SWA)
            window = g.param
        else:
            kv = MHATokenToKVPool(size=size, page_size=B, dtype=torch.float32, head_num=1,
                                  head_dim=4, layer_num=1, device="cpu",
                                  enable_memory_saver=False)
            if B == 1:
                self.alloc = TokenToKVPoolAllocator(size, torch.float32, "cpu", kv, False)
            else:
                self.alloc = PagedTokenToKVPoolAllocator(size, B, torch.float32, "cpu", kv,
                                                         False)
            self.pool = self.alloc
            comps = (ComponentType.FULL,)
            window = None
        self.cache = UnifiedRadixCache(params=CacheInitParams(
            req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, page_size=B,
            disable=not cfg.prefix_caching, sliding_window_size=window,
            tree_components=comps))
        self._hook_frees()
        self._hook_tree()
        import types

        self.model_config = types.SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)
        self.overlap = cfg.depth == 2
        self.ScheduleBatch = ScheduleBatch
        self.running = ScheduleBatch(reqs=[], batch_is_full=False)
        self.waiting: list[Any] = []
        self.chunked_req = None
        self.pending_chunked_abort = None
        self.last_batch = None
        self.queue: list[tuple[int, Any, list[str]]] = []  # (step, batch copy, rids)
        self.may_process = False  # the last Schedule found nothing (overlap loop)
        self.reqs: dict[str, Any] = {}
        self.status: dict[str, str] = {}
        self.computed: dict[str, int] = {}
        # block -> the (rid, logical) slots whose rows name it (several: a
        # prefix the tree shares); parked: pages only the tree keeps
        self.holders: dict[int, set[tuple[str, int]]] = {}
        self.parked: set[int] = set()
        self.tables: dict[str, list[int]] = {}
        self.step_no = 0
        self.items: list = []
        self.reason = "window"
        self.just_finished: list[str] = []
        self.ended: set[str] = set()
        return Observed([], self._counters())

    def _hook_frees(self) -> None:
        """Record each page the reported allocator takes back."""
        pool = self.pool
        B = self.cfg.block_size
        if B == 1:
            real = pool.free

            def free(free_index, _real=real, _pool=pool):
                if free_index.numel() and _pool.free_group is None:
                    self._freed(free_index.tolist())
                return _real(free_index)

            pool.free = free
        else:
            real_release = pool._release_page_ids

            def release(*page_ids, _real=real_release):
                for ids in page_ids:
                    self._freed(ids.tolist())
                return _real(*page_ids)

            pool._release_page_ids = release

    def _hook_tree(self) -> None:
        """Name the reason of what the tree frees: an insert's duplicates (the
        request's copy of KV the tree already holds) are ``dedup``."""
        cache = self.cache
        real = cache.insert

        def insert(params, _real=real):
            was, self.reason = self.reason, "dedup"
            try:
                return _real(params)
            finally:
                self.reason = was

        cache.insert = insert

    def _freed(self, pages: list[int]) -> None:
        for p in pages:
            p = int(p)
            if p == NULL:
                continue
            who = self.holders.pop(p, None)
            if not who:
                if p not in self.parked:
                    raise AssertionError(f"SGLang freed page {p}, which no request holds "
                                         f"and the tree does not keep")
                self.parked.discard(p)  # evicted from the tree
                continue
            self.parked.discard(p)
            for rid, logical in sorted(who):
                t = self.tables.get(rid)
                if t is not None and logical < len(t) and t[logical] == p:
                    t[logical] = NULL
                self.items.append(FreeObs(p, 0, rid, logical, self.reason))

    def _let_go(self, rid: str, reason: str) -> None:
        """``rid``'s row is gone (released): the pages it still named stay with
        the tree (a request's reference dropped, the page kept cached)."""
        for j, p in enumerate(self.tables.get(rid, ())):
            if p == NULL:
                continue
            who = self.holders.get(p)
            if who is None or (rid, j) not in who:
                continue
            who.discard((rid, j))
            if not who:
                del self.holders[p]
                self.parked.add(p)
            self.items.append(FreeObs(p, 0, rid, j, reason))

    # ---------------------------------------------------------- tables

    def _row(self, req) -> list[int]:
        """Physical block per logical block of ``req``'s allocated positions."""
        n = req.kv.kv_allocated_len
        B = self.cfg.block_size
        if not req.kv.holds_kv or n <= 0:
            return []
        row = self.r2t.req_to_token[req.kv.req_pool_idx, :n].to(self.torch.int64)
        if self.kind == "sliding":
            row = self.alloc.full_to_swa_index_mapping[row]
        firsts = row[::B].tolist()
        return [int(s) // B if s > 0 else NULL for s in firsts]

    def _sync_table(self, req) -> list[int]:
        rid = req.rid
        new = self._row(req)
        old = self.tables.setdefault(rid, [])
        for j, p in enumerate(new):
            have = old[j] if j < len(old) else NULL
            if p == have:
                continue
            if p != NULL and have != NULL:
                # the row now names the tree's copy (an insert rebound it) while
                # its own page was not freed: a reference dropped
                who = self.holders.get(have)
                if who is None or (rid, j) not in who:
                    raise AssertionError(f"{rid} logical {j}: table says {p}, kvcheck saw {have}")
                who.discard((rid, j))
                if not who:
                    del self.holders[have]
                    self.parked.add(have)
                self.items.append(FreeObs(have, 0, rid, j, "dedup"))
                have = NULL
            if p != NULL and have == NULL:
                who = self.holders.setdefault(p, set())
                cached = bool(who) or p in self.parked
                self.parked.discard(p)
                who.add((rid, j))
                self.items.append(AllocObs(p, 0, rid, j, cached=cached))
            elif not (p == NULL and have != NULL and (rid, j) not in self.holders.get(have, ())):
                raise AssertionError(f"{rid} logical {j}: table says {p}, kvcheck saw {have}")
        while len(old) < len(new):
            old.append(NULL)
        for j, p in enumerate(new):
            old[j] = p
        return list(new)

    # ------------------------------------------------------------ events

    def apply(self, ev: Event) -> Observed:
        self.items = []
        t = type(ev)
        if t is AddRequest:
            self._add(ev)
        elif t is Schedule:
            self._schedule()
        elif t is Process:
            self._process(ev)
        else:
            self._end(ev.id, "finish" if t is Finish else "abort")
        return Observed(self.items, self._counters())

    def why_not(self, ev: Event) -> str | None:
        """What SGLang's loop cannot take (beyond model/streams.py's order)."""
        t = type(ev)
        if t is Process and self.overlap and len(self.queue) < 2 and not self.may_process:
            return ("the overlap loop processes a batch's result after scheduling the next "
                    "one; with one batch in flight, only after a Schedule that found nothing")
        if t is not Process and self.overlap and self.may_process and self.queue:
            return ("an iteration of the overlap loop that schedules nothing processes the "
                    "batch in flight before it ends (pop_and_process)")
        if t is AddRequest and ev.external_tokens:
            return "no connector loads here (HiCache is not driven)"
        if t is ResetPrefixCache:
            return "SGLang's flush_cache runs only with no request in the scheduler"
        if t is Preempt:
            return NO_RETRACT_CALL
        return None

    def _add(self, ev: AddRequest) -> None:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        # no EOS token is configured, so a request ends at max_new_tokens, but is
        # admitted as SGLang admits one that may stop early (new_token_ratio)
        sp = SamplingParams(max_new_tokens=ev.max_new_tokens)
        sp.normalize(None)
        ids = array("q", (prompt_token(t, ev.variant) for t in range(ev.prompt_len)))
        req = Req(ev.id, "", ids, sp)
        self.reqs[ev.id] = req
        self.status[ev.id] = "waiting"
        self.computed[ev.id] = 0
        self.waiting.append(req)

    # one iteration of the loop: get_next_batch_to_run
    def _schedule(self) -> None:
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        cfg = self.cfg
        B = cfg.block_size
        if self.pending_chunked_abort is not None:  # process_pending_chunked_abort
            req, why = self.pending_chunked_abort
            self.pending_chunked_abort = None
            self.reason = why
            release_kv_cache(req, self.cache, checkpoint=False)
            self.chunked_req = None
            self._ended(req.rid, why)
        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                self.reason = "window"
                checkpoint_kv_cache(self.chunked_req, self.cache)  # stash_chunked_request
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            if last.chunked_req is not None:
                exclude.append(last.chunked_req)
            last.filter_batch(reqs_to_exclude=list(exclude))
            if not last.is_empty():
                if self.running.is_empty():
                    self.running = last
                else:
                    self.running.merge_batch(last)
        self.running.filter_batch()

        batch = None
        # _get_new_batch_prefill_raw
        running = self.running
        if running.is_empty():
            running.batch_is_full = False
        running.batch_is_full = False  # is_hybrid_swa / an empty batch re-open admission
        if self.waiting or self.chunked_req is not None:
            adder = PrefillAdder(B, self.cache, self.alloc, running, self.ratio.current,
                                 cfg.max_num_batched_tokens, cfg.max_num_batched_tokens, 0,
                                 max_running_requests=cfg.max_num_seqs)
            if self.chunked_req is not None:
                self.chunked_req.init_next_round_input()
                self.chunked_req = adder.add_chunked_req(self.chunked_req)
            # a request retracted with a batch of it in flight waits for that result
            # (SGLang processes it in the iteration that retracted, before any re-admission)
            busy = {id(r) for _, b, _ in self.queue for r in b.reqs}
            for req in self.waiting:
                if adder.budget_state() == AddReqResult.OTHER:
                    break
                if id(req) in busy:
                    continue
                held = sum(r.kv.holds_kv for r in adder.can_run_list)
                allocatable = min(cfg.max_num_seqs - len(running.reqs),
                                  self.r2t.available_size() + held)
                if len(adder.can_run_list) >= allocatable:
                    running.batch_is_full = True
                if running.batch_is_full:
                    break
                req.init_next_round_input(self.cache)
                res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None,
                                        truncation_align_size=None)
                if res != AddReqResult.CONTINUE:
                    if res == AddReqResult.NO_TOKEN:
                        running.batch_is_full = bool(adder.can_run_list) or not running.is_empty()
                    break
            can_run = adder.can_run_list
            if can_run:
                run_set = set(can_run)
                self.waiting = [r for r in self.waiting if r not in run_set]
                if adder.new_chunked_req is not None:
                    assert self.chunked_req is None
                    self.chunked_req = adder.new_chunked_req
                if self.chunked_req is not None:
                    self.chunked_req.inflight_middle_chunks += 1
                batch = self.ScheduleBatch.init_new(
                    can_run, self.r2t, self.alloc, self.cache, self.model_config,
                    self.overlap, self.spec_algo, chunked_req=self.chunked_req)
                self.reason = "window"
                batch.prepare_for_extend()
        if batch is None and not running.is_empty():
            batch = self._update_running(running)
        self.last_batch = batch
        if batch is None and (not self.overlap or last is None):
            self.ratio.reset()  # on_idle
        if batch is None or batch.is_empty():
            self.last_batch = batch if batch is not None and not batch.is_empty() else None
            self.may_process = True
            return
        self.may_process = False
        reqs = []
        extend = batch.forward_mode.is_extend()
        K = self.K
        for i, req in enumerate(batch.reqs):
            self.status[req.rid] = "running"
            table = self._sync_table(req)
            if extend:
                start, end = int(batch.prefix_lens[i]), int(batch.seq_lens_cpu[i])
            elif K:
                # a verify: the bonus token and K drafts from the device-side
                # committed length, i.e. the CPU's kv_committed_len plus every
                # verify of the request in flight, each taken as wholly accepted
                # (a rejection shifts this one down when that result is processed)
                start = self._verify_start(req)
                end = start + 1 + K
            else:
                end = int(batch.seq_lens_cpu[i])
                start = end - 1
            self.computed[req.rid] = end
            reqs.append(ReqStep(req.rid, start, end, K if not extend else 0,
                                tables=(tuple(table),)))
        self.items.append(StepObs(self.step_no, tuple(reqs)))
        self.queue.append((self.step_no, batch.copy(), [r.rid for r in batch.reqs]))
        self.step_no += 1

    def _verify_start(self, req) -> int:
        """Where ``req``'s next verify starts: ``kv_committed_len`` (SGLang's
        count of tokens with KV, advanced when a verify's result is processed)
        plus ``1 + K`` per verify of it still in flight. The count kvcheck
        tracks (``computed``: drafts included, lowered on rejection) must agree."""
        flying = sum(1 for _, b, _ in self.queue
                     if b.forward_mode.is_decode() and any(r is req for r in b.reqs))
        start = req.kv.kv_committed_len + flying * (1 + self.K)
        if start != self.computed.get(req.rid):
            raise AssertionError(f"{req.rid}: SGLang's kv_committed_len {req.kv.kv_committed_len} "
                                 f"and {flying} verify(s) in flight put its verify at {start}; "
                                 f"kvcheck counted {self.computed.get(req.rid)}")
        return start

    def _update_running(self, batch):
        """update_running_batch: the decode batch, retracting under pool pressure."""
        finishing = []
        if self.overlap and self.queue:
            queued = set(self.queue[-1][1].reqs)
            finishing = [r for r in batch.reqs
                         if r in queued and r.next_output_finishes_by_length()]
        batch.filter_batch(reqs_to_exclude=finishing)
        if batch.is_empty():
            batch.batch_is_full = False
            return None
        if not batch.check_decode_mem():
            if finishing:
                batch.batch_is_full = False
                return None
            self.reason = "preempt"
            retracted, self.ratio.current, aborted = batch.retract_decode()
            for req in retracted:
                self._retracted(req)
            for req in aborted:  # out of memory even after retracting the others
                self._release_aborted(req)
            if batch.is_empty():
                return None
        else:
            self.ratio.decay_step()
        self.reason = "window"
        batch.prepare_for_decode()
        return batch

    def _retracted(self, req) -> None:
        self._let_go(req.rid, "preempt")
        self.status[req.rid] = "preempted"
        self.computed[req.rid] = 0
        self.tables[req.rid] = []
        self.waiting.append(req)

    def _release_aborted(self, req) -> None:
        raise AssertionError(f"SGLang aborted {req.rid}: out of memory after retracting "
                             f"every other request")

    def _process(self, ev: Process) -> None:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        step, batch, rids = self.queue.pop(0)
        discarded: list[str] = []
        accepted: list[tuple[str, int]] = []
        self.may_process = False
        at = len(self.items)
        self.items.append(None)  # the ProcessObs: the result is back before anything frees
        if batch.forward_mode.is_extend():
            for req in batch.reqs:
                if (req.finished() and req.inflight_middle_chunks <= 0) or req.is_retracted:
                    discarded.append(req.rid)
                    continue
                if req.inflight_middle_chunks <= 0:
                    accepted.append((req.rid, 0))
                    req.output_ids.append(SAMPLED)
                    req.update_finish_state()
                    if req.finished():
                        self._release(req, checkpoint=True)
                    else:
                        self.reason = "window"
                        checkpoint_kv_cache(req, self.cache)
                else:
                    req.inflight_middle_chunks -= 1
        elif self.K:
            # process_batch_result_decode over a verify result: SGLang's own
            # _resolve_spec_v2_tokens commits each request's accepted run
            # (kv_committed_len += accepted drafts + the bonus token)
            accept = {r.rid: min(max(ev.accepted.get(r.rid, self.K), 0), self.K)
                      for r in batch.reqs}
            runs = self._resolve_verify(batch, accept)
            for req, run in zip(batch.reqs, runs, strict=True):
                if self.overlap and (req.finished() or req.is_retracted):
                    discarded.append(req.rid)
                    continue
                self.computed[req.rid] -= self.K - accept[req.rid]
                accepted.append((req.rid, accept[req.rid]))
                req.output_ids.extend(run)
                req.update_finish_state(len(run))
                if req.finished():
                    self._release(req, checkpoint=True)
        else:
            for req in batch.reqs:
                if self.overlap and (req.finished() or req.is_retracted):
                    discarded.append(req.rid)
                    continue
                accepted.append((req.rid, 0))
                req.output_ids.append(SAMPLED)
                req.update_finish_state(1)
                if req.finished():
                    self._release(req, checkpoint=True)
        self.items[at] = ProcessObs(step, tuple(accepted), tuple(discarded))

    def _resolve_verify(self, batch, accept: dict[str, int]) -> list[list[int]]:
        """The verify result a worker hands back (``GenerationBatchResult``:
        ``accept_lens`` = accepted drafts + 1 per request, ``K + 1`` token slots
        each), settled by SGLang's ``_resolve_spec_v2_tokens``; its metrics,
        adaptive-controller and grammar hooks are no-ops (no grammar here)."""
        import types

        from sglang.srt.managers.scheduler_components.batch_result_processor import (
            SchedulerBatchResultProcessor,
        )
        from sglang.srt.managers.utils import GenerationBatchResult

        torch, K = self.torch, self.K
        n = len(batch.reqs)
        result = GenerationBatchResult(
            next_token_ids=torch.full((n * (K + 1),), SAMPLED, dtype=torch.int64),
            accept_lens=torch.tensor([accept[r.rid] + 1 for r in batch.reqs],
                                     dtype=torch.int32),
            speculative_num_draft_tokens=K + 1)
        nop = types.SimpleNamespace
        host = nop(metrics_reporter=nop(snapshot_spec_decode_metrics=lambda b, r: None),
                   model_worker=nop(on_verify_complete_cpu=lambda c, batch_size: None),
                   advance_grammar_fsm=lambda r, b: None)
        return SchedulerBatchResultProcessor._resolve_spec_v2_tokens(host, result, batch)

    def _release(self, req, checkpoint: bool) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        fr = req.finished_reason
        why = ("length" if isinstance(fr, FINISH_LENGTH) else
               "abort" if isinstance(fr, FINISH_ABORT) else "finish")
        self.reason = "finish" if why != "abort" else "abort"
        release_kv_cache(req, self.cache, checkpoint=checkpoint)
        self._ended(req.rid, why)

    def _ended(self, rid: str, why: str) -> None:
        self._let_go(rid, "abort" if why == "abort" else "finish")
        self.items.append(FinishObs(rid, why))
        self.status[rid] = "finished"
        self.tables.pop(rid, None)
        self.just_finished.append(rid)

    def _end(self, rid: str, why: str) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_MATCHED_STR

        req = self.reqs[rid]
        # a request with no output to stop on (waiting, or mid-prefill) ends as
        # abort_request ends it, whichever event names it
        if req in self.waiting:  # abort_request: out of the queue
            self.waiting.remove(req)
            self._ended(rid, why)
            return
        if req is self.chunked_req:
            self.pending_chunked_abort = (req, why)  # released at the next iteration's start
            return
        # a running request: the next result processed for it finishes it
        req.to_finish = FINISH_ABORT("aborted") if why == "abort" else FINISH_MATCHED_STR("stop")

    # ---------------------------------------------------------- counters

    def _counters(self) -> Counters:
        cfg = self.cfg
        out = {}
        for rid, st in self.status.items():
            if st == "finished" and rid not in self.just_finished:
                continue
            t = self.tables.get(rid, [])
            live = sum(1 for p in t if p != NULL)
            out[rid] = ReqCounters(self.computed.get(rid, 0) if st != "finished" else 0, None,
                                   (live,), st)
        for rid in self.just_finished:
            self.status.pop(rid, None)
            self.ended.add(rid)
        self.just_finished = []
        B = cfg.block_size
        # the allocator's free pages and those only the tree keeps (evictable)
        free = self.pool.available_size() // B + len(self.parked)
        # the pages a req_to_token row of SGLang's width holds
        bound = -(-(cfg.max_model_len + self.extra) // B)
        return Counters(free, cfg.num_blocks, out, (bound,))


def unsupported(cfg: Config) -> str | None:
    if len(cfg.groups) != 1 or cfg.groups[0].kind not in ("full", "sliding"):
        return (f"kind {cfg.kind}: this target drives SGLang's full and sliding-window "
                f"pools only (full, sliding)")
    if cfg.groups[0].block_size not in (0, cfg.block_size):
        return "one block size per config"
    if cfg.spec_tokens and cfg.drafter != "ngram":
        return (f"drafter {cfg.drafter}: SGLang's drafts are driven as its NGRAM chain "
                f"(no draft KV of its own); EAGLE's draft-model KV pool is not (drafter ngram)")
    if cfg.depth > 2:
        return (f"depth {cfg.depth}: SGLang runs one batch in flight (overlap scheduler, "
                f"depth 2) or none (depth 1); its PP loop's micro-batches hold disjoint "
                f"requests")
    B = cfg.block_size
    # the reserve: two pages, or each batch in flight's verify slots (the
    # bonus token and every draft), whichever is more (pages of one token)
    need = cfg.max_model_len + max(2 * B, cfg.depth * (cfg.spec_tokens + 1))
    if (cfg.num_blocks - 1) * B < need:
        # the sliding layout's full-attention pool has the SWA pool's size
        return (f"{cfg.num_blocks - 1} pages of {B}: SGLang's PrefillAdder admits a "
                f"request only with room for its paged prompt, every new token and a "
                f"reserve in each pool, and a request left alone that outgrows the pool "
                f"is aborted, so one request of max_model_len {cfg.max_model_len} needs "
                f"{-(-need // B)} pages")
    return None
