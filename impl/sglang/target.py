"""The ``sglang@VERSION`` target: SGLang's real KV allocator, pools and cache
behind kvcheck's Target protocol (:mod:`impl.sglang.driver` drives them).

SGLang imports in the process that runs the target (``.sglang/VERSION`` put
first on ``sys.path``, the import shims of :mod:`impl.sglang.shims`); a fuzz
run or a replay runs in a worker process beside it (:func:`worker_for`), as
vLLM's do. ``SGLANG_SWA_EVICTION_INTERVAL`` is 1.

What runs
---------
* layout: ``full``: an ``MHATokenToKVPool`` with SGLang's token allocator
  (page size 1) or paged allocator; ``sliding``: a hybrid ``SWAKVPool`` (one
  SWA layer, one full layer, pools of equal size) with
  ``SWATokenToKVPoolAllocator``; the group kvcheck sees is the SWA pool (the
  full layer's pool frees only at a request's end or by eviction). Blocks
  are pages: ``B = page_size``, ``num_blocks - 1`` pages (page 0 is SGLang's
  padding slot: NULL). The cache is ``UnifiedRadixCache`` (full, or full +
  SWA): enabled with prefix caching, disabled without (``disable=True``, what
  ``--disable-radix-cache`` builds).
* depth 2 is the overlap scheduler (``event_loop_overlap``, ``enable_overlap``
  on the batches: one batch in flight when the next is scheduled), depth 1
  the normal loop; deeper is refused (one line, exit 2: SGLang's PP loop keeps
  micro-batches of disjoint requests in flight, not kvcheck's depth), and so
  are drafters other than ``ngram`` and other kinds. Configs are ``stream_ordered``
  (one forward stream, ``_apply_war_barrier``), hazard ``ordered`` unless
  asked; ``unordered`` stands for a loader writing a page the moment it is
  free (HiCache without its ``load_fence_stream``; HiCache itself is not
  driven).

How an event runs
-----------------
* AddRequest: a ``Req`` (prompt ``model.tokens.prompt_token``, ``max_new_tokens``;
  no EOS token is configured, so it ends at ``max_new_tokens``, but it is not
  ``ignore_eos``: ``PrefillAdder`` reserves ``new_token_ratio`` of a running
  request's remaining tokens, the ratio kept as ``NewTokenRatioTracker``
  keeps it) appended to the waiting queue; external tokens are refused
  (``can_apply`` False). Its prefix is matched when ``PrefillAdder`` considers
  it (``init_next_round_input``: ``match_prefix``, the hit locked by
  ``add_one_req``).
* Schedule: ``get_next_batch_to_run``: a pending abort of the chunked request
  (``release_kv_cache``), the chunked request's ``checkpoint_kv_cache``
  (``stash_chunked_request``), the last extend batch filtered and merged into
  the running batch, a ``PrefillAdder`` over the chunked request and the
  waiting queue, ``ScheduleBatch.init_new`` + ``prepare_for_extend``; else
  ``update_running_batch``: requests whose queued result finishes them by
  length left out, ``check_decode_mem`` / ``retract_decode`` (``release_req``)
  under pool pressure, ``prepare_for_decode``. SWA eviction
  (``maybe_evict_swa`` -> ``free_swa_out_of_window_slots``) runs inside
  ``prepare_for_*`` as in SGLang.
* Drafts (``spec_tokens`` K, drafter ``ngram``): SGLang's NGRAM algorithm as
  a chain (``speculative_ngram_max_bfs_breadth`` 1, topk 1, K + 1 draft
  tokens), batches built with it, so ``prepare_for_decode`` is SGLang's
  ``eagle_prepare_for_decode``: ``maybe_evict_swa`` on ``req.seqlen - 1``
  (``kv_committed_len``), then ``alloc_for_spec_decode`` over-allocates each
  row to ``kv_committed_len + 2 (K + 1)`` (page-aligned; its req_to_token
  write is SGLang's Triton kernel, run by Triton's CPU interpreter). A verify
  computes the bonus token and K drafts from the device-side committed
  length: ``kv_committed_len`` plus ``K + 1`` per verify of the request in
  flight (ReqStep ``spec`` K), which a rejection shifts down. Process of a
  verify: the worker's result (``GenerationBatchResult``, ``accept_lens`` =
  the event's accepted drafts + 1) settled by SGLang's
  ``_resolve_spec_v2_tokens`` (``kv_committed_len += accepted + 1``), the run
  appended to ``output_ids``, ``update_finish_state(len(run))``; a request a
  run takes past ``max_new_tokens`` finishes, and ``release_kv_cache`` frees
  its over-allocated tail (``_release_overallocated_kv_indices``). Rejected
  slots are never freed before that: the next verify writes over them.
* Process: the oldest batch's result: one sampled token per request
  (``output_ids``, ``update_finish_state``), a finished request released
  (``release_kv_cache``), a finished prefill checkpointed; middle chunks only
  count down. Outputs of retracted or finished requests are skipped (the
  overlap loop's over-scheduled tokens): ProcessObs.discarded. In the overlap
  loop a batch's result is processed after the next batch is scheduled: with
  one batch in flight a Process is valid only after a Schedule that found
  nothing, and then it comes next (that iteration's ``pop_and_process``).
* Preempt: not taken. SGLang has no call that retracts one chosen request;
  ``retract_decode`` runs inside ``update_running_batch`` when
  ``check_decode_mem`` fails (the pools drawn are small), and that is the
  only retraction driven (``ScheduleBatch.release_req``, then
  ``reset_for_retract``; back to the waiting queue, recomputed from its
  prompt and outputs).
* Finish / Abort: ``abort_request``'s paths: a waiting request leaves the
  queue, the chunked one is released at the next iteration's start
  (``process_pending_chunked_abort``), a running one when its next result is
  processed (``to_finish``: a stop string, or ``FINISH_ABORT``). A Finish of a
  request with no output to stop on yet (waiting, mid-prefill) takes the same
  path as an Abort.

Observations: FreeObs where the reported allocator takes pages back (its
free calls wrapped; ``dedup`` inside the tree's ``insert``) for each request
whose row names the page, and where a released row leaves a page with the
tree (a reference dropped); AllocObs and tables from ``req_to_token`` (a page
another row names or the tree kept: ``cached``, a prefix hit; with drafts the
over-allocated tail too), counters from the requests (``computed`` the
allocated length; with drafts the committed length plus the verifies in
flight, checked against SGLang's at each verify; no in-flight count:
``in_flight`` None; the bound a req_to_token row of SGLang's width holds,
``get_req_to_token_extra_context_len`` past the context), free pages: the
pool's ``available_size`` plus the pages only the tree keeps.
"""

