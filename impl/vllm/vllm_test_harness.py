"""``kvcheck_replay.py``: the helpers of the tests ``./kvcheck export`` writes in
the replaying form (``--form replaying``, and what the step form does not
state yet). Each such test holds a trace's ``CONFIG`` and ``EVENTS`` and runs
them through :class:`Replay`; this module is written beside it, the same for
every test, and needs vLLM (0.33 line) and pytest, not kvcheck. kvcheck
writes it from ``impl/vllm/vllm_test_harness.py`` and never imports it.

It builds the scheduler the way vLLM's own unit tests do (``VllmConfig`` of
``ModelConfig`` / ``SchedulerConfig`` / ``CacheConfig`` / ``KVTransferConfig``,
a test KV connector registered with ``KVConnectorFactory`` under this module's
name, the KV-cache layout from vLLM's planner as the engine core plans it),
replays the events through ``schedule()`` / ``update_from_output()`` and keeps,
for every slot of every block, which token prefix's KV it holds (the block
copies a step hands the worker, ``kv_cache_block_copies``, run before its
forward as the worker runs them: every source read before any destination is
written). A rejected draft's position holds the draft's KV until computed
again, and a step in flight behind the rejection computes its positions
shifted down, as async spec decoding corrects them. With drafts a Mamba
group's states live in the worker's slots: the model runner's block table,
kept from each ``SchedulerOutput`` as the runner keeps it (append-only), where
a step writes its running state and one state per draft from the slot of its
last position on, the postprocess copies an accepted block-edge state into the
slot of the block it closes, and the next step starts from the slot its
acceptance picks. It asserts property 2 on vLLM's own objects: every position
a scheduled step reads below its start, through the block table
``schedule()`` handed out (a drafted Mamba state: through the worker's
table), holds KV written for the request's own tokens (not the NULL block,
not a block a failed load left without KV, not another prefix's KV), a
drafted Mamba step writes its states into blocks of their own, and the output
of a step that read KV a failed load never delivered does not count. A
closing ``drain`` asserts property 7: run as the engine loop runs, every
request finishes, and ``schedule()`` never schedules nothing more than
``depth`` times in a row with nothing in flight while one waits. A crash
inside vLLM fails the test with vLLM's own traceback.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from pathlib import Path
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
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core import kv_cache_planning, kv_cache_utils
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

OUTPUT_TOKEN = 7  # every sampled token
DRAFT_TOKEN = 9  # drafts proposed at depth 1 (async drafts are placeholders)
CONNECTOR = "OfferingTestConnector"
# a tiny OPT (no weights are loaded: only its config is read)
MODEL_CONFIG = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64,
    "ffn_dim": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 32000,
    "max_position_embeddings": 131072, "word_embed_proj_dim": 64,
    "do_layer_norm_before": True, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
    "torch_dtype": "float32",
}
# an EAGLE draft model's config (one Llama layer)
EAGLE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
    "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    "rope_theta": 10000.0,
}
# a multi-module MTP drafter's config (DeepSeek-V3, two MTP modules)
MTP_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_hidden_layers": 1, "first_k_dense_replace": 1,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 8, "num_nextn_predict_layers": 2,
    "vocab_size": 32000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "rope_theta": 10000.0,
}
FAILED = ("failed load",)  # what a slot holds after a failed load into it
EMPTY_COPY = ("empty copy",)  # a copy's destination whose source held nothing
REJECTED = ("rejected",)  # a draft position whose output was rejected
SHIFTED = ("shifted",)  # a position a step was to write before a rejection shifted it


@dataclasses.dataclass
class OfferingMetadata(KVConnectorMetadata):
    loads: dict[str, int]  # request id -> external tokens loaded in this step


class OfferingTestConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV consumer that offers a request's first ``offers[id]`` prompt tokens
    once, loaded synchronously in the step that admits the request. Its load
    failures are reported by the test, in ``KVConnectorOutput.invalid_block_ids``,
    as a worker-side connector reports them."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict[str, int] = {}
        self._loads: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return max(0, self.offers.get(request.request_id, 0) - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if self.offers.pop(request.request_id, None) is not None and num_external_tokens:
            self._loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> OfferingMetadata:
        meta, self._loads = OfferingMetadata(loads=self._loads), {}
        return meta

    def request_finished(self, request: Any, block_ids: Any):
        self.offers.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        return self.request_finished(request, block_ids)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


KVConnectorFactory.register_connector(CONNECTOR, __name__, CONNECTOR)


def _layer_spec(kind: str, param: int, cfg: dict, pad: bool) -> Any:
    common = dict(block_size=cfg["block_size"], num_kv_heads=1, head_size=8,
                  dtype=torch.float32)
    if kind == "full":
        return kvi.FullAttentionSpec(**common)
    if kind == "sliding":
        return kvi.SlidingWindowSpec(**common, sliding_window=param)
    if kind == "chunked_local":
        return kvi.ChunkedLocalAttentionSpec(**common, attention_chunk_size=param)
    if kind == "rswa":
        return kvi.RSWASpec(**common, rswa_window=param)
    if kind == "sink":
        return kvi.SinkFullAttentionSpec(**common, sink_len=param)
    assert kind == "mamba", kind
    page = kvi.FullAttentionSpec(**common).page_size_bytes if pad else None
    # a state block per draft token (MambaBase.get_kv_cache_spec)
    return kvi.MambaSpec(block_size=cfg["block_size"], shapes=((8,),), dtypes=(torch.float32,),
                         mamba_cache_mode="align", page_size_padded=page,
                         num_speculative_blocks=cfg["spec_tokens"])


def make_scheduler(cfg: dict, tmp: Path) -> tuple[Any, Any]:
    """The scheduler of ``cfg`` (one layer per KV-cache group, and an EAGLE or
    MTP draft layer beside the first where no group is the drafter's, planned
    by vLLM's own planner) and the engine core's request block hasher."""
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps(MODEL_CONFIG))
    depth, kinds = cfg["depth"], [g["kind"] for g in cfg["groups"]]
    async_, pp = depth > 1, max(1, depth - 1)
    model = ModelConfig(model=str(tmp / "model"), skip_tokenizer_init=True,
                        max_model_len=cfg["max_model_len"])
    # prefix_match_unit: hashes (and hits) every that many tokens, inside a block
    cache = CacheConfig(block_size=cfg["block_size"],
                        enable_prefix_caching=cfg["prefix_caching"],
                        prefix_match_unit=cfg.get("prefix_match_unit"))
    if "mamba" in kinds:
        cache.mamba_cache_mode = "align"
    parallel = ParallelConfig(pipeline_parallel_size=pp)
    kw: dict[str, Any] = {}
    drafter = cfg.get("drafter", "ngram") if cfg["spec_tokens"] else None
    if drafter in ("eagle", "mtp"):  # SpeculativeConfig reads the drafter's config
        (tmp / drafter).mkdir()
        (tmp / drafter / "config.json").write_text(
            json.dumps(EAGLE_CONFIG if drafter == "eagle" else MTP_CONFIG))
        kw["speculative_config"] = SpeculativeConfig(
            method=drafter, model=str(tmp / drafter), num_speculative_tokens=cfg["spec_tokens"],
            target_model_config=model, target_parallel_config=parallel)
    elif cfg["spec_tokens"]:
        kw["speculative_config"] = SpeculativeConfig(
            method="ngram_gpu", num_speculative_tokens=cfg["spec_tokens"],
            prompt_lookup_min=1, prompt_lookup_max=3)
    if cfg["hazard"] == "unordered":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR, kv_role="kv_consumer",
            kv_load_failure_policy=cfg.get("kv_load_failure_policy", "recompute"))
    vc = VllmConfig(
        model_config=model, cache_config=cache, parallel_config=parallel,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            max_num_seqs=cfg["max_num_seqs"], max_model_len=cfg["max_model_len"],
            is_encoder_decoder=False, enable_chunked_prefill=True, async_scheduling=async_),
        device_config=DeviceConfig(device="cpu"), **kw)
    assert vc.max_concurrent_batches == depth, vc.max_concurrent_batches
    pad = "mamba" in kinds and len(kinds) > 1
    specs = {f"layer{i}": _layer_spec(g["kind"], g.get("param", 0), cfg, pad)
             for i, g in enumerate(cfg["groups"])}
    # a drafter's layer stated as a group: vLLM plans it apart (is_draft)
    specs = {("draft" if g.get("draft") else name):
             (dataclasses.replace(spec, is_draft=True) if g.get("draft") else spec)
             for (name, spec), g in zip(specs.items(), cfg["groups"], strict=True)}
    want = [(name,) for name in specs]
    if drafter in ("eagle", "mtp") and "draft" not in specs:
        specs["draft"] = dataclasses.replace(specs["layer0"], is_draft=True)
        want[0] = ("layer0", "draft")
    # as the engine core plans it, on a device with the hybrid manager on
    cache.num_gpu_blocks_override = cfg["num_blocks"]
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    resolve_kv_cache_layout(vc, [["NHD"]], list(specs.values()))
    groups = kv_cache_planning.get_global_kv_cache_groups(vc, [specs])
    kvc = kv_cache_planning.get_kv_cache_configs(vc, [specs], [1 << 40], groups)[0]
    assert [tuple(g.layer_names) for g in kvc.kv_cache_groups] == want, kvc.kv_cache_groups
    resolve = getattr(kv_cache_planning, "resolve_kv_cache_block_sizes", None) or \
        kv_cache_utils.resolve_kv_cache_block_sizes
    block_size, hash_block_size = resolve(kvc, vc)
    kvc.hash_block_size = hash_block_size
    kvc.cache_hit_alignment_tokens = kv_cache_utils.resolve_cache_hit_alignment_tokens(
        kvc, vc, block_size, hash_block_size)
    assert kvc.num_blocks == cfg["num_blocks"] and block_size == cfg["block_size"]
    cache.num_gpu_blocks = kvc.num_blocks
    cls = AsyncScheduler if async_ else Scheduler
    sched = cls(vllm_config=vc, kv_cache_config=kvc, log_stats=False,
                structured_output_manager=StructuredOutputManager(vc),
                block_size=block_size, hash_block_size=hash_block_size)
    hasher = None
    if cfg["prefix_caching"] or cfg["hazard"] == "unordered":
        fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        kv_cache_utils.init_none_hash(fn)
        hasher = kv_cache_utils.get_request_block_hasher(
            hash_block_size, fn, vc.num_hash_lookahead_tokens)
    return sched, hasher


@dataclasses.dataclass
class Part:
    """One request's share of a scheduled step."""

    rid: str
    start: int  # first computed position
    end: int
    spec: int  # draft tokens among [start, end)
    loaded: int  # connector-loaded positions [start - loaded, start)
    tables: tuple  # per group: block ids, as schedule() handed them out
    reads: list  # (block id, offset) slots read below start
    samples: bool
    rows: tuple = ()  # per group: the worker's block table (Mamba slots, with drafts)
    shift: int = 0  # positions a rejection of an earlier step moved it down by
    prev: Any = None  # the request's step before it (Mamba slots)
    acc: int | None = None  # drafts accepted, once its output counted
    dead: bool = False  # its output never counts (the request stopped running)


@dataclasses.dataclass
class Step:
    n: int
    output: Any
    parts: dict
    failed: dict = dataclasses.field(default_factory=dict)  # rid -> first bad block


class Replay:
    """Replays kvcheck events on ``sched`` and checks every read."""

    def __init__(self, cfg: dict, sched: Any, hasher: Any) -> None:
        self.cfg, self.sched, self.hasher, self.B = cfg, sched, hasher, cfg["block_size"]
        self.kinds = [(g["kind"], g.get("param", 0)) for g in cfg["groups"]]
        self.eagle = bool(cfg["spec_tokens"]) and cfg.get("drafter") == "eagle"
        # the group holding an EAGLE / MTP drafter's KV: its own, else the first
        self.lookahead = next((i for i, g in enumerate(cfg["groups"]) if g.get("draft")), 0) \
            if cfg["spec_tokens"] and cfg.get("drafter") in ("eagle", "mtp") else None
        # with drafts a Mamba group's states live in the worker's slots
        self.slots = bool(cfg["spec_tokens"]) and any(k == "mamba" for k, _ in self.kinds)
        self.rows: dict[str, list[list[int]]] = {}  # rid -> the worker's block table
        self.last: dict[str, Part] = {}  # rid -> its latest step (Mamba slots)
        self.state_at: dict[int, tuple[int, str]] = {}  # block -> (state after, how)
        self.max_new: dict[str, int] = {}
        self.chunk: dict[str, tuple[int, int, int]] = {}  # rid -> its last (step, start, end)
        mgr = sched.kv_cache_manager
        self.managers = list(mgr.coordinator.single_type_managers)
        self.null = mgr.block_pool.null_block.block_id
        self.connector = getattr(sched, "connector", None)
        self.reqs: dict[str, Any] = {}
        self.tokens: dict[str, list[int]] = {}
        self.keys: dict[str, list[Any]] = {}
        self.prompt_len: dict[str, int] = {}
        self.content: dict[tuple[int, int], tuple] = {}  # slot -> (key, step, rid) or a mark
        self.tables: dict[str, list[list[int]]] = {}  # what each holder was last handed
        self.pending: deque[Step] = deque()
        self.garbage: dict[tuple[int, str], str] = {}  # (step, rid) -> what it read
        self.queued: list[tuple] = []
        self.copies: list[tuple[int, int]] = []  # handed out with steps that ran nothing
        self.ran: list[tuple[int, int, int]] = []  # (step, src, dst): copies run, in flight
        self.steps = 0
        for kind, param in self.kinds:
            if kind == "sink":
                for b in range(1, 1 + param // self.B):
                    for off in range(self.B):
                        self.content[(b, off)] = (("sink", (b - 1) * self.B + off), -1, "")

    # ------------------------------------------------------------ events

    def run(self, events: list) -> str | None:
        """Replay ``events``; the first property that fails, said in a line
        (None: every step held). A crash inside vLLM raises, with its own
        traceback."""
        try:
            for ev in events:
                getattr(self, "ev_" + ev[0])(*ev[1:])
        except AssertionError as e:
            return str(e)
        return None

    def ev_add(self, rid: str, prompt: list, max_new: int, external: int) -> None:
        req = Request(request_id=rid, prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=max_new, ignore_eos=True),
                      pooling_params=None, arrival_time=float(len(self.reqs) + 1),
                      block_hasher=self.hasher)
        # drafts may be scheduled past the last token (their output is cut off)
        toks = list(prompt) + [OUTPUT_TOKEN] * (max_new + self.cfg["spec_tokens"] + 1)
        keys, h = [], None
        for t in toks:
            h = hash((h, t))
            keys.append(h)
        self.reqs[rid], self.tokens[rid], self.keys[rid] = req, toks, keys
        self.prompt_len[rid], self.max_new[rid] = len(prompt), max_new
        if external:
            self.connector.offers[rid] = external
        self.sched.add_request(req)

    def _key(self, rid: str, g: int, q: int) -> Any:
        keys = self.keys[rid]
        if g == self.lookahead:  # the draft layer's KV at q is built with token q + 1
            return keys[min(q + 1, len(keys) - 1)]
        return keys[q]

    def _window(self, rid: str, g: int, a: int) -> list[int]:
        """Positions below ``a`` that positions ``a, a+1, ...`` of group ``g`` read."""
        kind, p = self.kinds[g]
        if kind == "sliding":
            return list(range(max(0, a - p + 1), a))
        if kind == "chunked_local":
            return list(range(a // p * p, a))
        if kind == "mamba":
            return [a - 1] if a else []
        if kind == "rswa":
            n = self.prompt_len[rid]
            return sorted(set(range(min(n, a))) | set(range(max(0, a - p + 1), a)))
        return list(range(a))  # full, sink

    def _slot(self, g: int, q: int) -> tuple[int, int]:
        """(logical block, offset) of position q's KV (a Mamba state: the block
        of the state after q, one per block)."""
        return q // self.B, 0 if self.kinds[g][0] == "mamba" else q % self.B

    def ev_schedule(self) -> None:
        out = self.sched.schedule()
        if self.slots:
            self._worker_rows(out)
        self._forget_released()
        # the block copies the worker runs before this step's forward
        self.copies += [(c.src_block_id, c.dst_block_id)
                        for c in getattr(out, "kv_cache_block_copies", None) or ()]
        n, self.steps = self.steps, self.steps + 1
        if not out.total_num_scheduled_tokens:  # queued too, as the engine does
            self.pending.append(Step(n, out, {}))
            return
        loads = getattr(getattr(out, "kv_connector_metadata", None), "loads", None) or {}
        parts = {}
        for rid, k in out.num_scheduled_tokens.items():
            r = self.reqs[rid]
            end = r.num_computed_tokens
            tables = tuple(tuple(b.block_id for b in m.req_to_blocks.get(rid, ()))
                           for m in self.managers)
            parts[rid] = Part(rid, end - k, end, len(out.scheduled_spec_decode_tokens.get(rid, ())),
                              loads.get(rid, 0), tables, [], not r.is_prefill_chunk,
                              tuple(map(tuple, self.rows.get(rid, ()))))
            self.chunk[rid] = (n, end - k, end)
        # blocks handed out afresh hold nothing; a prefix hit keeps what it holds
        for part in parts.values():
            old = self.tables.get(part.rid)
            hit = part.start - part.loaded if old is None else 0
            for g, tab in enumerate(part.tables):
                before = old[g] if old else []
                # (a Mamba block the scheduler moves between slots stays its own)
                moves = self.slots and self.kinds[g][0] == "mamba"
                for i, b in enumerate(tab):
                    if b != self.null and (i >= len(before) or before[i] != b) \
                            and not (moves and b in before) and not i * self.B < hit:
                        for off in range(self.B):
                            self.content.pop((b, off), None)
            self.tables[part.rid] = [list(t) for t in part.tables]
        self._run_copies(n)
        # every write of the step lands before any read (each layer writes, then
        # attends); a Mamba chunk reads the state before it and writes its own
        # after, in place when both lie in one block (a hit inside a block)
        for part in parts.values():
            self._write(n, part, states=False)
        for part in parts.values():
            self._check_reads(n, part)
        for part in parts.values():
            self._write(n, part, states=True)
        for part in parts.values() if self.slots else ():
            part.prev, self.last[part.rid] = self.last.get(part.rid), part
            if not any(part.rid in st.parts for st in self.pending):
                self._run_states(n, part, "scheduled")  # else once the one before is processed
        self.pending.append(Step(n, out, parts))

    def _write(self, n: int, part: Part, states: bool) -> None:
        """The KV ``part`` writes (its loaded and computed positions), or with
        ``states`` the Mamba state it computes (after its last position)."""
        for g, tab in enumerate(part.tables):
            kind = self.kinds[g][0]
            if kind == "mamba" and self.slots:
                continue  # _run_states
            written = range(part.start - part.loaded, part.end)
            if kind == "mamba":  # a state per chunk: after its last position
                written = [q for q in (part.start - 1, part.end - 1)
                           if q >= part.start - part.loaded and q >= 0
                           and (q >= part.start) == states]
            elif states:
                continue
            for q in written:
                i, off = self._slot(g, q)
                if q < part.start and (i >= len(tab) or tab[i] == self.null):
                    continue  # a load skips the blocks outside the window
                assert i < len(tab) and tab[i] != self.null, (
                    f"property 2 (null-read): step {n} (scheduled) computes {part.rid} "
                    f"positions [{part.start}, {part.end}); position {q} ({kind}) reads "
                    f"its own KV, but logical block {i} maps to the NULL block")
                self.content[(tab[i], off)] = (self._key(part.rid, g, q), n, part.rid)

    def _check_reads(self, n: int, part: Part, when: str = "scheduled") -> None:
        for g, tab in enumerate(part.tables):
            kind, param = self.kinds[g]
            if kind == "mamba" and self.slots:
                continue  # _run_states
            where = f"step {n} ({when}) computes {part.rid} positions [{part.start}, {part.end})"
            if kind == "sink":
                for b in range(1, 1 + param // self.B):
                    for off in range(self.B):
                        held = self.content.get((b, off))
                        assert held is not None and held[0] == ("sink", (b - 1) * self.B + off), (
                            f"property 2 (null-read): {where}; every position reads the sink "
                            f"(sink({param}), physical blocks 1..{param // self.B}) but block "
                            f"{b} holds, at sink token {(b - 1) * self.B + off}, "
                            f"{self._what(held)}")
            window = self._window(part.rid, g, part.start)
            span = f"[{window[0]}, {part.start}]" if window else ""
            for q in window:
                i, off = self._slot(g, q)
                assert i < len(tab), (
                    f"property 2 (null-read): {where}; position {part.start} reads {span} "
                    f"({kind}) but logical block {i} is not in its block table")
                b = tab[i]
                assert b != self.null, (
                    f"property 2 (null-read): {where}; position {part.start} reads {span} "
                    f"({kind}) but logical block {i} maps to the NULL block")
                part.reads.append((b, off))
                held = self.content.get((b, off))
                want = self._key(part.rid, g, q)
                assert held is not None and held[0] == want, (
                    f"property 2 (null-read): {where}; position {part.start} reads {span} "
                    f"({kind}) but block {b} (logical {i}) holds, at position {q}, "
                    f"{self._what(held)}, not {part.rid}'s KV of position {q}"
                    + (f" (its {'EAGLE' if self.eagle else 'MTP'} draft KV is built with the "
                       f"next token)" if g == self.lookahead else ""))

    def _run_copies(self, n: int) -> None:
        """The copies of a prefix hit ending inside a block (into the request's
        private block) and of Mamba's partial states (into the block that keeps
        the cache entry), run by the worker as one gather and one scatter
        (``copy_kv_cache_blocks_inplace``: ``blocks[dst] = blocks[src]``): every
        destination, a block handed out afresh, gets what its source held
        before any of them was written."""
        copies, self.copies = self.copies, []
        for _, dst in copies:
            for off in range(self.B):
                self.content.pop((dst, off), None)
        got = [(src, dst, [self.content.get((src, off)) for off in range(self.B)])
               for src, dst in copies]
        for src, dst, held in got:
            for off, h in enumerate(held):
                self.content[(dst, off)] = h if h is not None else (EMPTY_COPY, n, src)
        self.ran += [(n, src, dst) for src, dst in copies]

    @staticmethod
    def _what(held: Any) -> str:
        if held is None:
            return "nothing written since the block was handed out"
        if held[0] == EMPTY_COPY:
            return (f"no KV: it is a copy of block {held[2]}, which held nothing when the "
                    f"copies before step {held[1]} ran (a block handed out afresh, or one "
                    f"another copy of the same step was to fill)")
        if held[0] == REJECTED:
            return f"the KV of a draft step {held[1]} computed for {held[2]}, rejected"
        if held[0] == SHIFTED:
            return (f"no KV: step {held[1]} was to write it for {held[2]} but a rejection "
                    f"shifted it down")
        if held[0] == FAILED:
            return f"no valid KV: a connector load into it failed (step {held[1]}, {held[2]})"
        if isinstance(held[0], tuple) and held[0][0] == "sink":
            return f"the sink token {held[0][1]}"
        return f"KV of another token prefix (written by step {held[1]} for {held[2]})"

    def _hold_for_engine(self, ev: tuple) -> bool:
        """At depth 1 the engine ends a request only between a step and its
        output: such an event waits for the next update_from_output."""
        if self.cfg["depth"] == 1 and self.pending:
            self.queued.append(ev)
            return True
        return False

    def ev_reset(self) -> None:
        """The engine's reset_prefix_cache(reset_running_requests=True),
        taken between two steps of its loop; it raises where blocks are still
        held, and the engine goes on."""
        assert len(self.pending) < self.cfg["depth"], "a utility call with the queue full"
        try:
            self.sched.reset_prefix_cache(reset_running_requests=True)
        except RuntimeError as e:
            if "Failed to reset KV cache" not in str(e):
                raise
        self._forget_released()

    def ev_finish(self, rid: str) -> None:
        if not self._hold_for_engine(("finish", rid)):
            self._end(rid, RequestStatus.FINISHED_STOPPED)

    def ev_abort(self, rid: str) -> None:
        if not self._hold_for_engine(("abort", rid)):
            self._end(rid, RequestStatus.FINISHED_ABORTED)

    def _end(self, rid: str, status: Any) -> None:
        r = self.sched.requests.get(rid)
        if r is not None and not r.is_finished():
            self.sched.finish_requests(rid, status)
        self._forget_released()

    def ev_fail_load(self, rid: str, k: int) -> None:
        for step in self.pending:
            part = step.parts.get(rid)
            if part is not None and part.loaded and \
                    part.start - part.loaded <= k * self.B < part.start:
                step.failed[rid] = min(k, step.failed.get(rid, k))
                return
        raise AssertionError(f"{rid} has no load in flight covering block {k}")

    def ev_process(self, accepted: dict) -> None:
        step = self.pending.popleft()
        out = step.output
        rids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in rids:
            part = step.parts[rid]
            a = min(accepted.get(rid, part.spec), part.spec)
            sampled.append([OUTPUT_TOKEN] * (1 + a) if part.samples else [])
        bad = set()
        for rid, k in step.failed.items():  # the loaded blocks from the first bad one on
            part = step.parts[rid]
            tab = part.tables[0]
            bad |= {tab[i] for i in range(k, min(len(tab), -(-part.start // self.B)))
                    if tab[i] != self.null}
        kv_out = KVConnectorOutput(invalid_block_ids=bad) if step.failed else None
        before = {rid: self.reqs[rid].num_output_tokens for rid in rids}
        queued, self.queued = self.queued, []
        for ev in queued:  # an abort or stop taken between the step and its output
            self._end(ev[1], RequestStatus.FINISHED_STOPPED if ev[0] == "finish"
                      else RequestStatus.FINISHED_ABORTED)
        self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=rids, req_id_to_index={rid: i for i, rid in enumerate(rids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[], kv_connector_output=kv_out))
        for rid, k in step.failed.items():
            self._spoil(step, rid, k)
        for rid in rids:
            why = self.garbage.pop((step.n, rid), None)
            assert why is None or self.reqs[rid].num_output_tokens == before[rid], (
                f"property 2 (null-read): the output of step {step.n} for {rid} counts, "
                f"but the step read {why}, which a failed connector load left without KV")
        if self.cfg["spec_tokens"]:
            self._outcome(step, accepted, before)
        self._forget_released()
        self.ran = [r for r in self.ran if r[0] > step.n]
        if self.cfg["depth"] == 1 and self.cfg["spec_tokens"]:
            live = [rid for rid in rids if rid in self.sched.requests
                    and self.reqs[rid].status == RequestStatus.RUNNING]
            if live:
                self.sched.update_draft_token_ids(DraftTokenIds(
                    live, [[DRAFT_TOKEN] * self.cfg["spec_tokens"] for _ in live]))

    def _outcome(self, step: Step, accepted: dict, before: dict) -> None:
        """What the worker does with the drafts ``step`` accepted. A rejected
        draft's position holds the draft's KV until a step computes it again,
        and every later step of the request in flight computes (and writes)
        its positions shifted down by the rejected drafts, as async spec
        decoding corrects them; then the Mamba postprocess of ``step`` runs
        (:meth:`_postprocess`) and the next step of the request its states."""
        for rid, part in step.parts.items():
            gone = rid in step.failed or rid not in self.sched.requests or (
                part.samples and self.reqs[rid].num_output_tokens == before[rid])
            later = [(st.n, st.parts[rid]) for st in self.pending if rid in st.parts]
            if gone or part.dead:  # its output does not count, nor do the steps after it
                for _, p in later:
                    p.dead = True
                if self.last.get(rid) is part or any(self.last.get(rid) is p for _, p in later):
                    del self.last[rid]
                continue
            part.acc = min(accepted.get(rid, part.spec), part.spec)
            rejected = part.spec - part.acc
            if rejected:
                self._mark(part, part.end - rejected, part.end, (REJECTED, step.n, rid))
                for n, p in later:
                    self._mark(p, p.end - rejected, p.end, (SHIFTED, n, rid))
                    p.start, p.end, p.shift = p.start - rejected, p.end - rejected, \
                        p.shift + rejected
                    self._write(n, p, states=False)
                    self._check_reads(n, p, f"shifted down {p.shift} by rejection")
            if self.slots:
                self._postprocess(step.n, part)
                if later:
                    n, p = later[0]
                    self._run_states(n, p, f"shifted down {p.shift} by rejection"
                                     if p.shift else "scheduled")

    def _mark(self, part: Part, lo: int, hi: int, mark: tuple) -> None:
        """Positions ``[lo, hi)`` of ``part``'s attention groups hold ``mark``."""
        for g, tab in enumerate(part.tables):
            if self.kinds[g][0] == "mamba":
                continue
            for q in range(max(lo, 0), hi):
                i, off = self._slot(g, q)
                if i < len(tab) and tab[i] != self.null:
                    self.content[(tab[i], off)] = mark

    # ------------------------------------------------- Mamba states, with drafts

    def _worker_rows(self, out: Any) -> None:
        """The model runner's block tables after it took ``out``
        (``GPUModelRunner._update_states``; V2's ``add_requests`` /
        ``update_requests``): a new request gets its row from ``block_ids``, a
        resumed one gets it replaced by ``new_block_ids``, any other has
        ``new_block_ids`` appended. A running request's row is append-only:
        never rewritten where the scheduler put NULL or moved a block."""
        for rid in out.finished_req_ids:
            self.rows.pop(rid, None)
        for nr in out.scheduled_new_reqs:
            self.rows[nr.req_id] = [list(ids) for ids in nr.block_ids]
        cr = out.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            new = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids or rid not in self.rows:
                assert new is not None, f"{rid} is resumed in the worker without a block table"
                self.rows[rid] = [list(ids) for ids in new]
            elif new is not None:
                for row, ids in zip(self.rows[rid], new, strict=True):
                    row.extend(ids)

    def _start_slot(self, part: Part) -> int:
        """The slot of the worker's table holding the state ``part`` starts
        from (after ``start - 1``; ``preprocess_mamba``): the running slot of
        the request's step before it plus the drafts that step accepted, or
        that running slot where its postprocess copied the state there; with
        no such step (a new or resumed request) the slot of ``start - 1``."""
        a, q, B = part.start, part.prev, self.B
        if q is not None and q.acc is not None and not q.dead:
            base = q.end - q.spec
            if 0 <= a - base <= q.spec:
                s = (q.end - 1) // B
                return s if a // B * B >= base and a // B - 1 == s else s + a - base
        return (a - 1) // B

    def _run_states(self, n: int, part: Part, when: str) -> None:
        """A Mamba step computing ``[a, e)`` with ``K`` drafts, run once its
        positions are known: it reads the state after ``a - 1`` at
        :meth:`_start_slot` of the worker's table, then writes its running
        state (after ``e - K - 1``) into slot ``s = (e - 1) // B`` and the
        state after each draft into the ``K`` slots after it
        (``mamba_get_block_table_tensor``). The next step starts from the
        slot its acceptance picks, so each of those slots must name a block
        of its own (one block at two of them keeps only the later state)."""
        if part.dead:
            return
        rid, a, e, K, B = part.rid, part.start, part.end, part.spec, self.B
        for g, (kind, _) in enumerate(self.kinds):
            if kind != "mamba":
                continue
            row = part.rows[g]
            where = f"step {n} ({when}) computes {rid} positions [{a}, {e})"
            if part.loaded and a > 0 and (a - 1) // B < len(row):  # a connector's state
                self._put_state(row[(a - 1) // B], rid, g, a - 1, n, f"loaded by step {n}")
            if a > 0:
                r = self._start_slot(part)
                blk = row[r] if r < len(row) else None
                assert blk is not None and blk != self.null, (
                    f"property 2 (null-read): {where} from the Mamba state after position "
                    f"{a - 1}, but slot {r} of the worker's table maps to "
                    f"{'no block' if blk is None else 'the NULL block'}")
                held = self.content.get((blk, 0))
                if held is None or held[0] != self._key(rid, g, a - 1):
                    t, how = self.state_at.get(blk, (None, ""))
                    what = (how if held is not None and held[2] == rid and t is not None
                            else self._what(held))
                    twice = [i for i, b in enumerate(row) if b == blk]
                    raise AssertionError(
                        f"property 2 (null-read): {where} from the Mamba state after position "
                        f"{a - 1}, which it reads at slot {r} of the worker's table (block "
                        f"{blk}, {kind}), but block {blk} holds {what}"
                        + (f": the block is named at slots {twice[0]} and {twice[1]} of the "
                           f"worker's table" if len(twice) > 1 else ""))
            s, base, seen = (e - 1) // B, e - K, {}
            for j in range(K + 1):
                if s + j >= len(row) or row[s + j] == self.null:
                    continue
                blk = row[s + j]
                i = seen.setdefault(blk, j)
                assert i == j, (
                    f"property 2 (null-read): {where} and writes the Mamba states after "
                    f"positions {base - 1 + i} and {base - 1 + j} ({kind}) into one block, "
                    f"{blk}, named at slots {s + i} and {s + j} of the worker's table: the "
                    f"next step starts from the first if {i} draft(s) are accepted, and it "
                    f"holds the second")
                self._put_state(blk, rid, g, base - 1 + j, n,
                                f"step {n} wrote it through slot {s + j}")

    def _put_state(self, blk: int, rid: str, g: int, t: int, n: int, how: str) -> None:
        self.content[(blk, 0)] = (self._key(rid, g, t), n, rid)
        self.state_at[blk] = (t, f"the state after position {t} ({how})")

    def _postprocess(self, n: int, part: Part) -> None:
        """Once step ``n``'s output counts: where the request's count crossed a
        block edge past the step's first draft, the worker copies the state
        after that edge's last position into the slot of the block the edge
        closes (``postprocess_mamba_fused_kernel``), through its table."""
        base, B = part.end - part.spec, self.B
        s, aligned = (part.end - 1) // B, (base + part.acc) // B * B
        if aligned < base or (aligned == base and aligned // B - 1 == s):
            return
        src, dest = s + aligned - base, aligned // B - 1
        for g, (kind, _) in enumerate(self.kinds):
            row = part.rows[g]
            if kind != "mamba" or max(src, dest) >= len(row) or self.null in (row[src],
                                                                                row[dest]):
                continue
            held = self.content.get((row[src], 0))
            if held is None:
                self.content.pop((row[dest], 0), None)
                continue
            t = self.state_at[row[src]][0]
            self.content[(row[dest], 0)] = held
            self.state_at[row[dest]] = (t, f"the state after position {t}: step {n}'s "
                                           f"postprocess copied it there through slot {dest}")

    # ------------------------------------------------------------ progress

    def ev_drain(self) -> None:
        """Property 7's liveness half, as vLLM's engine loop runs
        (``EngineCore.step_with_batch_queue``): with no new requests and no
        failures it schedules while its batch queue has room and otherwise
        takes the oldest output (every draft accepted), until no request is
        left. Every request must finish within ``2 * depth * (1 + N * T)``
        iterations (``N`` live requests of ``T`` prompt and output tokens in
        all), and ``schedule()`` must not schedule nothing more than ``depth``
        times in a row with only empty steps in flight while requests wait."""
        depth = self.cfg["depth"]
        live = lambda: [rid for rid, r in self.reqs.items() if not r.is_finished()]  # noqa: E731
        rids = live()
        limit = 2 * depth * (1 + len(rids) * sum(self.prompt_len[r] + self.max_new[r]
                                                 for r in rids))
        idle = 0  # empty schedules in a row with only empty steps in flight
        for _ in range(limit):
            if not live():
                return
            if len(self.pending) < depth:
                busy = any(st.parts for st in self.pending)
                self.ev_schedule()
                if self.pending[-1].parts:
                    idle = 0
                    continue
                if not busy:
                    idle += 1
                    assert idle <= depth, self._stalled(idle, live())
                if len(self.pending) < depth:
                    continue
            self.ev_process({})
        assert not live(), (
            f"property 7 (progress): with no new requests and no failures, "
            f"{', '.join(live())} did not finish within {limit} scheduler iterations "
            f"(2 * depth * (1 + requests * tokens))")

    def _stalled(self, idle: int, live: list[str]) -> str:
        parts = []
        for rid in live:
            r, P = self.reqs[rid], self.prompt_len[rid]
            done = (f"{r.num_computed_tokens} of its {P} prompt tokens" if
                    r.num_computed_tokens < P else f"{r.num_computed_tokens} tokens")
            last = self.chunk.get(rid)
            cut = (f"; its last chunk, step {last[0]}, was cut to [{last[1]}, {last[2]}) "
                   f"({last[2] - last[1]} tokens)" if last else "; it was never scheduled")
            parts.append(f"{rid} ({r.status.name}) has computed {done}{cut}")
        return (f"property 7 (progress): nothing is in flight and schedule() scheduled nothing "
                f"{idle} times in a row, while {', '.join(live)} have not finished, after step "
                f"{self.steps - 1}, with a token budget of "
                f"{self.cfg['max_num_batched_tokens']} and "
                f"{self.sched.kv_cache_manager.block_pool.get_num_free_blocks()} free blocks: "
                + "; ".join(parts))

    def _spoil(self, step: Step, rid: str, k: int) -> None:
        """The failed load of ``rid`` from block ``k`` is known: from there on
        its blocks hold no valid KV (what never arrived, and all computed after
        it), and every step already run or in flight that read them computed
        garbage."""
        part = step.parts[rid]
        first = max(k * self.B, part.start - part.loaded)
        spoiled = set()
        for g, tab in enumerate(self.tables.get(rid) or [list(t) for t in part.tables]):
            for i in range(k, len(tab)):
                if tab[i] == self.null:
                    continue
                for off in range(self.B):
                    if self.kinds[g][0] == "mamba" or i * self.B + off >= first:
                        if self.content.get((tab[i], off), (None,))[0] not in (FAILED,):
                            self.content[(tab[i], off)] = (FAILED, step.n, rid)
                        spoiled.add((tab[i], off))
        # a copy run after the step (with a later step, before the failure was
        # known) took what a spoiled block held: Mamba's state at the prompt's last
        # hash boundary keeps its cache entry in the copy
        grown = True
        while grown:
            grown = False
            for m, src, dst in self.ran:
                for off in range(self.B):
                    if m > step.n and (src, off) in spoiled and (dst, off) not in spoiled:
                        self.content[(dst, off)] = (FAILED, step.n, rid)
                        spoiled.add((dst, off))
                        grown = True
        for other in [step, *self.pending]:
            for p in other.parts.values():
                hit = sorted({b for b, off in p.reads if (b, off) in spoiled})
                if hit:
                    self.garbage[(other.n, p.rid)] = f"block {hit[0]}"

    def _forget_released(self) -> None:
        """Requests that hold no block any more (finished, preempted) are
        admitted afresh next time: their prefix hit is measured again."""
        for rid in list(self.tables):
            if not any(m.req_to_blocks.get(rid) for m in self.managers):
                del self.tables[rid]
                self.last.pop(rid, None)
