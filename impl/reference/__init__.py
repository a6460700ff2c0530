"""The reference manager: a small, readable model of vLLM v1's KV-cache core.

Layers, each mirroring a vLLM file (read them side by side)::

    block_pool.py    BlockPool              vllm/v1/core/block_pool.py
    managers.py      one class per kind     vllm/v1/core/single_type_kv_cache_manager.py
    coordinator.py   several groups         vllm/v1/core/kv_cache_coordinator.py
    scheduler.py     steps, counts, events  vllm/v1/core/sched/{scheduler,async_scheduler}.py
    target.py        ReferenceTarget        impl/target.py (the Target protocol)

The one freeing decision that differs between vLLM versions is a parameter:
before allocating a request's new slots, each group frees the slots wholly
before the window of ``model.policy.basis(config.policy, group, counts)``.
``optimistic`` is vLLM <= 0.25.1, ``settled`` is the fix shipped in 0.26.0,
and any policy registered in ``model.policy`` runs by name.

Public API: :class:`ReferenceTarget` and :func:`prompt_token` (the prompt
token at a position, the same for every request, which the prefix cache
hashes).

Cross-checked against vLLM with ``confirm.differential`` (tests/
test_differential.py, scripts/diff_sweep.py); docs/DIFFERENCES.md lists what
still differs and why, with the agreement rates per kind and release.

Known omissions (vLLM 0.33 features outside the event language):

* attention kinds: R-SWA (``RSWAManager``), circular buffers, sink full
  attention, cross-attention, HiSparse; ``extra_retained_tokens`` (MTP
  store-side lag) on sliding windows;
* EAGLE/MTP: lookahead slots, the dropped last block of a cache hit, prefill
  lookahead reservations, dynamic spec decoding;
* Mamba "align" mode (checkpoint blocks, relocating speculative blocks):
  Mamba here has ordinary slots of size B, the state in the slot of the last
  computed token, plus ``spec_tokens`` speculative slots ("none" mode);
* prefix caching: partial-block (fine-grained) hits and copy-on-write,
  sparse retention masks, shared-prefix junctions, KV events, per-group
  block sizes, DCP/PCP sharding;
* scheduling: priority policy, watermark, ``long_prefill_token_threshold``,
  encoder budgets, LoRA, structured output, streaming sessions, pause
  states, DP prefill throttling, ``max_num_scheduled_tokens`` below the
  batch budget (draft slots of parallel drafters);
* connectors: asynchronous loads (``WAITING_FOR_REMOTE_KVS``), deferred
  loads, ``has_pending_block_frees``; only the synchronous load path (the
  step that admits the request loads ``[hit, external_tokens)``).

Deliberate deviations (each explained where it lives and in
docs/DIFFERENCES.md):

* a failed load whose bad block's window reaches NULL-padded slots goes back
  to where the window is held and drops the slots from the first NULL one
  (vLLM recomputes from the bad block and reads NULL); the request's later
  in-flight steps are discarded and waited for (vLLM delivers them);
* at depth 1 a held Finish/Abort frees nothing as out-of-window on the
  connector's finish path, so every policy behaves the same at depth 1;
* the connector offers ``external_tokens`` at the first admission only.

The reference follows vLLM 0.33; what 0.25.1 does differently besides its
freeing count (Mamba's ``c - K``, resuming a preempted request at once, no
decode padding, no trimming of tokens past a length stop, its admission cap
and synchronous pipeline parallelism) is listed in docs/DIFFERENCES.md.
"""

from .block_pool import prompt_token
from .target import ReferenceTarget

__all__ = ["ReferenceTarget", "prompt_token"]
