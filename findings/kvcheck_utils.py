# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the tests kvcheck exports (``./kvcheck export``), as
tests/v1/core/utils.py is for vLLM's own tests: a scheduler built the way
EngineCore builds one, a KV consumer connector that offers prompt tokens,
requests and model runner outputs.
"""

import json
from typing import Any

import torch

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

OUTPUT_TOKEN = 7  # every sampled token
DRAFT_TOKEN = 9  # every draft token proposed
CONNECTOR = "KvcheckTestConnector"


class Loads(KVConnectorMetadata):
    """A step's loads: per request, the block ids (per KV-cache group) that
    its worker side writes in ``start_load_kv``."""

    def __init__(self, blocks: dict[str, list[list[int]]]):
        self.blocks = blocks


class OfferingConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV consumer offering ``offers[req_id]`` prompt tokens once, loaded
    synchronously in the step that admits the request (its scheduler side
    only: no worker runs here)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict[str, int] = {}
        self.starts: dict[str, int] = {}
        self.loading: dict[str, list[list[int]]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        offered = self.offers.get(request.request_id, 0)
        self.starts[request.request_id] = num_computed_tokens
        return max(0, offered - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.offers.pop(request.request_id, None)
        start = self.starts.pop(request.request_id, 0)
        if num_external_tokens and self._kv_cache_config is not None:
            end, loaded = start + num_external_tokens, []
            groups = self._kv_cache_config.kv_cache_groups
            for ids, group in zip(blocks.get_block_ids(), groups, strict=True):
                size = group.kv_cache_spec.block_size
                loaded.append(list(ids[start // size : -(-end // size)]))
            self.loading[request.request_id] = loaded

    def build_connector_meta(self, scheduler_output):
        meta, self.loading = Loads(self.loading), {}
        return meta

    def request_finished(self, request, block_ids):
        self.offers.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids)

    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None


KVConnectorFactory.register_connector(CONNECTOR, __name__, "OfferingConnector")


# the engine's steps, as kvcheck's driver runs them (impl/vllm/build.py)


def plan_kv_cache(
    vllm_config: Any, layer_specs: dict[str, Any], num_blocks: int
) -> tuple[Any, int, int]:
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
    cacheable = [
        g.kv_cache_spec.block_size
        for g in kvc.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    ]
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


def build_scheduler(
    vllm_config: Any, layer_specs: dict[str, Any], num_blocks: int
) -> Any:
    """The scheduler the engine core builds for these layers."""
    from vllm.v1.structured_output import StructuredOutputManager

    kvc, block_size, hash_block_size = plan_kv_cache(
        vllm_config, layer_specs, num_blocks
    )
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        include_finished_set=False,
        log_stats=False,
    )


def attention(spec_cls, block_size, **kw):
    """An attention layer's spec, as every one here is: one KV head of eight
    float32 values a token (``kw``: the kind's own fields)."""
    return spec_cls(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32, **kw
    )


_LAYER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
DRAFTERS = {  # draft model configs (no weights are loaded)
    "eagle": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_key_value_heads": 1,
        **_LAYER,
    },
    "mtp": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "num_nextn_predict_layers": 2,
        **_LAYER,
    },
}


