#!/usr/bin/env python3
"""Mutation testing of the checker (``make mutants``).

Each mutant is one small edit to the freeing or accounting code of a target,
the kind of slip a pull request could make: an off-by-one in a window, a
counter not reset, a fence one step early, a reference count not taken.
``vllm`` mutants edit vLLM 0.33.0's own code: a copy of the installed release
with that one edit is fuzzed as a source checkout (``--target vllm@PATH``).
``reference`` mutants edit our reference manager (impl/reference), fuzzed from
a copy of this repository. Each mutant must be *killed*: a property names the
step and the block. None of these edits is a bug the checker was written
against; they test the invariants, not known symptoms. The unmodified trees
are fuzzed the same way and must pass (the control rows), and so must a
harmless edit.

    .venv/bin/python scripts/mutants.py [--only NAME,...] [--examples N] [--list]

Writes ``reports/mutants.md`` and ``reports/mutants.json``; counterexample
traces go under ``reports/mutants/<name>/``. Exit status: 0 every mutant is
killed by a property it is expected to trip and the control passes, 1
otherwise, 2 bad usage or an anchor that no longer matches the release.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "0.33.0"
INSTALLED = ROOT / ".vllm" / RELEASE / "vllm"
CORE = "v1/core/"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the vllm/ package (subject vllm) or this repository
    old: str  # must occur exactly once in the file ("" with file "": a control)
    new: str
    why: str  # the slip, in one line
    args: tuple[str, ...]  # fuzz options that reach the edited path
    expect: frozenset[int]  # the properties that should catch it
    # killed: a property in ``expect`` fires; crashed: vLLM's own assertion fires first
    # (kvcheck reports exit 3 with the trace); vacuous: the witnesses show the code never
    # reaches a free at all; survives: a harmless edit the checker must stay silent on
    outcome: str = "killed"
    subject: str = "vllm"  # vllm | reference
    # connector loads may fail (off elsewhere: vLLM's own failed-load findings
    # would kill every row that draws one)
    failed_loads: bool = False
    # a slip that takes several requests to reach (a cached block evicted, handed
    # out, then hit): fuzzed with at least this many examples, its counterexample
    # may be up to max_events long
    min_examples: int = 0
    max_events: int = 10
    # a diff under findings/fixes/ applied to vLLM first: the tree the row edits
    # (a path a known finding of the release would kill every row of)
    base: str = ""


_ASYNC = ("--depth", "2")
_CONSUMER = ("--hazard", "unordered", "--depth", "2")
_PC = ("--prefix-caching", "on")

REF = "impl/reference/"
# hits inside a block: full attention beside Mamba hashed finer than the block,
# on the tree without finding 9 (chained copies of one step)
_PARTIAL = ("--kind", "hybrid", "--prefix-match-unit", "fine", "--spec-tokens", "0",
            "--no-external", *_ASYNC)
_CHAIN_FIX = "findings/09-partial-hit-copies-chain/fix.diff"

MUTANTS: tuple[Mutant, ...] = (
    Mutant("control", "", "", "", "the unmodified release",
           ("--kind", "sliding", *_ASYNC), frozenset(), "survives"),
    Mutant(
        "optimistic-basis", CORE + "kv_cache_manager.py",
        "max(0, total_computed_tokens - request.num_in_flight_tokens),",
        "total_computed_tokens,",
        "allocate_slots frees out-of-window blocks on the optimistic count again",
        ("--kind", "sliding", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "swa-window-one-short", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens",
        "num_computed_tokens - self.sliding_window + 2 - self.extra_retained_tokens",
        "sliding window's skipped-token count one too high (window of W-1)",
        ("--kind", "sliding", "--depth", "1"), frozenset({1, 2})),
    Mutant(
        "swa-drops-retained-tokens", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens",
        "num_computed_tokens - self.sliding_window + 1",
        "a sliding window frees the tokens it retains for a multi-module MTP drafter, whose "
        "next prefill chunk computes them again",
        ("--kind", "sliding", "--drafter", "mtp", "--prefix-caching", "off", *_ASYNC),
        frozenset({1, 2}), min_examples=400),
    Mutant(
        "chunk-boundary-early", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens // self.attention_chunk_size\n        ) * self.attention_chunk_size",
        "(num_computed_tokens + 1) // self.attention_chunk_size\n"
        "        ) * self.attention_chunk_size",
        "chunked-local frees the current chunk one token before it ends",
        ("--kind", "chunked_local", "--depth", "1"), frozenset({1, 2})),
    Mutant(
        "mamba-frees-last-state", CORE + "single_type_kv_cache_manager.py",
        "need to keep the state of the last computed token, so we return\n"
        "        num_computed_tokens - 1.\n        \"\"\"\n        return num_computed_tokens - 1",
        "need to keep the state of the last computed token, so we return\n"
        "        num_computed_tokens - 1.\n        \"\"\"\n        return num_computed_tokens",
        "Mamba lets go of the state block of the last computed token",
        ("--kind", "mamba", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "mamba-align-frees-state-early", CORE + "single_type_kv_cache_manager.py",
        "                < cdiv(processed_computed_tokens, self.block_size) - 1\n",
        "                < cdiv(processed_computed_tokens, self.block_size)\n",
        "Mamba's align mode retires the previous state block while the step that copies "
        "it is still in flight",
        ("--kind", "mamba", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "mamba-align-relocates-running-state", CORE + "single_type_kv_cache_manager.py",
        "                        if block_idx < num_skipped_blocks - checkpoint_block:\n",
        "                        if block_idx <= num_skipped_blocks - checkpoint_block:\n",
        "Mamba's align mode relocates one speculative block too many with drafts: the slot "
        "of the new running state, which the step writes",
        ("--kind", "mamba", "--spec-tokens", "2", "--no-external", *_ASYNC), frozenset({2, 3})),
    Mutant(
        "hybrid-mamba-relocates-running-state", CORE + "single_type_kv_cache_manager.py",
        "                        if block_idx < num_skipped_blocks - checkpoint_block:\n",
        "                        if block_idx <= num_skipped_blocks - checkpoint_block:\n",
        "the same relocation slip, seen through full + Mamba and full + sliding + Mamba "
        "models with n-gram drafts",
        ("--kind", "hybrid", *_PC, "--spec-tokens", "2", "--no-external", *_ASYNC),
        frozenset({2, 3})),
    Mutant(
        "mamba-align-hides-relocated-block", CORE + "single_type_kv_cache_manager.py",
        "                returned_blocks = req_blocks[prev_block_len:]\n",
        "                returned_blocks = [b for b in req_blocks[prev_block_len:] if b.is_null]\n",
        "Mamba's align mode does not tell the worker where a relocated speculative block "
        "went: the worker's append-only table misses that slot, the scheduler's is right",
        ("--kind", "mamba", "--spec-tokens", "2", "--no-external", *_ASYNC), frozenset({2})),
    Mutant(
        "mamba-align-hides-null-padding", CORE + "single_type_kv_cache_manager.py",
        "                returned_blocks = req_blocks[prev_block_len:]\n",
        "                returned_blocks = [b for b in req_blocks[prev_block_len:]"
        " if not b.is_null]\n",
        "Mamba's align mode does not hand the worker the NULL slots a long chunk skips: the "
        "worker's table shifts the states after them down, the scheduler's is right",
        ("--kind", "mamba", "--spec-tokens", "0", "--no-external", "--depth", "1"),
        frozenset({2})),
    Mutant(
        "hybrid-sliding-one-short", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens",
        "num_computed_tokens - self.sliding_window + 2 - self.extra_retained_tokens",
        "the same window slip, seen through a hybrid full + sliding model",
        ("--kind", "hybrid", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "preempt-zeroes-in-flight", CORE + "sched/scheduler.py",
        "        request.status = RequestStatus.PREEMPTED\n"
        "        request.num_computed_tokens = 0\n",
        "        request.status = RequestStatus.PREEMPTED\n"
        "        request.num_computed_tokens = 0\n"
        "        request.num_in_flight_tokens = 0\n",
        "preemption resets the in-flight count while its steps are still in flight",
        ("--kind", "sliding", *_ASYNC), frozenset({4})),
    Mutant(
        "in-flight-drain-one-token", CORE + "sched/scheduler.py",
        "                request.num_in_flight_tokens -= num_tokens_scheduled\n",
        "                request.num_in_flight_tokens -= min(num_tokens_scheduled, 1)\n",
        "processing a step drains one in-flight token, not every token it scheduled",
        ("--kind", "sliding", *_ASYNC), frozenset({4})),
    Mutant(
        "deferred-free-off", CORE + "sched/scheduler.py",
        "            if multiple_inflight_batches and kv_transfer_config.is_kv_consumer:\n"
        "                self.defer_block_free = True\n",
        "            if multiple_inflight_batches and kv_transfer_config.is_kv_consumer:\n"
        "                self.defer_block_free = False\n",
        "a KV consumer under async scheduling no longer defers request-level frees",
        ("--kind", "full", *_CONSUMER), frozenset({1})),
    Mutant(
        "fence-one-step-early", CORE + "sched/scheduler.py",
        "            request.last_sched_seq <= self.processed_step_seq\n",
        "            request.last_sched_seq <= self.processed_step_seq + 1\n",
        "the deferred-free fence lets a request's blocks go one step early",
        ("--kind", "full", *_CONSUMER), frozenset({1})),
    Mutant(
        "preempt-skips-fence", CORE + "sched/scheduler.py",
        "        self._free_request_blocks(request)\n"
        "        self.encoder_cache_manager.free(request)\n"
        "        self._pending_encoder_input_ids.pop(request.request_id, None)\n"
        "        self._inflight_prefills.discard(request)\n"
        "        request.status = RequestStatus.PREEMPTED\n",
        "        self.kv_cache_manager.free(request)\n"
        "        self.encoder_cache_manager.free(request)\n"
        "        self._pending_encoder_input_ids.pop(request.request_id, None)\n"
        "        self._inflight_prefills.discard(request)\n"
        "        request.status = RequestStatus.PREEMPTED\n",
        "preemption returns the blocks at once, past the deferred-free fence",
        ("--kind", "full", *_CONSUMER), frozenset({1})),
    Mutant(
        "cached-blocks-leak", CORE + "block_pool.py",
        "            block.ref_cnt -= 1\n            if block.ref_cnt == 0:\n"
        "                if block.block_hash is None or not self.enable_caching:",
        "            block.ref_cnt -= 1 if block.block_hash is None else 0\n"
        "            if block.ref_cnt == 0:\n"
        "                if block.block_hash is None or not self.enable_caching:",
        "freeing a prefix-cached block forgets to drop its reference",
        ("--kind", "full", "--prefix-caching", "on", *_ASYNC), frozenset({3})),
    Mutant(
        "prefix-hit-no-ref", CORE + "block_pool.py",
        "                self.free_block_queue.remove(block)\n            block.ref_cnt += 1\n"
        "            if self.metrics_collector:\n"
        "                self.metrics_collector.on_block_accessed(block)",
        "                self.free_block_queue.remove(block)\n"
        "            block.ref_cnt += 1 if block.ref_cnt == 0 else 0\n"
        "            if self.metrics_collector:\n"
        "                self.metrics_collector.on_block_accessed(block)",
        "a prefix-cache hit on a block already in use takes no reference",
        ("--kind", "full", "--prefix-caching", "on", *_ASYNC), frozenset({1, 2, 3})),
    Mutant(
        "caches-before-computed", CORE + "kv_cache_manager.py",
        "        num_tokens_to_cache = min(\n"
        "            total_computed_tokens + num_new_tokens,\n"
        "            request.num_tokens,\n",
        "        num_tokens_to_cache = min(\n"
        "            request.num_tokens,\n"
        "            request.num_tokens,\n",
        "a prompt's blocks are offered to the prefix cache before their chunk is computed",
        ("--kind", "full", "--prefix-caching", "on", *_ASYNC), frozenset({2}),
        min_examples=600),
    Mutant(
        "preempts-fenced-victim", CORE + "sched/scheduler.py",
        "                    if not self._request_blocks_can_be_freed(preempted_req):\n"
        "                        break\n",
        "                    if False:\n"
        "                        break\n",
        "under pool pressure the scheduler preempts a victim whose blocks wait behind its "
        "in-flight steps (vLLM #49674)",
        ("--kind", "full", *_CONSUMER), frozenset({7}), min_examples=400),
    Mutant(
        "preempted-request-lost", CORE + "sched/scheduler.py",
        "        # Put the request back to the waiting queue.\n"
        "        self.waiting.prepend_request(request)\n",
        "        # Put the request back to the waiting queue.\n"
        "        pass\n",
        "a preempted request is not put back in the waiting queue: it never runs again",
        ("--kind", "full", "--depth", "1"), frozenset({7})),
    Mutant(
        "rswa-gap-into-prompt", CORE + "single_type_kv_cache_manager.py",
        "        first_gap_block = cdiv(num_prompt_tokens, bs)\n",
        "        first_gap_block = num_prompt_tokens // bs\n",
        "R-SWA's gap starts at the block holding the prompt's last tokens, which every "
        "position still reads",
        ("--kind", "rswa", *_ASYNC), frozenset({1, 2}), max_events=14),
    Mutant(
        "rswa-window-one-short", CORE + "single_type_kv_cache_manager.py",
        "            num_prompt_tokens, processed_computed_tokens - self.rswa_window\n",
        "            num_prompt_tokens, processed_computed_tokens - self.rswa_window + 2\n",
        "R-SWA's gap ends two tokens late: it frees the block of the oldest position the "
        "window still reads",
        ("--kind", "rswa", "--block-size", "4", "--spec-tokens", "0", *_ASYNC),
        frozenset({1, 2}), max_events=16),
    Mutant(
        "ring-freed-as-window", CORE + "single_type_kv_cache_manager.py",
        "    ) -> None:\n        return\n\n    def get_num_skipped_tokens(self, "
        "num_computed_tokens: int) -> int:\n        return 0\n\n\n"
        "class ChunkedLocalAttentionManager",
        "    ) -> None:\n        super().remove_skipped_blocks(request_id, "
        "processed_computed_tokens)\n\n    def get_num_skipped_tokens(self, "
        "num_computed_tokens: int) -> int:\n        return num_computed_tokens\n\n\n"
        "class ChunkedLocalAttentionManager",
        "the circular buffer's manager frees its ring like a window of one token once the "
        "settled count passes its block",
        ("--kind", "ring", "--hazard", "ordered", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "ring-claims-every-step", CORE + "single_type_kv_cache_manager.py",
        "        req_blocks = self.req_to_blocks[request_id]\n        if req_blocks:\n"
        "            return []\n        new_blocks = self.block_pool.get_new_blocks(1)\n",
        "        req_blocks = self.req_to_blocks[request_id]\n        if len(req_blocks) > 1:\n"
        "            return []\n        new_blocks = self.block_pool.get_new_blocks(1)\n",
        "the circular buffer claims a second ring block for a request that holds one",
        ("--kind", "ring", "--hazard", "ordered", *_ASYNC), frozenset({5})),
    Mutant(
        "cross-freed-as-window", CORE + "single_type_kv_cache_manager.py",
        '    """Manager for cross-attention KV cache in encoder-decoder models."""\n',
        '    """Manager for cross-attention KV cache in encoder-decoder models."""\n\n'
        "    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:\n"
        "        return num_computed_tokens\n",
        "cross attention takes the decoder's settled tokens as skipped and frees encoder "
        "blocks that every later position reads",
        ("--kind", "cross", "--hazard", "ordered", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "cross-blocks-leak", CORE + "single_type_kv_cache_manager.py",
        '    """Manager for cross-attention KV cache in encoder-decoder models."""\n',
        '    """Manager for cross-attention KV cache in encoder-decoder models."""\n\n'
        "    def free(self, request_id: str) -> None:\n"
        "        self.pop_blocks_for_free(request_id)\n",
        "cross attention forgets a finished request's encoder blocks without returning them "
        "to the pool",
        ("--kind", "cross", "--hazard", "ordered", *_ASYNC), frozenset({3})),
    Mutant(
        "skipped-blocks-round-up", CORE + "single_type_kv_cache_manager.py",
        "        num_skipped_blocks = num_skipped_tokens // self.block_size\n"
        "        # `num_skipped_tokens` may include",
        "        num_skipped_blocks = -(-num_skipped_tokens // self.block_size)\n"
        "        # `num_skipped_tokens` may include",
        "the skipped-token count is rounded up to blocks, freeing a block still half in the window",
        ("--kind", "sliding", "--depth", "1"), frozenset({1, 2})),
    Mutant(
        "swa-window-one-long", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens",
        "num_computed_tokens - self.sliding_window - self.extra_retained_tokens",
        "sliding window keeps one token more than it reads: harmless, inside vLLM's pool sizing",
        ("--kind", "sliding", *_ASYNC), frozenset(), "survives"),
    Mutant(
        "rejection-not-rolled-back", CORE + "sched/scheduler.py",
        "                        request.num_computed_tokens -= num_rejected\n",
        "                        request.num_computed_tokens -= 0\n",
        "rejected drafts are not rolled back from the computed count",
        ("--kind", "sliding", "--spec-tokens", "2", *_ASYNC), frozenset({1, 2, 4})),
    Mutant(
        "stale-share-forgotten", CORE + "sched/scheduler.py",
        "        request.num_stale_output_tokens = request.num_in_flight_tokens\n"
        "        request.num_output_placeholders = 0\n        request.num_preemptions += 1\n",
        "        request.num_stale_output_tokens = 0\n"
        "        request.num_output_placeholders = 0\n        request.num_preemptions += 1\n",
        "a preempted request's in-flight output is not marked stale",
        ("--kind", "sliding", "--spec-tokens", "2", *_ASYNC), frozenset(), "crashed"),
    # prefix-cache slips that hand a request KV never written, or written for
    # another prefix or position: property 2's content rule, no --attention
    Mutant(
        "hash-not-chained", CORE + "kv_cache_utils.py",
        "                caching_hash_fn, prev_block_hash_value, block_tokens, extra_keys\n",
        "                caching_hash_fn, None, block_tokens, extra_keys\n",
        "a block's hash is not chained to its parent's: equal blocks under different "
        "prefixes share a hash",
        ("--kind", "sliding", *_PC, "--block-size", "4", *_ASYNC), frozenset({2}),
        min_examples=300),
    Mutant(
        "hash-skips-last-token", CORE + "kv_cache_utils.py",
        "            block_tokens = request.all_token_ids[start_token_idx:end_token_idx]\n",
        "            block_tokens = request.all_token_ids[start_token_idx:end_token_idx - 1]\n",
        "a block's hash leaves out its last token: a block ending in an output token "
        "collides with one ending in a prompt token",
        ("--kind", "full", *_PC, "--block-size", "4", *_ASYNC), frozenset({2}),
        min_examples=300, max_events=16),
    Mutant(
        "caches-partial-block", CORE + "single_type_kv_cache_manager.py",
        "        num_full_blocks = min(num_tokens, num_hashed_tokens) // self.block_size\n",
        "        num_full_blocks = min(num_tokens + self.block_size - 1, num_hashed_tokens)"
        " // self.block_size\n",
        "cache_blocks rounds the computed tokens up to a block: a block a prefill chunk "
        "only half wrote is cached under its full hash",
        ("--kind", "sliding", *_PC, *_ASYNC), frozenset({2}), min_examples=300),
    Mutant(
        "evict-keeps-map-entry", CORE + "block_pool.py",
        "                self.cached_block_hash_to_block.pop(block_hash, block.block_id)\n"
        "                is not None\n",
        "                self.cached_block_hash_to_block.get_one_block(block_hash)\n"
        "                is not None\n",
        "evicting a cached block resets its hash but leaves its entry in the hash map: "
        "a later lookup hits the reused block",
        ("--kind", "sliding", *_PC, *_ASYNC), frozenset({2}), min_examples=300,
        max_events=16),
    Mutant(
        "swa-hit-one-block-short", CORE + "single_type_kv_cache_manager.py",
        "        blocks = cdiv(window_size - 1, block_size)\n",
        "        blocks = (window_size - 1) // block_size\n",
        "a sliding-window hit needs one contiguous block fewer than the window spans",
        ("--kind", "sliding", *_PC, *_ASYNC), frozenset({2}), min_examples=300),
    Mutant(
        "eagle-hash-skips-next-token", CORE + "kv_cache_utils.py",
        "                    extra_keys = (extra_keys, request.all_token_ids[end_token_idx])\n",
        "                    extra_keys = (extra_keys, None)\n",
        "EAGLE's lookahead block hash leaves out the token after the block (no hit drop then)",
        ("--kind", "full", "--drafter", "eagle", "--hazard", "ordered", *_PC, *_ASYNC),
        frozenset({2}), min_examples=300, max_events=16),
    Mutant(
        "mamba-eagle-hash-skips-next-token", CORE + "kv_cache_utils.py",
        "                    extra_keys = (extra_keys, request.all_token_ids[end_token_idx])\n",
        "                    extra_keys = (extra_keys, None)\n",
        "the same hash slip beside Mamba, where vLLM plans EAGLE's draft layer as a group of "
        "its own: a hit reads the draft group's KV built with another next token",
        ("--kind", "mamba", "--drafter", "eagle", "--no-external", *_PC, *_ASYNC),
        frozenset({2}), min_examples=1500, max_events=16),
    # groups of different block sizes (vLLM's page-size unification): a coarser
    # group's blocks are keyed by fine hashes (hash_block_size, their GCD)
    Mutant(
        "coarse-hash-one-unit-short", CORE + "kv_cache_utils.py",
        "        return self.block_hashes[(idx + 1) * self.scale_factor - 1]\n",
        "        return self.block_hashes[(idx + 1) * self.scale_factor - 2]\n",
        "resolve_block_hashes' coarse view keys a block by the fine hash one unit before "
        "its end: the block's last hash unit is left out of its key",
        ("--kind", "hybrid", "--group-block-sizes", "mixed", *_PC, "--block-size", "4",
         "--spec-tokens", "0", *_ASYNC), frozenset({2}), min_examples=1500, max_events=16),
    Mutant(
        "cached-at-hash-unit", CORE + "block_pool.py",
        "        assert block_mask is None or len(block_mask) == len(new_full_blocks)\n"
        "        block_hashes = resolve_block_hashes(\n"
        "            request.block_hashes, self.hash_block_size, block_size\n",
        "        assert block_mask is None or len(block_mask) == len(new_full_blocks)\n"
        "        block_hashes = resolve_block_hashes(\n"
        "            request.block_hashes, self.hash_block_size, self.hash_block_size\n",
        "cache_full_blocks keys a coarser group's blocks by the hash units' own view, not "
        "at the group's block size: block k is filed under the key of a shorter prefix",
        ("--kind", "hybrid", "--group-block-sizes", "mixed", *_PC, "--block-size", "4",
         "--spec-tokens", "0", *_ASYNC), frozenset({2}), min_examples=300, max_events=16),
    Mutant(
        "touch-keeps-in-free-queue", CORE + "block_pool.py",
        "            if block.ref_cnt == 0:\n"
        "                self.free_block_queue.remove(block)\n"
        "            block.ref_cnt += 1\n",
        "            block.ref_cnt += 1\n",
        "a prefix hit on a free cached block takes a reference but leaves it in the "
        "free queue (property 3 reads the free queue itself)",
        ("--kind", "full", *_PC, *_ASYNC), frozenset({3})),
    Mutant(
        "cached-evicted-first", CORE + "block_pool.py",
        "        self.free_block_queue.prepend_n(blocks_to_evict_first)\n"
        "        # Blocks to reuse last are appended to the end of the free queue.\n"
        "        self.free_block_queue.append_n(blocks_to_evict_last)\n",
        "        self.free_block_queue.append_n(blocks_to_evict_first)\n"
        "        # Blocks to reuse last are appended to the end of the free queue.\n"
        "        self.free_block_queue.prepend_n(blocks_to_evict_last)\n",
        "freed cached blocks are evicted first and uncached ones last: a worse eviction "
        "order, harmless",
        ("--kind", "full", *_PC, *_ASYNC), frozenset(), "survives", min_examples=300),
    Mutant(
        "window-never-frees", CORE + "single_type_kv_cache_manager.py",
        "        del num_prompt_tokens\n"
        "        # Remove the blocks that will be skipped during attention computation.\n"
        "        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)\n"
        "        if num_skipped_tokens <= 0:",
        "        del num_prompt_tokens\n"
        "        # Remove the blocks that will be skipped during attention computation.\n"
        "        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)\n"
        "        if True:",
        "out-of-window blocks are never freed (a request holds its whole history)",
        ("--kind", "sliding", *_ASYNC), frozenset(), "vacuous"),
    Mutant(
        "failed-load-resumes-late", CORE + "sched/scheduler.py",
        "                request.num_computed_tokens = idx * self.block_size\n",
        "                request.num_computed_tokens = (idx + 1) * self.block_size\n",
        "after a failed load, recompute starts one block past the first bad block",
        ("--kind", "full", "--prefix-caching", "off", *_CONSUMER),
        frozenset({2}), failed_loads=True),
    Mutant("control-reference", "", "", "", "the unmodified reference manager",
           ("--spec-tokens", "2", "--hazard", "unordered", *_ASYNC), frozenset(), "survives",
           "reference"),
    Mutant(
        "ref-swa-window-one-short", REF + "managers.py",
        "        return max(0, n - self.window + 1)\n",
        "        return max(0, n - self.window + 2)\n",
        "the reference's sliding window skips one token too many",
        ("--kind", "sliding", "--depth", "1"), frozenset({1, 2}), subject="reference"),
    Mutant(
        "ref-chunk-boundary-early", REF + "managers.py",
        "        return (n // self.chunk) * self.chunk\n",
        "        return ((n + 1) // self.chunk) * self.chunk\n",
        "the reference frees a chunk one token before it ends",
        ("--kind", "chunked_local", "--depth", "1"), frozenset({1, 2}), subject="reference"),
    Mutant(
        "ref-mamba-frees-last-state", REF + "managers.py",
        "        return max(0, n - 1)\n",
        "        return max(0, n)\n",
        "the reference's Mamba manager drops the last computed token's state",
        ("--kind", "mamba", *_ASYNC), frozenset({1, 2}), subject="reference"),
    Mutant(
        "ref-skipped-blocks-round-up", REF + "managers.py",
        "rid, 0, self.get_num_skipped_tokens(basis) // self.B)\n",
        "rid, 0, -(-self.get_num_skipped_tokens(basis) // self.B))\n",
        "the reference rounds skipped tokens up to whole blocks",
        ("--kind", "sliding", "--depth", "1"), frozenset({1, 2}), subject="reference"),
    Mutant(
        "ref-drain-forgets-drafts", REF + "scheduler.py",
        "            r.in_flight -= e.end - e.start\n",
        "            r.in_flight -= e.end - e.start - e.spec\n",
        "processing a step drains its tokens but not its drafts from the in-flight count",
        ("--kind", "sliding", "--spec-tokens", "2", *_ASYNC), frozenset({4}),
        subject="reference"),
    Mutant(
        "ref-fence-one-step-early", REF + "scheduler.py",
        "            if fence <= done:\n",
        "            if fence <= done + 1:\n",
        "the reference's deferred frees pass their fence one step early",
        ("--kind", "full", *_CONSUMER), frozenset({1}), subject="reference"),
    Mutant(
        "ref-in-flight-test-off-by-one", REF + "scheduler.py",
        "        return r.last_step >= self.num_processed\n",
        "        return r.last_step > self.num_processed\n",
        "a request whose last step is the oldest in flight counts as idle",
        ("--kind", "full", *_CONSUMER), frozenset({1}), subject="reference"),
    Mutant(
        "ref-cached-blocks-leak", REF + "block_pool.py",
        "            ref[b] -= 1\n",
        "            ref[b] -= 1 if key[b] is None else 0\n",
        "the reference pool keeps a reference on freed prefix-cached blocks",
        ("--kind", "full", "--prefix-caching", "on", *_ASYNC), frozenset({3}),
        subject="reference"),
    Mutant(
        "ref-reused-block-keeps-hash", REF + "block_pool.py",
        "                del lru[b]\n                self._evict(b)\n",
        "                del lru[b]\n",
        "the reference pool hands out a cached block afresh without forgetting its hash",
        ("--kind", "full", "--prefix-caching", "on", "--block-size", "4", "--spec-tokens", "0",
         "--hazard", "ordered", "--no-external", *_ASYNC), frozenset({2}),
        subject="reference", min_examples=400, max_events=20),
    Mutant(
        "ref-preempts-fenced-victim", REF + "scheduler.py",
        "                if self.defer_request_frees and self._in_flight(victim):\n",
        "                if False:\n",
        "the reference preempts a victim whose blocks wait behind its in-flight steps",
        ("--kind", "full", *_CONSUMER), frozenset({7}), subject="reference"),
    Mutant(
        "ref-mamba-local-lazy", "model/policy.py",
        "    if group.spec.holds_state:\n        return counts.computed - counts.spec\n"
        "    return counts.computed\n",
        "    if group.spec.holds_state:\n        return counts.computed - counts.spec\n"
        "    return counts.computed - 1\n",
        "the mamba-local policy frees one token late on attention groups: safe, but no "
        "longer what settled does at depth 1",
        ("--kind", "sliding", "--policy", "mamba-local", "--depth", "1"), frozenset({6}),
        subject="reference"),
    Mutant(
        "ref-ring-freed-as-window", REF + "managers.py",
        "    def remove_skipped_blocks(self, rid: str, basis: int) -> list[Change]:\n"
        "        return []\n",
        "    def remove_skipped_blocks(self, rid: str, basis: int) -> list[Change]:\n"
        "        return self._remove_range(rid, 0, basis // self.B)\n",
        "the reference frees a ring (and encoder outputs) like a window once the settled "
        "count passes a block",
        ("--kind", "ring", *_ASYNC), frozenset({1, 2}), subject="reference"),
    Mutant(
        "ref-cross-one-block-short", REF + "managers.py",
        "        return cdiv(self.group.param, self.B)\n",
        "        return cdiv(self.group.param - 1, self.B)\n",
        "the reference allocates the encoder's outputs one token short: a block short "
        "where E % B == 1",
        ("--kind", "cross", *_ASYNC), frozenset({2}), subject="reference"),
    Mutant(
        "ref-failed-load-resumes-late", REF + "scheduler.py",
        "        r.computed = min(r.computed, j * B)\n",
        "        r.computed = min(r.computed, (j + 1) * B)\n",
        "after a failed load, the reference recomputes from one block past the bad one",
        ("--kind", "full", "--prefix-caching", "off", *_CONSUMER),
        frozenset({2}), subject="reference", failed_loads=True),
    Mutant("partial-hit-control", "", "", "", "0.33.0 with finding 9's fix, hits inside a block",
           _PARTIAL, frozenset(), "survives", base=_CHAIN_FIX),
    Mutant(
        "partial-hit-shares-block", CORE + "single_type_kv_cache_manager.py",
        "            len(new_computed_blocks) > 0\n            and num_local_computed_tokens % "
        "self.block_size != 0\n",
        "            False\n            and num_local_computed_tokens % "
        "self.block_size != 0\n",
        "a prefix hit ending inside a block is never copied on write: the request writes its "
        "own positions into the shared block",
        _PARTIAL, frozenset({2}), base=_CHAIN_FIX, min_examples=400, max_events=20),
    Mutant(
        "partial-hit-one-unit-long", CORE + "single_type_kv_cache_manager.py",
        "                hit_length = (fine_idx + 1) * alignment_tokens\n",
        "                hit_length = (fine_idx + 2) * alignment_tokens\n",
        "full attention's hit on a partial entry claims one hash unit past the entry's "
        "boundary",
        _PARTIAL, frozenset({2}), base=_CHAIN_FIX, min_examples=400, max_events=20),
    Mutant(
        "ref-partial-copy-dropped", REF + "scheduler.py",
        "        ), tuple((src, dst) for *_, src, dst in copies)))\n",
        "        ), tuple((src, dst) for *_, src, dst in copies[1:])))\n",
        "the reference hands a step all its queued copies but the first",
        _PARTIAL, frozenset({2}), subject="reference", min_examples=400, max_events=20),
    # property 6 on vLLM: the sync Scheduler beside the reference under settled
    # (the unmodified release at depth 1: tests/test_twin_vllm.py)
    Mutant(
        "sync-window-free-one-block-late", CORE + "kv_cache_manager.py",
        "max(0, total_computed_tokens - request.num_in_flight_tokens),",
        "max(0, total_computed_tokens - (request.num_in_flight_tokens\n"
        "                                            or self.coordinator.scheduler_block_size)),",
        "with nothing in flight (every schedule of the sync Scheduler) allocate_slots frees on "
        "the count one block back: window frees one block late, safe, sync behaviour only",
        ("--kind", "sliding", "--depth", "1"), frozenset({6})),
    # the same slip with prefix caching only, where 0.33.0's retention parts
    # the reference twin in many examples: the settled rule beside the twin
    # judges the events after a part (tests/test_twin_vllm.py)
    Mutant(
        "sync-cached-window-free-one-block-late", CORE + "kv_cache_manager.py",
        "max(0, total_computed_tokens - request.num_in_flight_tokens),",
        "max(0, total_computed_tokens - (request.num_in_flight_tokens\n"
        "                                            or (self.coordinator.scheduler_block_size\n"
        "                                                if self.enable_caching else 0))),",
        "with prefix caching on and nothing in flight allocate_slots frees on the count one "
        "block back: window frees one block late, safe, sync behaviour only",
        ("--kind", "sliding", "--depth", "1", *_PC), frozenset({6})),
    # the same slip where no reference twin runs: Mamba's align mode (prefix
    # caching on), judged by the settled rule over vLLM's own steps
    Mutant(
        "sync-mamba-free-one-block-late", CORE + "kv_cache_manager.py",
        "max(0, total_computed_tokens - request.num_in_flight_tokens),",
        "max(0, total_computed_tokens - (request.num_in_flight_tokens\n"
        "                                            or self.coordinator.scheduler_block_size)),",
        "with nothing in flight allocate_slots frees on the count one block back: Mamba's "
        "align mode retires a state one block late, safe, sync behaviour only",
        ("--kind", "mamba", "--depth", "1", *_PC, "--no-external"), frozenset({6})),
    # a model-based drafter (EAGLE, MTP): vLLM allocates lookahead slots for it
    Mutant(
        "sync-draft-free-lookahead-late", CORE + "kv_cache_manager.py",
        "max(0, total_computed_tokens - request.num_in_flight_tokens),",
        "max(0, total_computed_tokens - (request.num_in_flight_tokens or num_lookahead_tokens)),",
        "with nothing in flight and an EAGLE / MTP drafter allocate_slots holds back the "
        "lookahead tokens too: window frees up to K tokens late, safe, sync behaviour only",
        ("--kind", "sliding", "--drafter", "eagle", "--depth", "1"), frozenset({6})),
    Mutant(
        "sync-mtp-free-lookahead-late", CORE + "kv_cache_manager.py",
        "max(0, total_computed_tokens - request.num_in_flight_tokens),",
        "max(0, total_computed_tokens - (request.num_in_flight_tokens or num_lookahead_tokens)),",
        "the same slip beside MTP's retained tokens and Mamba's align mode (full, draft, "
        "Mamba, and a sliding window where drawn)",
        ("--kind", "hybrid", "--drafter", "mtp", "--depth", "1", *_PC, "--no-external"),
        frozenset({6})),
)



@dataclass
class Row:
    name: str
    why: str
    args: list[str]
    wanted: str  # the outcome this row must have
    expect: list[int]
    outcome: str = ""  # killed | survived | crashed | vacuous | error
    prop: int | None = None
    prop_name: str = ""
    events: int | None = None
    shrunk_events: int | None = None  # before properties/minimize.py: Hypothesis's shrink alone
    seconds: float = 0.0
    message: str = ""
    trace: str = ""

    @property
    def ok(self) -> bool:
        if self.wanted == "survives":
            return self.outcome == "survived"
        if self.wanted == "killed":
            return self.outcome == "killed" and self.prop in self.expect
        return self.outcome == self.wanted


class AnchorError(Exception):
    pass


_REPO_PARTS = ("model", "prove", "properties", "confirm", "report", "impl", "cli", "bench",
               "kvcheck")


def _edit(m: Mutant, dest: Path) -> None:
    text = (dest / m.file).read_text()  # the original through its link, or the base's copy
    n = text.count(m.old)
    if n != 1:
        raise AnchorError(f"mutant {m.name}: its anchor occurs {n} times in {m.file} "
                          f"(expected once); update scripts/mutants.py")
    (dest / m.file).unlink()
    (dest / m.file).write_text(text.replace(m.old, m.new))


def mutant_tree(m: Mutant, dest: Path) -> Path:
    """The tree a mutant runs from, at ``dest``: symlinks to the original files
    except the one the mutant edits, which is a real, edited copy. Subject
    ``vllm``: ``dest/vllm`` is the installed release (``--target vllm@dest``);
    ``reference``: ``dest`` holds this repository's code (run ``dest/kvcheck``)."""
    skip = shutil.ignore_patterns("__pycache__", "*.so")
    if m.subject == "vllm":
        if not (INSTALLED / "__init__.py").is_file():
            raise AnchorError(f"vLLM {RELEASE} is not installed at {INSTALLED}: "
                              f"run make vllm VLLM={RELEASE}")
        shutil.copytree(INSTALLED, dest / "vllm", copy_function=os.symlink, ignore=skip)
        if m.base:
            _apply_base(m, dest)
        if m.file:
            _edit(m, dest / "vllm")
    else:
        dest.mkdir(parents=True)
        for part in _REPO_PARTS:
            if (ROOT / part).is_dir():
                shutil.copytree(ROOT / part, dest / part, copy_function=os.symlink, ignore=skip)
            else:
                os.symlink(ROOT / part, dest / part)
        if m.file:
            _edit(m, dest)
    return dest


