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

Known omissions (vLLM 0.33 features outside the event language):

* attention kinds: R-SWA (``RSWAManager``), circular buffers, sink full
  attention, cross-attention, HiSparse; ``extra_retained_tokens`` (MTP
  store-side lag) on sliding windows;
* EAGLE/MTP: lookahead slots, the dropped last block of a cache hit, prefill
  lookahead reservations, dynamic spec decoding, padding new decodes to
  ``1 + spec_tokens``;
* Mamba "align" mode (checkpoint blocks, ``num_speculative_blocks``,
  relocating speculative blocks): Mamba here has ordinary slots of size B,
  the state in the slot of the last computed token;
* prefix caching: partial-block (fine-grained) hits and copy-on-write,
  sparse retention masks, shared-prefix junctions, KV events, per-group
  block sizes, DCP/PCP sharding; generated tokens are never hashed;
* scheduling: priority policy, watermark, ``long_prefill_token_threshold``,
  ``full_sequence_must_fit`` admission, encoder budgets, LoRA, structured
  output, streaming sessions, pause states, DP prefill throttling;
* connectors: asynchronous loads (``WAITING_FOR_REMOTE_KVS``), deferred
  loads, ``has_pending_block_frees``; only the synchronous load path (the
  step that admits the request loads ``[hit, external_tokens)``);
* 0.33's delivery of stale (pre-preemption) output: here it is discarded.

Deliberate deviations (each explained where it lives):

* a failed load drops the request's slots from the recompute point on and
  discards its later in-flight steps; the recompute point is the first bad
  block, or earlier when that position's window reaches slots the request
  does not hold (vLLM keeps the blocks and sets ``c = k*B``);
* loaded blocks enter the prefix cache only after their load succeeded;
* deferred request-level frees wait for the request's own last step (vLLM:
  the latest scheduled step), and apply at any depth under
  ``hazard = unordered``;
* the connector offers ``external_tokens`` at the first admission only.
"""

from .block_pool import prompt_token
from .target import ReferenceTarget

__all__ = ["ReferenceTarget", "prompt_token"]
