"""SGLang's real decode-time sliding-window free, driven on CPU.

Run with SGLang on ``sys.path`` (``PYTHONPATH=.sglang/0.5.23``)::

    python -m impl.sglang.probe W PROMPT OUTPUTS [W PROMPT OUTPUTS ...]
    python -m impl.sglang.probe --chunked W PROMPT CHUNK [W PROMPT CHUNK ...]

Chunked: SGLang's own scheduling path for a first prefill chunk over a
``UnifiedRadixCache`` (full + SWA, page size 1, ``device="cpu"``):
``Req.init_next_round_input``, ``PrefillAdder.add_one_req``,
``ScheduleBatch.init_new`` and ``prepare_for_extend`` schedule ``[0, CHUNK)``;
then, as the overlap scheduler's next iteration does with the chunk still
in flight, ``checkpoint_kv_cache`` (``Scheduler.stash_chunked_request``).
One JSON line: ``{"chunk": [0, CHUNK], "freed": [[lo, hi], ...],
"next_chunk": [a, b]}`` (the SWA positions the allocator was handed, and the
chunk the next ``prepare_for_extend`` schedules).

Decode, for each case: a ``Req`` with ``PROMPT`` prompt tokens and ``OUTPUTS``
output tokens (the processed ones), a row of its ``ReqToTokenPool`` filled
with slots from a real ``SWATokenToKVPoolAllocator`` over an ``SWAKVPool``
(page size 1, ``device="cpu"``), then the call ``maybe_evict_swa`` makes for
a decode, ``free_swa_out_of_window_slots(req, req.seqlen - 1, ...)`` without
a prefix-sharing tree. The allocator's ``free_swa_segment`` is wrapped (not
re-derived): the positions it is handed are printed as one JSON line per case,
``{"w": W, "prompt": P, "outputs": O, "freed": [lo, hi]}`` (``[0, 0]``: none).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("SGLANG_SWA_EVICTION_INTERVAL", "1")


def main(argv: list[str]) -> int:
    from impl.sglang.shims import install

    install()
    from array import array

    import torch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    if argv[:1] == ["--chunked"]:
        nums = [int(x) for x in argv[1:]]
        if not nums or len(nums) % 3:
            print("usage: python -m impl.sglang.probe --chunked W PROMPT CHUNK [...]",
                  file=sys.stderr)
            return 2
        for i in range(0, len(nums), 3):
            _chunked(*nums[i:i + 3])
        return 0
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1))
    nums = [int(x) for x in argv]
    if not nums or len(nums) % 3:
        print("usage: python -m impl.sglang.probe W PROMPT OUTPUTS [...]", file=sys.stderr)
        return 2
    for i in range(0, len(nums), 3):
        w, prompt, outputs = nums[i:i + 3]
        size = prompt + outputs + 8
        r2t = ReqToTokenPool(size=2, max_context_len=size, device="cpu",
                             enable_memory_saver=False)
        kv = SWAKVPool(size=size, size_swa=size, page_size=1, dtype=torch.float32,
                       head_num=1, head_dim=4, swa_attention_layer_ids=[0],
                       full_attention_layer_ids=[1], device="cpu")
        alloc = SWATokenToKVPoolAllocator(size=size, size_swa=size, page_size=1,
                                          dtype=torch.float32, device="cpu", kvcache=kv,
                                          need_sort=False)
        req = Req(f"r{i}", "", array("q", range(1, prompt + 1)), SamplingParams())
        req.output_ids.extend(range(prompt + 1, prompt + 1 + outputs))
        r2t.alloc([req])
        n = prompt + outputs
        slots = alloc.alloc(n)
        r2t.req_to_token[req.kv.req_pool_idx, :n] = slots
        req.kv.kv_allocated_len = n
        req.kv.kv_committed_len = n
        freed: list[tuple[int, int]] = []
        real = alloc.free_swa_segment

        def wrapped(free_index, *, start_pos, _real=real, _freed=freed):
            _freed.append((start_pos, start_pos + int(free_index.numel())))
            return _real(free_index, start_pos=start_pos)

        alloc.free_swa_segment = wrapped
        before = alloc.swa_available_size()
        free_swa_out_of_window_slots(
            req, req.seqlen - 1, sliding_window_size=w, page_size=1,
            req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
            supports_prefix_sharing=False, eviction_interval=1)
        lo = freed[0][0] if freed else 0
        hi = freed[-1][1] if freed else 0
        assert alloc.swa_available_size() - before == hi - lo, "the pool did not take them back"
        print(json.dumps({"w": w, "prompt": prompt, "outputs": outputs, "freed": [lo, hi]}),
              flush=True)
    return 0


def _chunked(w: int, prompt: int, chunk: int) -> int:
    import types
    from array import array

    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import checkpoint_kv_cache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    set_global_server_args_for_scheduler(
        ServerArgs(model_path="dummy", page_size=1, chunked_prefill_size=chunk))
    size = 4 * (prompt + 8)
    r2t = ReqToTokenPool(size=4, max_context_len=size, device="cpu", enable_memory_saver=False)
    kv = SWAKVPool(size=size, size_swa=size, page_size=1, dtype=torch.float32, head_num=1,
                   head_dim=4, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                   device="cpu")
    alloc = SWATokenToKVPoolAllocator(size=size, size_swa=size, page_size=1,
                                      dtype=torch.float32, device="cpu", kvcache=kv,
                                      need_sort=False)
    cache = UnifiedRadixCache(params=CacheInitParams(
        req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1, disable=False,
        sliding_window_size=w, tree_components=(ComponentType.FULL, ComponentType.SWA)))
    freed: list[list[int]] = []
    real = alloc.free_swa_segment

    def wrapped(free_index, *, start_pos):
        freed.append([start_pos, start_pos + int(free_index.numel())])
        return real(free_index, start_pos=start_pos)

    alloc.free_swa_segment = wrapped
    model_config = types.SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)
    running = ScheduleBatch(reqs=[], batch_is_full=False)

    def schedule(req, chunked):
        adder = PrefillAdder(1, cache, alloc, running, 0.0, 4 * size, chunk,
                             max_running_requests=4)
        if chunked:
            req.init_next_round_input()
            nxt = adder.add_chunked_req(req)
        else:
            req.init_next_round_input(cache)
            adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            nxt = adder.new_chunked_req
        batch = ScheduleBatch.init_new(adder.can_run_list, r2t, alloc, cache, model_config,
                                       True, SpeculativeAlgorithm.NONE, chunked_req=nxt)
        batch.prepare_for_extend()
        return [batch.prefix_lens[0], int(batch.seq_lens[0])]

    req = Req("r0", "", array("q", range(1, prompt + 1)), SamplingParams(max_new_tokens=4))
    first = schedule(req, chunked=False)
    checkpoint_kv_cache(req, cache)  # the next iteration, the first chunk still in flight
    at_checkpoint = list(freed)
    second = schedule(req, chunked=True)
    print(json.dumps({"chunk": first, "freed": at_checkpoint, "next_chunk": second}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