def _apply_base(m: Mutant, dest: Path) -> None:
    """Apply the row's base diff (paths ``vllm/...``) to the linked tree."""
    diff = ROOT / m.base
    for f in sorted(set(re.findall(r"^\+\+\+ b/(\S+)", diff.read_text(), re.M))):
        link = dest / f
        text = link.read_text()
        link.unlink()
        link.write_text(text)
    p = subprocess.run(["patch", "-p1", "-s", "-i", str(diff)], cwd=dest,
                       capture_output=True, text=True)
    if p.returncode:
        raise AnchorError(f"mutant {m.name}: {m.base} does not apply: {p.stdout.strip()}")


def run_one(m: Mutant, examples: int, seed: int, out: Path, work: Path) -> Row:
    """Fuzz one mutant (or control) and classify the result."""
    args = [*m.args, *([] if m.failed_loads else ["--no-failed-loads"])]
    row = Row(m.name, m.why, args, m.outcome, sorted(m.expect))
    tree = mutant_tree(m, work / m.name)
    dest = out / m.name
    shutil.rmtree(dest, ignore_errors=True)
    result = (work / f"{m.name}.result.json").absolute()  # the verdict (kvcheck fuzz --json)
    result.unlink(missing_ok=True)
    if m.subject == "vllm":
        cli, target = ROOT / "kvcheck", f"vllm@{tree}"
    else:
        cli, target = tree / "kvcheck", "reference"
    cmd = [sys.executable, str(cli), "fuzz", "--target", target, *row.args,
           "--examples", str(max(examples, m.min_examples)), "--seed", str(seed),
           "--workers", "1", "--quiet",
           "--no-report", "--out", str(dest), "--json", str(result)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, timeout=1800,
                       env=dict(os.environ, KVCHECK_NO_VENV="1"))
    row.seconds = round(time.monotonic() - t0, 1)
    res = json.loads(result.read_text()) if result.is_file() else {}
    verdict = res.get("verdict")  # FuzzResult.verdict; no file: the CLI stopped before a run
    if p.returncode != _EXIT.get(verdict):
        verdict = None  # the exit status and the verdict disagree: an error of the run
    if verdict == "holds":
        row.outcome, row.message = "survived", res["message"]
    elif verdict == "violation":
        row.outcome = "killed"
        row.prop, row.prop_name, row.events = res["property"], res["property_name"], res["events"]
        row.shrunk_events = res["shrunk_events"]
        row.message = res["message"]
    elif verdict == "vacuous":
        row.outcome = "vacuous"
        row.message = f"verdict: VACUOUS ({res['message']})"
    elif verdict == "crashed":
        row.outcome = "crashed"
        row.message = _crash_line(res["crash"].splitlines())
    else:
        lines = (p.stdout + p.stderr).splitlines()
        row.outcome, row.message = "error", " ".join(" ".join(lines).split())[-300:]
    saved = sorted(dest.glob("*.json")) if dest.is_dir() else []
    if saved:  # one trace per row, named after the mutant
        saved[0].rename(dest / f"{m.name}.json")
        row.trace = str(dest / f"{m.name}.json")
    return row