def build(
    tmp_path,
    layer_specs,
    num_blocks,
    block_size,
    max_num_batched_tokens,
    max_model_len,
    max_num_seqs=4,
    async_scheduling=False,
    prefix_caching=False,
    load_failure_policy=None,
    mamba_cache_mode="none",
    pipeline_parallel_size=1,
    prefix_match_unit=None,
    num_speculative_tokens=0,
    drafter="ngram",
):
    """The scheduler of a tiny OPT config with these layers (no weights are
    loaded), and a function making its requests; ``load_failure_policy``:
    with the KV consumer connector, failed loads handled that way;
    ``mamba_cache_mode``: "align" for Mamba layers with a state per block;
    ``pipeline_parallel_size``: with async scheduling, one batch more than it
    in flight; ``prefix_match_unit``: prefix hits at that many tokens inside a
    block; ``num_speculative_tokens``: a drafter proposing that many drafts a
    step, ``drafter``: "ngram", "eagle" (a one-layer EAGLE head) or "mtp" (a
    DeepSeek-V3 config with two MTP modules); an EAGLE or MTP drafter's
    attention layer is ``layer_specs["draft"]``, its spec with
    ``is_draft=True``."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["OPTForCausalLM"],
                "model_type": "opt",
                "hidden_size": 64,
                "ffn_dim": 128,
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 32000,
                "max_position_embeddings": 131072,
                "word_embed_proj_dim": 64,
            }
        )
    )
    kv_transfer = None
    if load_failure_policy is not None:
        kv_transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_role="kv_consumer",
            kv_load_failure_policy=load_failure_policy,
        )
    cache = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        mamba_cache_mode=mamba_cache_mode,
    )
    if prefix_match_unit:
        cache.prefix_match_unit = prefix_match_unit
    model_config = ModelConfig(
        model=str(tmp_path), skip_tokenizer_init=True, max_model_len=max_model_len
    )
    parallel = ParallelConfig(pipeline_parallel_size=pipeline_parallel_size)
    speculative = None
    if num_speculative_tokens and drafter != "ngram":
        draft = tmp_path / "draft"
        draft.mkdir()
        (draft / "config.json").write_text(json.dumps(DRAFTERS[drafter]))
        speculative = SpeculativeConfig(
            method=drafter,
            model=str(draft),
            num_speculative_tokens=num_speculative_tokens,
            target_model_config=model_config,
            target_parallel_config=parallel,
        )
    elif num_speculative_tokens:
        speculative = SpeculativeConfig(
            method="ngram_gpu",
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_min=1,
            prompt_lookup_max=3,
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            async_scheduling=async_scheduling,
        ),
        kv_transfer_config=kv_transfer,
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative,
        parallel_config=parallel,
    )
    scheduler = build_scheduler(vllm_config, layer_specs, num_blocks)
    hasher = None
    if prefix_caching or kv_transfer is not None:
        fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        kv_cache_utils.init_none_hash(fn)
        hasher = kv_cache_utils.get_request_block_hasher(  # as EngineCore makes it
            scheduler.kv_cache_config.hash_block_size,
            fn,
            vllm_config.num_hash_lookahead_tokens,
        )

    def request(req_id, num_prompt_tokens, max_tokens, variant=0):
        tokens = list(range(100, 100 + num_prompt_tokens))
        if variant:  # prompts of one variant share every prefix
            tokens[variant - 1] = variant
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(req_id, tokens, params, None, block_hasher=hasher)

    return scheduler, request


def output(scheduler_output, sampled, failed=()):
    """What the model runner returns for a step: ``sampled[req_id]`` tokens
    for each request (none where absent), ``failed``: the blocks whose
    connector load failed."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    failed_loads = KVConnectorOutput(invalid_block_ids=set(failed)) if failed else None
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[OUTPUT_TOKEN] * sampled.get(r, 0) for r in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=failed_loads,
    )


def worker_block_ids(scheduler_outputs, req_id):
    """The block ids the model runner holds for ``req_id`` after these
    scheduler outputs, per group, as it keeps them: a new or resumed
    request's ids replace its table, a running one's new ids are appended."""
    table = None
    for out in scheduler_outputs:
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                table = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        if req_id in cached.req_ids:
            ids = cached.new_block_ids[cached.req_ids.index(req_id)]
            if req_id in cached.resumed_req_ids:
                table = [list(x) for x in ids]
            elif ids is not None:
                for held, more in zip(table, ids, strict=True):
                    held.extend(more)
    return table


def propose(scheduler, req_ids):
    """The drafter's proposals on a step's output (synchronous scheduling:
    the engine hands them to the scheduler after ``update_from_output``)."""
    k = scheduler.num_spec_tokens
    scheduler.update_draft_token_ids(
        DraftTokenIds(list(req_ids), [[DRAFT_TOKEN] * k for _ in req_ids])
    )


def reset_prefix_cache(scheduler):
    """The engine's utility call (vLLM's ``/reset_prefix_cache`` endpoint with
    ``reset_running_requests``): every running request is preempted, then the
    cache is reset. It raises where blocks are still held (a step in flight);
    the engine returns that error to the caller and goes on."""
    try:
        scheduler.reset_prefix_cache(reset_running_requests=True)
    except RuntimeError as e:
        if "Failed to reset KV cache" not in str(e):
            raise