from __future__ import annotations

import threading
from typing import Any

from impl.target import Capabilities, TargetCrash, TargetError, Unsupported
from model.events import Config, Event
from model.observations import Observed
from model.streams import EngineState

from . import compat

_WHY = "sglang@{v}: {what}"


def _pins(version: str) -> dict[str, tuple[tuple[str, object, str], ...]]:
    def why(what: str) -> str:
        return _WHY.format(v=version, what=what)

    pins = (
        ("stream_ordered", True, why("one ordered forward stream runs every batch")),
        ("drafter", "ngram", why("drafts are driven as SGLang's NGRAM chain (no draft KV "
                                 "of its own); EAGLE's draft-model KV pool is not: use "
                                 "--drafter ngram")),
    )
    return {"full": pins, "sliding": pins}


# the hazard a run takes unless told: SGLang as shipped writes a freed page
# only on its one forward stream (``--hazard unordered`` asks how its frees
# fare under a writer off it: findings/sglang)
ORDERED = (("hazard", "ordered"),)

# SGLang's page sizes: 1, its default (FlashInfer's and Triton's attention),
# then 16 and 64, pages its other backends require (TRT-LLM's MHA, FlashMLA)
PAGES = (1, 16, 64)


class SglangTarget:
    """SGLang ``version``'s scheduler-side objects, in this process."""

    def __init__(self, version: str):
        problem = compat.release_problem(version)
        if problem:
            raise TargetError(problem)
        if not (compat.install_dir(version) / "sglang" / "__init__.py").is_file():
            raise TargetError(f"sglang {version} is not installed; run: "
                              f"{compat.install_command(version)}")
        self.version = version
        self.name = f"sglang@{version}"
        rare = (("preempt_in_flight", "SGLang retracts only when check_decode_mem fails, "
                 "and its PrefillAdder admits with a reserve of new_token_ratio: about one "
                 "example in 2,000"),)
        self.capabilities = Capabilities(kinds=frozenset({"full", "sliding"}), max_depth=2,
                                         fixed_policy="sglang", pinned=_pins(version),
                                         resets=False, loop="sglang",
                                         small_blocks=PAGES,
                                         defaults={k: ORDERED for k in ("full", "sliding")},
                                         unrequired={"full": rare, "sliding": rare})
        self._driver: Any = None
        self._config: Config | None = None
        self._state: EngineState | None = None

    def _d(self):
        if self._driver is None:
            try:
                from .driver import Driver

                self._driver = Driver(self.version)
            except Exception as e:  # noqa: BLE001 - an import that fails is the install's
                raise TargetError(f"{self.name} cannot be imported: {e}") from None
        return self._driver

    def reset(self, config: Config) -> Observed:
        from .driver import ConfigUnsupported

        d = self._d()
        try:
            obs = d.reset(config)
        except ConfigUnsupported as e:
            raise Unsupported(f"{self.name}: {e}") from None
        except Exception:  # noqa: BLE001
            import traceback

            raise TargetCrash(f"{self.name}: reset raised:\n{traceback.format_exc()}") from None
        self._config = config
        self._state = EngineState(config, loop=self.capabilities.loop)
        self._state.observe(obs)
        return obs

    def can_apply(self, event: Event) -> bool:
        if self._config is None or self._state is None:
            return False
        if self._state.why_not(event) is not None:
            return False
        return self._d().why_not(event) is None

    def apply(self, event: Event) -> Observed:
        if self._config is None:
            raise TargetCrash(f"{self.name}: reset() first")
        why = self._state.why_not(event) or self._d().why_not(event)
        if why is not None:
            raise Unsupported(f"{self.name}: {event} is not valid here now: {why}")
        try:
            obs = self._d().apply(event)
        except Exception:  # noqa: BLE001
            import traceback

            self._config = None
            raise TargetCrash(f"{self.name}: SGLang raised while applying {event}:\n"
                              f"{traceback.format_exc()}") from None
        self._state.observe(obs)
        return obs

    def close(self) -> None:
        pass


_workers: dict[tuple[str, int], Any] = {}
_lock = threading.Lock()


def worker_for(version: str, slot: int = 0):
    """A started worker process for jobs beside ``sglang@version``."""
    from impl.worker import WorkerProcess

    SglangTarget(version)  # refuses an unknown or missing release
    with _lock:
        w = _workers.get((version, slot))
        if w is None or not w.alive():
            w = _workers[(version, slot)] = WorkerProcess(
                f"sglang {version}", [str(compat.install_dir(version))],
                {"SGLANG_SWA_EVICTION_INTERVAL": "1", "TRITON_INTERPRET": "1"})
    w.ready(300.0)
    return w


def _shutdown() -> None:
    for w in list(_workers.values()):
        w.close()
    _workers.clear()


import atexit  # noqa: E402

atexit.register(_shutdown)