_EXIT = {"holds": 0, "violation": 1, "vacuous": 1, "missed": 1, "crashed": 3}


def _crash_line(lines: list[str]) -> str:
    """The exception and where vLLM raised it, from the run's crash text (its traceback)."""
    frames = [i for i, ln in enumerate(lines) if ln.lstrip().startswith('File "')]
    error = next((ln.strip() for ln in reversed(lines)
                  if re.match(r"\s*\w+(Error|Exception)\b", ln)), "the target crashed")
    if not frames:
        return error
    i = frames[-1]
    where = re.search(r'File "([^"]+)", line (\d+)', lines[i])
    code = lines[i + 1].strip() if i + 1 < len(lines) else ""
    if where is None:
        return error
    return f"{error} at {Path(where.group(1)).name}:{where.group(2)}: {code}"


def lengths(rows: list[Row]) -> str:
    """Median and mean counterexample length over the killed rows, with
    properties/minimize.py after Hypothesis's shrinking and without it."""
    killed = [r for r in rows if r.outcome == "killed" and r.events is not None
              and r.shrunk_events is not None]
    if not killed:
        return "No row was killed: no counterexample lengths."
    mine = [r.events for r in killed]
    hyp = [r.shrunk_events for r in killed]
    return (f"Counterexample length over the {len(killed)} killed rows: with "
            f"properties/minimize.py median {statistics.median(mine)} events (mean "
            f"{statistics.mean(mine):.2f}); Hypothesis's shrinking alone median "
            f"{statistics.median(hyp)} (mean {statistics.mean(hyp):.2f}).")


