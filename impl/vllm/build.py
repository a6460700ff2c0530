"""The scheduler built as vLLM's engine builds it, in one place.

:func:`plan_kv_cache` and :func:`build_scheduler` follow
``EngineCore._initialize_kv_caches`` and ``EngineCore.__init__`` of vLLM
0.33 step by step, from the layers' specs (what the model runner's
``get_kv_cache_specs`` returns) to the scheduler::

    register_all_kvcache_specs, resolve_kv_cache_layout,
    get_global_kv_cache_groups, get_kv_cache_configs    (the planner)
    generate_scheduler_kv_cache_config                   (the scheduler's copy)
    cache_config.block_size = min(prefix-cacheable group blocks),
    update_kv_cache_capacity, validate_block_size        (the block-size update)
    resolve_kv_cache_block_sizes,
    resolve_cache_hit_alignment_tokens                   (scheduler / hash blocks)
    scheduler_config.get_scheduler_cls()(...)            (Scheduler or AsyncScheduler)

The driver (``impl/vllm/driver.py``, through ``compat.plan_kv_cache``) runs
these functions; the exporter writes their source into each vLLM-style test
(``impl/vllm/export.py``), so a test builds its scheduler exactly as the
checker did. They speak vLLM 0.33's API and use its public functions only;
older releases plan through ``compat``. What is not the engine's: the pool
size is given (``num_gpu_blocks_override``, as ``--num-gpu-blocks-override``
does) instead of measured, and the hybrid KV-cache manager is on where
CUDA would keep it on (vLLM's CPU platform turns it off; on CUDA a KV
connector without HMA support turns it off).
"""

from __future__ import annotations

from typing import Any


def plan_kv_cache(vllm_config: Any, layer_specs: dict[str, Any],
                  num_blocks: int) -> tuple[Any, int, int]:
    """The scheduler's KV-cache config, block size and hash block size."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    vc, specs = vllm_config, [dict(layer_specs)]
    vc.cache_config.num_gpu_blocks_override = num_blocks
    vc.scheduler_config.disable_hybrid_kv_cache_manager = not hma_as_on_cuda(vc)
    register_all_kvcache_specs(vc)
    resolve_kv_cache_layout(vc, [["NHD"]], list(layer_specs.values()))
    groups = planning.get_global_kv_cache_groups(vc, specs)
    configs = planning.get_kv_cache_configs(vc, specs, [1 << 40], groups)
    for c in configs:
        c.kv_cache_layout = vc.cache_config.kv_cache_layout
    kvc = kcu.generate_scheduler_kv_cache_config(configs)
    vc.cache_config.num_gpu_blocks = kvc.num_blocks
    sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
    cacheable = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups
                 if g.kv_cache_spec.prefix_cacheable]
    vc.cache_config.block_size = min(cacheable or sizes)
    kcu.update_kv_cache_capacity(vc, kvc)
    vc.validate_block_size()
    block_size, hash_block_size = kcu.resolve_kv_cache_block_sizes(kvc, vc)
    align = kcu.resolve_cache_hit_alignment_tokens(kvc, vc, block_size, hash_block_size)
    kvc.hash_block_size, kvc.cache_hit_alignment_tokens = hash_block_size, align
    return kvc, block_size, hash_block_size


def hma_as_on_cuda(vllm_config: Any) -> bool:
    """Whether VllmConfig would keep the hybrid KV-cache manager on a GPU:
    on, unless the KV connector configured does not support it (vLLM's CPU
    platform turns it off always)."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None or ktc.kv_connector is None:
        return True
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return bool(KVConnectorFactory.supports_hma_config(ktc))


def replan(vllm_config: Any, kvc: Any, num_blocks: int) -> None:
    """What :func:`plan_kv_cache` writes on the VllmConfig, written again for
    a plan made before (the driver plans a layout once and reuses it)."""
    from vllm.v1.core import kv_cache_utils as kcu

    vc = vllm_config
    vc.cache_config.num_gpu_blocks_override = num_blocks
    vc.scheduler_config.disable_hybrid_kv_cache_manager = not hma_as_on_cuda(vc)
    vc.cache_config.num_gpu_blocks = kvc.num_blocks
    sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
    cacheable = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups
                 if g.kv_cache_spec.prefix_cacheable]
    vc.cache_config.block_size = min(cacheable or sizes)
    kcu.update_kv_cache_capacity(vc, kvc)


def build_scheduler(vllm_config: Any, layer_specs: dict[str, Any], num_blocks: int) -> Any:
    """The scheduler the engine core builds for these layers."""
    from vllm.v1.structured_output import StructuredOutputManager

    kvc, block_size, hash_block_size = plan_kv_cache(vllm_config, layer_specs, num_blocks)
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(vllm_config=vllm_config, kv_cache_config=kvc,
                         structured_output_manager=StructuredOutputManager(vllm_config),
                         block_size=block_size, hash_block_size=hash_block_size,
                         include_finished_set=False, log_stats=False)


def engine_built(planning: Any) -> bool:
    """Whether a release's planner is the one these functions call (0.33)."""
    from vllm.v1.core import kv_cache_utils as kcu

    return all(hasattr(planning, n) for n in ("get_global_kv_cache_groups",
                                             "get_kv_cache_configs")) and all(
        hasattr(kcu, n) for n in ("generate_scheduler_kv_cache_config",
                                  "update_kv_cache_capacity", "resolve_kv_cache_block_sizes",
                                  "resolve_cache_hit_alignment_tokens"))