def render(rows: list[Row], examples: int, seed: int) -> str:
    good = sum(r.ok for r in rows)
    lines = [
        "# Mutants",
        "",
        f"{good}/{len(rows)} rows as expected ({examples} examples per row, seed {seed}; "
        f"each row's fuzz options as run). A row is one edit: "
        f"`vllm` rows edit vLLM {RELEASE}'s own code and fuzz it as `--target vllm@TREE`; "
        f"`ref-` rows edit impl/reference. The `control` rows are the unmodified trees. "
        f"Rebuild a tree to replay a trace: `scripts/mutants.py --tree NAME DIR`.",
        "",
        "| mutant | the slip | fuzzed with | wanted | outcome | property | events "
        "| events, Hypothesis's shrink alone | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        prop = f"{r.prop} ({r.prop_name})" if r.prop else "-"
        lines.append(f"| {r.name} | {r.why} | `{' '.join(r.args)}` | {r.wanted} | "
                     f"{r.outcome}{'' if r.ok else ' **UNEXPECTED**'} | {prop} | "
                     f"{r.events if r.events is not None else '-'} | "
                     f"{r.shrunk_events if r.shrunk_events is not None else '-'} | {r.seconds} |")
    lines += ["", lengths(rows)]
    lines += ["", "## What the checker said", ""]
    lines += [f"- **{r.name}**: {r.message}" for r in rows if r.message]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant names (see --list)")
    ap.add_argument("--subject", choices=["vllm", "reference"],
                    help="only the mutants of this subject")
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reports", default=str(ROOT / "reports"))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--tree", nargs=2, metavar=("NAME", "DIR"),
                    help="only build the mutant's tree in the empty folder DIR, to replay "
                         "its trace (vllm: --target vllm@DIR; reference: DIR/kvcheck)")
    a = ap.parse_args(argv)
    byname = {m.name: m for m in MUTANTS}
    if a.tree:
        name, where = a.tree
        if name not in byname:
            print(f"mutants: unknown mutant {name!r} (see --list)", file=sys.stderr)
            return 2
        if Path(where).exists() and any(Path(where).iterdir()):
            print(f"mutants: {where} is not empty; choose an empty folder", file=sys.stderr)
            return 2
        try:
            print(mutant_tree(byname[name], Path(where)))
        except AnchorError as e:
            print(f"mutants: {e}", file=sys.stderr)
            return 2
        return 0
    if a.list:
        for m in MUTANTS:
            print(f"{m.name:30} {m.subject:9} {m.outcome:9} {m.why}")
        return 0
    names = {n for n in a.only.split(",") if n}
    if names - set(byname):
        print(f"mutants: unknown mutant(s) {', '.join(sorted(names - set(byname)))} "
              f"(see --list)", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if (not names or m.name in names)
              and (a.subject is None or m.subject == a.subject)]
    reports = Path(a.reports)
    out = reports / "mutants"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcheck-mutants-") as tmp:
        for m in chosen:
            try:
                row = run_one(m, a.examples, a.seed, out, Path(tmp))
            except AnchorError as e:
                print(f"mutants: {e}", file=sys.stderr)
                return 2
            rows.append(row)
            print(f"{row.name:30} {row.outcome:9} {'ok ' if row.ok else 'BAD'} "
                  f"{row.seconds:6.1f}s  {row.message[:100]}", flush=True)
    (reports / "mutants.md").write_text(render(rows, a.examples, a.seed))
    (reports / "mutants.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"report: {reports / 'mutants.md'}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
