"""Drive vLLM's real scheduler and KV-cache manager from kvcheck events.

Runs inside the worker process (:mod:`impl.vllm.worker`), which imports one
vLLM. Nothing of vLLM is mocked: the driver builds a ``Scheduler`` /
``AsyncScheduler`` with a ``KVCacheConfig`` made of vLLM's own spec classes,
feeds it ``Request`` objects and ``ModelRunnerOutput`` objects as the engine
core does, and reads what happened off the real objects:

* block tables: ``req_to_blocks`` of each single-type manager, right after
  ``schedule()`` returns;
* allocations: a diff of the request's tables across ``allocate_slots``
  (``cached`` when the block did not come out of ``get_new_blocks``);
* frees: ``BlockPool.free_blocks`` on the instance, each reference drop
  attributed to a request, a logical slot and a reason by the call path:
  inside a single-type manager's ``remove_skipped_blocks`` -> ``window``;
  blocks popped by ``pop_blocks_for_free`` (a request-level free, immediate or
  deferred by vLLM's fence queue) -> the reason of the path that popped them:
  ``_preempt_request`` -> ``preempt``, ``_free_blocks`` of a finished request
  -> ``finish`` / ``abort`` (stopped or length-capped -> finish), a failed
  async load's release -> ``failed_load``. A free is reported when the block
  reaches the pool, so a deferred free appears at the Process that drains it;
  the block leaves the request's live count when it is popped;
* counters: ``num_computed_tokens``, ``num_in_flight_tokens`` (None before
  0.26.0), request status.

A free that no path accounts for, or a table that differs from the one the
observations built up, raises (the parent reports it as a target crash): the
instrumentation never guesses.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

from model.events import (
    NO_PREEMPT_CALL,
    Abort,
    AddRequest,
    Config,
    FailLoad,
    Finish,
    Group,
    Preempt,
    Process,
    ResetPrefixCache,
    Schedule,
)
from model.observations import (
    NULL,
    AllocObs,
    BlockTable,
    CopyObs,
    Counters,
    FinishObs,
    FreeObs,
    MoveObs,
    Observed,
    ProcessObs,
    ReqCounters,
    ReqStep,
    StepObs,
)
from model.tokens import DRAFT_TOKEN, OUTPUT_TOKEN, prompt_token
from model.windows import startup_blocks

from . import compat

MODEL_DIR = Path(__file__).resolve().parent / "tiny-model"
# an EAGLE draft model's config (one Llama layer, no weights): vLLM wraps it as
# EagleLlamaForCausalLM when SpeculativeConfig(method="eagle") reads it
EAGLE_DIR = Path(__file__).resolve().parent / "tiny-eagle"
# a DeepSeek-V3 config with two MTP modules (num_nextn_predict_layers, no
# weights): SpeculativeConfig(method="mtp") over it is a multi-module MTP
# drafter (use_multi_module_mtp), whose prefill lookahead of spec_tokens makes
# vLLM's planner give every sliding window spec_tokens - 1 retained tokens
MTP_DIR = Path(__file__).resolve().parent / "tiny-mtp"
DRAFT_LAYER = "draft"  # the EAGLE / MTP draft layer's name in the layer specs
MODEL_MAX_LEN = 131072  # the tiny model's max_position_embeddings
# an encoder-decoder model (a tiny Whisper: config, a byte-level tokenizer and a
# feature extractor, no weights), for cross attention: its max_source_positions,
# the encoder's output length, is set to each config's E in a copy
WHISPER_DIR = Path(__file__).resolve().parent / "tiny-whisper"

class ConfigUnsupported(Exception):
    """The config cannot run on this vLLM (one line)."""


class EventUnsupported(Exception):
    """The event cannot be expressed on this vLLM / config (one line)."""


class EventRejected(Exception):
    """The event is not valid now (its precondition does not hold)."""


class InstrumentationError(AssertionError):
    """The observations lost track of vLLM's state."""


@dataclass
class _Pending:
    """A scheduled, unprocessed step."""

    step: int
    output: Any  # the SchedulerOutput
    obs: dict[str, ReqStep]
    samples: dict[str, bool]  # whether the step samples a token for the request
    failed: dict[str, int] = field(default_factory=dict)  # rid -> first bad block


class Driver:
    def __init__(self) -> None:
        import torch
        import vllm
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
        from vllm.sampling_params import SamplingParams
        from vllm.utils import hashing
        from vllm.v1 import kv_cache_interface as kvi
        from vllm.v1 import outputs
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        from . import connector

        connector.register()
        self.torch = torch
        self.version = vllm.__version__
        self.vllm_file = vllm.__file__
        self.c = dict(
            CacheConfig=CacheConfig, DeviceConfig=DeviceConfig, KVTransferConfig=KVTransferConfig,
            ModelConfig=ModelConfig, ParallelConfig=ParallelConfig,
            SchedulerConfig=SchedulerConfig, SpeculativeConfig=SpeculativeConfig,
            VllmConfig=VllmConfig,
        )
        self.SamplingParams = SamplingParams
        self.hashing = hashing
        self.kvi = kvi
        self.outputs = outputs
        self.kv_cache_utils = kv_cache_utils
        self.AsyncScheduler = AsyncScheduler
        self.Scheduler = Scheduler
        self.Request = Request
        self.RS = RequestStatus
        self.StructuredOutputManager = StructuredOutputManager
        self.connector_mod = connector
        self.sched: Any = None
        self._depth_modes: dict[int, tuple[type, bool, int]] = {}
        self._vllm_configs: dict[tuple, Any] = {}
        # shared by the drivers of this process (one vLLM per process): what
        # they hand out are copies
        self._model_configs = _MODEL_CONFIGS
        self._plans = _PLANS
        self._whisper_dirs: dict[int, Path] = {}
        # the vLLM calls of a replay, for the exporter (impl/vllm/export.py): a
        # list it sets, None otherwise
        self.script: list[tuple] | None = None

    def warm_up(self) -> None:
        """Build and drop one scheduler: the first one in a process pays for
        vLLM's lazy imports (seconds); every later one takes milliseconds."""
        self.reset(Config(groups=(Group("sliding", 16),)))
        self.sched = None

    # ----------------------------------------------------------------- probe

    def info(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "vllm_file": self.vllm_file,
            "in_flight": compat.tracks_in_flight(Path(self.vllm_file).parent),
        }

    # ----------------------------------------------------------------- reset

    def _depth_mode(self, depth: int) -> tuple[type, bool, int]:
        """Scheduler class, async scheduling, pipeline-parallel size for ``depth``
        batches in flight (``VllmConfig.max_concurrent_batches == depth``)."""
        if depth not in self._depth_modes:
            self._depth_modes[depth] = self._find_depth_mode(depth)
        return self._depth_modes[depth]

    def _find_depth_mode(self, depth: int) -> tuple[type, bool, int]:
        if depth == 1:
            return self.Scheduler, False, 1
        if depth == 2:
            return self.AsyncScheduler, True, 1
        # PP: async scheduling with Model Runner V2 keeps pp + 1 batches in
        # flight (0.33); where the release refuses that, synchronous PP keeps
        # pp batches in flight (a request then has one decode step in flight).
        try:
            vc = self._make_vllm_config(Config(groups=()), depth, True, depth - 1, probe=True)
            if vc.max_concurrent_batches == depth:
                return self.AsyncScheduler, True, depth - 1
        except Exception:  # noqa: BLE001 - the release refuses async + PP
            pass
        return self.Scheduler, False, depth

    def _make_vllm_config(self, cfg: Config, depth: int, async_: bool, pp: int,
                          probe: bool = False) -> Any:
        c = self.c
        max_len = cfg.max_model_len if not probe else 512
        enc = None if probe else _encoder_len(cfg)
        if enc is None:
            # a copy of a pristine ModelConfig of this length: the same object
            # a fresh one is (vLLM's HF-config parsing and validation run once)
            pristine = self._model_configs.get(max_len)
            if pristine is None:
                pristine = self._model_configs[max_len] = c["ModelConfig"](
                    model=str(MODEL_DIR), skip_tokenizer_init=True, max_model_len=max_len)
            model = copy.deepcopy(pristine)
        else:
            # the processor needs the tokenizer; blake3 (the default multimodal
            # hasher) is not installed and hashes nothing the scheduler reads
            model = c["ModelConfig"](model=str(self._whisper_dir(enc)), max_model_len=max_len,
                                     mm_hasher_algorithm="sha256")
        sched = c["SchedulerConfig"](
            max_num_batched_tokens=cfg.max_num_batched_tokens if not probe else 64,
            max_num_seqs=cfg.max_num_seqs if not probe else 8,
            max_model_len=max_len,
            is_encoder_decoder=enc is not None,
            enable_chunked_prefill=True,
            async_scheduling=async_,
        )
        cache = c["CacheConfig"](
            block_size=cfg.block_size if not probe else 16,
            enable_prefix_caching=bool(cfg.prefix_caching) if not probe else False,
        )
        if not probe and any(g.spec.holds_state for g in cfg.groups):
            cache.mamba_cache_mode = "align"  # Mamba blocks of B tokens (see _group_spec)
        if not probe and cfg.prefix_match_unit:
            if "prefix_match_unit" not in type(cache).__dataclass_fields__:
                raise ConfigUnsupported(f"vllm {self.version} has no prefix_match_unit")
            cache.prefix_match_unit = cfg.prefix_match_unit
        kw: dict[str, Any] = {}
        parallel = c["ParallelConfig"](pipeline_parallel_size=pp)
        if not probe and cfg.spec_tokens and cfg.drafter in ("eagle", "mtp"):
            kw["speculative_config"] = c["SpeculativeConfig"](
                method=cfg.drafter, model=str(EAGLE_DIR if cfg.drafter == "eagle" else MTP_DIR),
                num_speculative_tokens=cfg.spec_tokens,
                target_model_config=model, target_parallel_config=parallel,
            )
        elif not probe and cfg.spec_tokens:
            kw["speculative_config"] = c["SpeculativeConfig"](
                method="ngram_gpu", num_speculative_tokens=cfg.spec_tokens,
                prompt_lookup_min=1, prompt_lookup_max=3,
            )
        if enc is not None and cfg.hazard == "unordered":
            raise ConfigUnsupported(f"vllm {self.version} runs encoder-decoder models without "
                                    "KV connectors (hazard=unordered needs one)")
        if not probe and cfg.hazard == "unordered":
            kw["kv_transfer_config"] = c["KVTransferConfig"](
                kv_connector=self.connector_mod.NAME, kv_role="kv_consumer",
                kv_load_failure_policy=cfg.kv_load_failure_policy,
            )
        return c["VllmConfig"](
            model_config=model, cache_config=cache, scheduler_config=sched,
            device_config=c["DeviceConfig"](device="cpu"),
            parallel_config=parallel,
            **kw,
        )

    @staticmethod
    def _head_size(cfg: Config, gi: int) -> int:
        """The head size of group ``gi``'s layer. Every layer is specified with
        the cache's block size ``B``; a group that is to get ``r * B`` tokens
        per block gets a page ``r`` times smaller (head size ``H / r``), and
        vLLM's page-size unification (``unify_kv_cache_spec_page_size``)
        raises its block size ``r``-fold to the largest page, as it does for a
        hybrid model whose layers differ in head size or KV heads. One group
        per config: head size 8."""
        ratios = [b // cfg.block_size for b in cfg.block_sizes]
        return 8 * math.lcm(*ratios) // ratios[gi]

    def _whisper_dir(self, encoder_len: int) -> Path:
        """A copy of the tiny Whisper whose encoder emits ``encoder_len`` outputs
        (``max_source_positions``), in a temporary folder of this process."""
        d = self._whisper_dirs.get(encoder_len)
        if d is None:
            d = Path(tempfile.mkdtemp(prefix=f"kvcheck-whisper-{encoder_len}-"))
            for f in WHISPER_DIR.iterdir():
                if f.name != "config.json":
                    shutil.copy(f, d / f.name)
            conf = json.loads((WHISPER_DIR / "config.json").read_text())
            conf["max_source_positions"] = encoder_len
            (d / "config.json").write_text(json.dumps(conf))
            self._whisper_dirs[encoder_len] = d
        return d

    def _group_spec(self, g: Group, cfg: Config, gi: int = 0) -> Any:
        """The vLLM layer spec of group ``g`` (group ``gi``): its kind's
        ``vllm_spec`` class, the parameter under ``vllm_param``."""
        kvi, B, kind = self.kvi, cfg.block_size, g.spec
        common = dict(block_size=B, num_kv_heads=1, head_size=self._head_size(cfg, gi),
                      dtype=self.torch.float32)
        spec_cls = getattr(kvi, kind.vllm_spec, None)
        if spec_cls is None:
            raise ConfigUnsupported(f"vllm {self.version} has no {kind.name} layers "
                                    f"({kind.vllm_spec})")
        if g.draft:
            # the drafter's attention layer, in a group of its own (vLLM marks the
            # group holding an is_draft layer an EAGLE group)
            if "is_draft" not in {f.name for f in dataclasses.fields(spec_cls)}:
                raise ConfigUnsupported(f"vllm {self.version}'s layer specs have no is_draft: "
                                        "it plans no draft layer apart")
            return spec_cls(**common, is_draft=True)
        if not kind.holds_state:
            return spec_cls(**{**common, **kind.vllm_spec_extra},
                            **({kind.vllm_param: g.param} if kind.vllm_param else {}))
        # a recurrent state (Mamba)
        # vLLM builds block-sized Mamba states only with prefix caching
        # ("align" mode: a state per block boundary, the last one kept);
        # without it a Mamba block holds max_model_len tokens.
        if not cfg.prefix_caching:
            raise ConfigUnsupported(
                "without prefix caching vLLM sizes a Mamba block to max_model_len "
                "('none' mode); the checker drives Mamba in 'align' mode (prefix caching on)")
        # a hybrid model's config pads the Mamba page to the attention
        # page (HybridAttentionMambaModelConfig), so both share one pool
        pad = (kvi.FullAttentionSpec(**common).page_size_bytes
               if any(not o.spec.holds_state for o in cfg.groups) else None)
        # a state block per draft token, as a Mamba layer's spec has it
        # (MambaBase.get_kv_cache_spec: num_speculative_tokens)
        return spec_cls(block_size=B, shapes=((8,),), dtypes=(self.torch.float32,),
                        mamba_cache_mode="align", page_size_padded=pad,
                        num_speculative_blocks=cfg.spec_tokens)

    def planned_specs(self, cfg: Config) -> dict[str, Any]:
        """The layer specs the planner is given: :meth:`layer_specs`, and with an
        EAGLE (MTP) drafter and no draft group of the config's own, the draft
        layer, of the first group's spec: vLLM's planner groups it with layer0
        and (0.33) marks that group an EAGLE group."""
        specs = self.layer_specs(cfg)
        if cfg.spec_tokens and cfg.drafter in ("eagle", "mtp") and \
                not any(g.draft for g in cfg.groups):
            first = specs["layer0"]
            specs[DRAFT_LAYER] = (dataclasses.replace(first, is_draft=True)
                                  if "is_draft" in {f.name for f in dataclasses.fields(first)}
                                  else first)
        return specs

    def layer_specs(self, cfg: Config) -> dict[str, Any]:
        """One layer per group, ``layer{i}`` (a draft group's: the draft layer)."""
        return {(DRAFT_LAYER if g.draft else f"layer{i}"): self._group_spec(g, cfg, i)
                for i, g in enumerate(cfg.groups)}

    def _rec(self, *entry: Any) -> None:
        if self.script is not None:
            self.script.append(entry)

    def _chunked_one_size(self) -> bool:
        """Whether this release's chunked-local prefix lookup asserts that its
        group's block size is the scheduler's (0.33.0 does)."""
        import inspect

        from vllm.v1.core import single_type_kv_cache_manager as stm

        cls = getattr(stm, "ChunkedLocalAttentionManager", None)
        try:
            src = inspect.getsource(cls.find_longest_cache_hit) if cls else ""
        except (OSError, TypeError):
            return False
        return "kv_cache_spec.block_size == alignment_tokens" in src

    def _plan(self, vc: Any, cfg: Config) -> tuple[Any, int, int]:
        """The layout vLLM's engine would plan for one layer per group (layer
        ``i`` of group ``i``): :func:`compat.plan_kv_cache`. A layout the
        checker's model cannot state (the planner merging groups, reordering
        them, or planning block sizes, a scheduler block or a hash block other
        than the config's) is refused with one line; one vLLM rejects is
        refused with vLLM's reason."""
        if cfg.mixed_block_sizes and cfg.prefix_caching and \
                any(g.spec.vllm_one_block_size for g in cfg.groups) and self._chunked_one_size():
            raise ConfigUnsupported(
                f"vllm {self.version}'s chunked-local manager asserts, at every prefix-cache "
                "lookup, that its block size is the scheduler's: groups of different block "
                "sizes with chunked-local attention and prefix caching cannot run")
        specs = self.planned_specs(cfg)
        want = [(name,) for name in self.layer_specs(cfg)]
        if DRAFT_LAYER in specs and not any(g.draft for g in cfg.groups):
            want[0] = ("layer0", DRAFT_LAYER)
        try:
            kvc, block_size, hash_block_size = compat.plan_kv_cache(vc, specs, cfg.num_blocks)
        except Exception as e:  # noqa: BLE001 - vLLM's planner refuses the layout
            m = re.search(r"estimated maximum model length is (\d+)", str(e))
            if "serve at least one request" in str(e):
                fits = f" (vLLM estimates max_model_len {m[1]} fits)" if m else ""
                raise ConfigUnsupported(
                    f"vllm {self.version} refuses to start: {cfg.num_blocks} blocks cannot "
                    f"serve one request of max_model_len {cfg.max_model_len}{fits}; "
                    f"num_blocks >= {startup_blocks(cfg)} always can") from None
            raise ConfigUnsupported(f"vllm {self.version} cannot plan this KV-cache layout: "
                                    f"{_one_line(e)}") from None
        layers = [tuple(g.layer_names) for g in kvc.kv_cache_groups]
        if layers != want:
            raise ConfigUnsupported(
                f"vllm {self.version} plans the layers {list(specs)} as groups {layers}; the "
                "checker needs one group per configured group, in order (an EAGLE draft "
                "layer with the first group)")
        sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
        stated = (list(cfg.block_sizes), cfg.scheduler_block_size, cfg.hash_block_size)
        if (sizes, block_size, hash_block_size) != stated:
            raise ConfigUnsupported(
                f"vllm {self.version} plans group block sizes {sizes}, scheduler block "
                f"{block_size}, hash block {hash_block_size}; the config states "
                f"{stated[0]}, {stated[1]}, {stated[2]}")
        retained = [getattr(g.kv_cache_spec, "extra_retained_tokens", 0)
                    for g in kvc.kv_cache_groups]
        if retained != [g.retained for g in cfg.groups]:
            raise ConfigUnsupported(
                f"vllm {self.version} plans retained tokens {retained} per group; the config "
                f"says {[g.retained for g in cfg.groups]}")
        if kvc.num_blocks != cfg.num_blocks:
            raise ConfigUnsupported(
                f"vllm {self.version} plans {kvc.num_blocks} blocks, not {cfg.num_blocks}")
        return kvc, block_size, hash_block_size

    def _planned(self, vc: Any, cfg: Config) -> tuple[Any, int, int]:
        """:meth:`_plan`, once per config: vLLM's planner is a function of the
        config (the layer specs, the pool size, the VllmConfig built for the
        config's shape), so a config planned before gets the same
        KVCacheConfig (its refusal: the same line), and ``vc`` gets the two
        fields the planner sets on it. The plans are shared by the drivers of
        the process (``vc`` is one built for ``cfg``'s shape, equal to any other
        such). vLLM writes to a KVCacheConfig only while planning it (the
        scheduler, coordinator and managers read it), so the schedulers of one
        config share one. ``tests/test_vllm_reuse.py`` compares a scheduler
        built this way to one of a fresh driver over a trace, the layout after
        the trace included."""
        key = cfg
        hit = self._plans.get(key)
        if hit is None:
            try:
                hit = self._plan(vc, cfg)
            except ConfigUnsupported as e:
                hit = e
            if len(self._plans) > 1024:
                self._plans.clear()
            self._plans[key] = hit
        if isinstance(hit, ConfigUnsupported):
            raise ConfigUnsupported(str(hit)) from None
        kvc, block_size, hash_block_size = hit
        compat.planned_on(vc, cfg.num_blocks, kvc)
        return kvc, block_size, hash_block_size

    def reset(self, cfg: Config) -> Observed:
        if cfg.max_model_len > MODEL_MAX_LEN:
            raise ConfigUnsupported(f"max_model_len {cfg.max_model_len} > {MODEL_MAX_LEN}")
        cls, async_, pp = self._depth_mode(cfg.depth)
        key = (cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs,
               cfg.max_model_len, cfg.spec_tokens, cfg.depth, bool(cfg.prefix_caching),
               cfg.hazard, any(g.spec.holds_state for g in cfg.groups), cfg.drafter,
               _encoder_len(cfg), cfg.kv_load_failure_policy, cfg.prefix_match_unit)
        vc = self._vllm_configs.get(key)
        if vc is None:
            try:
                vc = self._make_vllm_config(cfg, cfg.depth, async_, pp)
            except Exception as e:  # noqa: BLE001 - vLLM's config validation
                raise ConfigUnsupported(f"vllm {self.version} refuses this config: "
                                        f"{_one_line(e)}") from None
            if len(self._vllm_configs) > 256:
                self._vllm_configs.clear()
            self._vllm_configs[key] = vc
        if vc.max_concurrent_batches != cfg.depth:
            raise ConfigUnsupported(
                f"vllm {self.version} runs {vc.max_concurrent_batches} batch(es) in flight, "
                f"not depth {cfg.depth}")
        kvc, block_size, hash_block_size = self._planned(vc, cfg)
        vc.cache_config.num_gpu_blocks = kvc.num_blocks
        try:
            sched = cls(vllm_config=vc, kv_cache_config=kvc,
                        structured_output_manager=self.StructuredOutputManager(vc),
                        **compat.scheduler_kwargs(cls, block_size, hash_block_size))
        except _BROKEN:
            # vLLM's own code cannot build a layout its model code produces (a
            # manager's signature out of step with its caller): a target crash,
            # exit 3 with the config and the traceback, not a refusal
            raise
        except Exception as e:  # noqa: BLE001 - vLLM refuses the layout
            raise ConfigUnsupported(f"vllm {self.version} cannot build this KV-cache layout: "
                                    f"{_one_line(e)}") from None
        self.cfg = cfg
        self.sched = sched
        self.kvm = sched.kv_cache_manager
        self.pool = self.kvm.block_pool
        self.mgrs = list(self.kvm.coordinator.single_type_managers)
        if len(self.mgrs) != len(cfg.groups):
            raise ConfigUnsupported(
                f"vllm {self.version} merged the {len(cfg.groups)} groups into {len(self.mgrs)}")
        if any(m.block_pool is not self.pool for m in self.mgrs):
            raise ConfigUnsupported("vllm uses one block pool per group here; not supported")
        partial = bool(getattr(self.kvm.coordinator, "enable_partial_hash_hits", False))
        if partial != cfg.partial_hits:
            raise ConfigUnsupported(
                f"vllm {self.version} {'enables' if partial else 'disables'} prefix hits "
                f"inside a block here; the config says {cfg.partial_hits}")
        self.null = self.pool.null_block
        self.null_id = self.null.block_id
        self.connector = getattr(sched, "connector", None)
        self.block_hasher = None
        if cfg.prefix_caching or self.connector is not None:
            self.block_hasher = compat.make_block_hasher(
                self.kv_cache_utils, self.hashing, vc.cache_config.prefix_caching_hash_algo,
                hash_block_size, getattr(vc, "num_hash_lookahead_tokens", 0))
        # a group whose blocks hold no positions (a ring, the encoder's outputs)
        # is sized by its spec's own per-request share of the pool; the others
        # by their table row, Mamba's with a state block per draft
        # (MambaSpec.max_num_blocks_per_req in align mode)
        self.bound = tuple(
            compat.admission_cap(m)
            or (m.kv_cache_spec.max_memory_usage_bytes(vc) // m.kv_cache_spec.page_size_bytes
                if not g.spec.reads_positions else None)
            or -(-cfg.max_model_len // B) + g.spec.speculative_blocks(cfg.spec_tokens)
            for m, g, B in zip(self.mgrs, cfg.groups, cfg.block_sizes, strict=True)
        )
        # observation state
        self.items: list[Any] = []
        self.pending: deque[_Pending] = deque()
        self.next_step = 0
        # rid -> Request, until it finished and no step in flight scheduled it
        self.reqs: dict[str, Any] = {}
        self.ended: set[str] = set()  # ids of the requests that left self.reqs
        self.active: dict[str, Any] = {}  # rid -> Request, while it is in the counters
        # the requests whose counters this event may have changed (_counters
        # lists only these): added, scheduled, processed, preempted, ended,
        # named by the event, or whose blocks vLLM allocated, popped or freed
        self.touched: dict[str, None] = {}
        self.table: dict[str, list[list[int]]] = {}  # rid -> per group: slot -> physical id
        self.last_tables: dict[str, tuple[tuple[int, ...], ...]] = {}  # as last scheduled
        # rid -> per group: the model runner's block table (physical ids), built
        # from the scheduler outputs alone (:meth:`_worker_tables`)
        self.wtable: dict[str, list[list[int]]] = {}
        # the groups whose steps read the worker's table in observations: a
        # Mamba group's (align mode relocates speculative blocks in the
        # scheduler's table; the worker's keeps them where they were too)
        self.worker_groups = tuple(gi for gi, g in enumerate(cfg.groups) if g.spec.holds_state)
        self.live: dict[str, list[int]] = {}  # rid -> per group: blocks not yet in the pool
        self.owed: dict[int, list[tuple[int, str, int, str]]] = {}  # block -> (g, rid, slot, why)
        self.reasons: list[str] = []
        self.window: list[tuple[int, str]] = []  # inside remove_skipped_blocks(rid) of group
        self.fresh: set[int] = set()
        self.cows: list[tuple[int, str, int, Any, Any]] = []  # _apply_cow calls
        # copies handed to the worker with steps that ran nothing, for the next step
        self.step_copies: list[tuple[int, int]] = []
        self.failed_now: dict[str, int] = {}
        self.finished_now: set[str] = set()
        self.leaving: list[str] = []  # left the counters; forgotten once no step holds them
        self.queued: list[Any] = []  # events held for the next Process (_hold_for_engine)
        self.arrival = 0
        self._instrument()
        self._rec("reset", cfg, vc)
        return Observed(items=[], counters=self._counters())

    # --------------------------------------------------------- instrumenting

    def _instrument(self) -> None:
        pool, sched, kvm = self.pool, self.sched, self.kvm
        touched = self.touched

        free_blocks = pool.free_blocks

        def free_blocks_w(ordered_blocks: Any) -> Any:
            blocks = list(ordered_blocks)
            for b in blocks:
                if not b.is_null:
                    self._attribute_free(b)
            return free_blocks(blocks)

        pool.free_blocks = free_blocks_w

        get_new_blocks = pool.get_new_blocks

        def get_new_blocks_w(num_blocks: int) -> Any:
            ret = get_new_blocks(num_blocks)
            self.fresh.update(id(b) for b in ret)
            return ret

        pool.get_new_blocks = get_new_blocks_w

        for g, mgr in enumerate(self.mgrs):
            self._wrap_manager(g, mgr)

        allocate_slots = kvm.allocate_slots

        def allocate_slots_w(request: Any, *args: Any, **kwargs: Any) -> Any:
            rid = request.request_id
            touched[rid] = None
            before = [len(m.req_to_blocks.get(rid, ())) for m in self.mgrs]
            copies = [len(getattr(m, "_pending_cow_copies", ())) for m in self.mgrs]
            self.fresh = set()
            self.cows = []
            ret = allocate_slots(request, *args, **kwargs)
            redirected = {(g, slot): (src, cow) for g, r, slot, src, cow in self.cows
                          if r == rid}
            for g, m in enumerate(self.mgrs):
                after = m.req_to_blocks.get(rid)
                if after and len(after) > before[g]:
                    self._record_allocs(g, rid, before[g], after, redirected)
            for g, m in enumerate(self.mgrs):
                for src, cow in list(getattr(m, "_pending_cow_copies", ()))[copies[g]:]:
                    self._record_copy(g, rid, src, cow, redirected)
            return ret

        kvm.allocate_slots = allocate_slots_w

        self._wrap_reason(sched, "_preempt_request",
                          lambda request, *a, **k: self._touch(request, "preempt"))
        self._wrap_reason(sched, "_free_blocks", lambda request, *a, **k: self._end_reason(request))
        if hasattr(sched, "_free_cow_retained_blocks"):
            self._wrap_reason(sched, "_free_cow_retained_blocks", lambda *a, **k: "copy")
        if hasattr(sched, "_update_waiting_for_remote_kv"):
            self._wrap_reason(sched, "_update_waiting_for_remote_kv",
                              lambda request, *a, **k: self._touch(request, "failed_load"))

        free_request = sched._free_request

        def free_request_w(request: Any, *args: Any, **kwargs: Any) -> Any:
            rid = request.request_id
            touched[rid] = None
            if rid not in self.finished_now:
                self.finished_now.add(rid)
                self.items.append(FinishObs(rid, self._finish_obs_reason(request)))
            return free_request(request, *args, **kwargs)

        sched._free_request = free_request_w

        handle_invalid = sched._handle_invalid_blocks

        def handle_invalid_w(*args: Any, **kwargs: Any) -> Any:
            self.reasons.append("failed_load")
            try:
                affected = handle_invalid(*args, **kwargs)
            finally:
                self.reasons.pop()
            B = self.cfg.block_size
            for rid in affected or ():
                touched[rid] = None
                r = self.reqs.get(rid)
                if r is not None:
                    self.failed_now[rid] = r.num_computed_tokens // B
            return affected

        sched._handle_invalid_blocks = handle_invalid_w

    def _wrap_reason(self, obj: Any, name: str, reason_of: Any) -> None:
        orig = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.reasons.append(reason_of(*args, **kwargs))
            try:
                return orig(*args, **kwargs)
            finally:
                self.reasons.pop()

        setattr(obj, name, wrapper)

    def _touch(self, request: Any, reason: str) -> str:
        self.touched[request.request_id] = None
        return reason

    def _wrap_manager(self, g: int, mgr: Any) -> None:
        remove_skipped = mgr.remove_skipped_blocks
        touched = self.touched

        def remove_skipped_w(request_id: str, *args: Any, **kwargs: Any) -> Any:
            touched[request_id] = None
            self.window.append((g, request_id))
            try:
                return remove_skipped(request_id, *args, **kwargs)
            finally:
                self.window.pop()

        mgr.remove_skipped_blocks = remove_skipped_w

        pop_blocks = mgr.pop_blocks_for_free

        def pop_blocks_w(request_id: str, *args: Any, **kwargs: Any) -> Any:
            touched[request_id] = None
            blocks = pop_blocks(request_id, *args, **kwargs)
            why = self.reasons[-1] if self.reasons else None
            tabs = self.table.get(request_id)
            if tabs is None:
                return blocks
            tab = tabs[g]
            for b in blocks:  # (0.33 drops leading NULLs: slots come from our table)
                if b.is_null:
                    continue
                pid = self._pid(b)
                if why is None or pid not in tab:
                    raise InstrumentationError(
                        f"request {request_id} gives up block {pid} (group {g}) on a path "
                        f"kvcheck cannot name or at a slot it did not see")
                slot = tab.index(pid)
                tab[slot] = NULL
                # out of the request now, whenever it reaches the pool (a block
                # in vLLM's deferred-free queue belongs to no live request)
                self.live[request_id][g] -= 1
                self.owed.setdefault(id(b), []).append((g, request_id, slot, why))
            tabs[g] = []
            return blocks

        mgr.pop_blocks_for_free = pop_blocks_w

        apply_cow = getattr(mgr, "_apply_cow", None)
        if apply_cow is not None:
            def apply_cow_w(request_id: str, block_idx: int, source: Any, cow: Any) -> Any:
                ret = apply_cow(request_id, block_idx, source, cow)
                self.cows.append((g, request_id, block_idx, source, cow))
                return ret

            mgr._apply_cow = apply_cow_w

        relocate = getattr(mgr, "_relocate_speculative_block", None)
        if relocate is not None:
            def relocate_w(req_blocks: list[Any], block_idx: int) -> Any:
                rid = next((r for r, bl in mgr.req_to_blocks.items() if bl is req_blocks), None)
                b = req_blocks[block_idx]
                ret = relocate(req_blocks, block_idx)
                tab = self.table.get(rid, [None])[g] if rid is not None else None
                pid = self._pid(b)
                if tab is None or block_idx >= len(tab) or tab[block_idx] != pid:
                    raise InstrumentationError(
                        f"a speculative Mamba block {pid} (group {g}) relocated from a slot "
                        f"kvcheck did not see it at")
                to = len(req_blocks) - 1
                tab[block_idx] = NULL
                for slot in range(len(tab), to):  # NULL slots allocate_new_blocks padded
                    tab.append(NULL if req_blocks[slot].is_null
                               else self._pid(req_blocks[slot]))
                tab.append(pid)
                self.items.append(MoveObs(pid, g, rid, block_idx, to))
                return ret

            mgr._relocate_speculative_block = relocate_w

    # ------------------------------------------------------ attributing frees

    def _pid(self, b: Any) -> int:
        """Physical id in observations: the NULL block is 0 whatever vLLM numbers it
        (it is 0 in every supported release; another numbering is swapped)."""
        i = b.block_id
        if self.null_id == NULL:
            return i
        if b.is_null:
            return NULL
        return self.null_id if i == NULL else i

    def _pid_of(self, vid: int) -> int:
        """Physical id in observations of vLLM's block id ``vid``."""
        if self.null_id == NULL or vid not in (NULL, self.null_id):
            return vid
        return NULL if vid == self.null_id else self.null_id

    def _vid(self, pid: int) -> int:
        """vLLM's block id of an observed physical id (inverse of :meth:`_pid`)."""
        return NULL if pid == self.null_id != NULL else pid

    def _attribute_free(self, b: Any) -> None:
        if self.window:
            g, rid = self.window[-1]
            tab = self.table[rid][g]
            pid = self._pid(b)
            if pid in tab:
                slot = tab.index(pid)
                tab[slot] = NULL
                self.live[rid][g] -= 1
                self.items.append(FreeObs(pid, g, rid, slot, "window"))
                return
        owed = self.owed.get(id(b))
        if owed:
            # a copy's retention released at once names the copy's entry
            i = next((i for i, o in enumerate(owed) if o[3] == "copy"), 0) \
                if self.reasons and self.reasons[-1] == "copy" else 0
            g, rid, slot, why = owed.pop(i)
            if not owed:
                del self.owed[id(b)]
            self.items.append(FreeObs(self._pid(b), g, rid, slot, why))
            return
        raise InstrumentationError(
            f"block {self._pid(b)} returned to the pool by a path kvcheck cannot attribute")

    def _record_copy(self, g: int, rid: str, src: Any, cow: Any,
                     redirected: dict[tuple[int, int], tuple[Any, Any]]) -> None:
        """A copy vLLM queued for the worker (``_pending_cow_copies``) while
        allocating for ``rid``: of a hit ending inside a block into the
        request's private block (``_apply_cow``, the slot redirected), or of a
        Mamba state at the prompt's last hash boundary into a block that keeps
        its cache entry (the request keeps ``src``). Both ends stay held until
        the step running it is processed (``_free_cow_retained_blocks``)."""
        slot = next((s for (gg, s), (a, b) in redirected.items()
                     if gg == g and a is src and b is cow), None)
        tab = self.table[rid][g]
        spid, cpid = self._pid(src), self._pid(cow)
        if slot is None:
            slot = -1
        elif slot >= len(tab) or tab[slot] != spid:
            raise InstrumentationError(
                f"request {rid} group {g}: a copy-on-write of block {spid} at slot {slot} "
                f"kvcheck did not see it at")
        else:
            tab[slot] = cpid
        self.items.append(CopyObs(spid, cpid, g, rid, slot))
        for b, s in ((src, slot), (cow, slot)):
            self.owed.setdefault(id(b), []).append((g, rid, s, "copy"))

    def _record_allocs(self, g: int, rid: str, n: int, after: list[Any],
                       redirected: dict[tuple[int, int], tuple[Any, Any]] | None = None,
                       ) -> None:
        """Blocks appended to the request's table of group ``g`` beyond slot ``n``
        (vLLM only appends; an in-place change shows up as a table mismatch
        when the request is next scheduled). A slot ``_apply_cow`` redirected in
        this allocation shows the prefix hit it took (``redirected``: slot ->
        (hit block, copy)); the copy follows (:meth:`_record_copy`)."""
        tab = self.table[rid][g]
        live = self.live[rid]
        if len(tab) < n:
            tab.extend([NULL] * (n - len(tab)))
        for slot in range(n, len(after)):
            b = after[slot]
            if redirected and (g, slot) in redirected:
                b = redirected[(g, slot)][0]
            pid = NULL if b.is_null else self._pid(b)
            if slot < len(tab):  # seen already: a relocated speculative block
                if tab[slot] != pid:
                    raise InstrumentationError(
                        f"request {rid} group {g} slot {slot} holds {pid}, observations say "
                        f"{tab[slot]}")
                continue
            if b.is_null:
                tab.append(NULL)
                continue
            tab.append(pid)
            live[g] += 1
            self.items.append(AllocObs(pid, g, rid, slot, cached=id(b) not in self.fresh))

    def _end_reason(self, request: Any) -> str:
        st = request.status
        if st == self.RS.FINISHED_ABORTED:
            return "abort"
        if st == self.RS.FINISHED_ERROR:
            return "failed_load"
        return "finish"

    def _finish_obs_reason(self, request: Any) -> str:
        st = request.status
        if st == self.RS.FINISHED_LENGTH_CAPPED:
            return "length"
        if st == self.RS.FINISHED_ABORTED:
            return "abort"
        if st == self.RS.FINISHED_STOPPED:
            return "finish"
        if st == self.RS.FINISHED_ERROR:
            return "error"  # kv_load_failure_policy="fail"
        return str(st).lower()

    # ----------------------------------------------------------------- events

    def apply(self, ev: Any) -> Observed:
        if self.sched is None:
            raise EventRejected("reset() first")
        self.items = []
        self.finished_now = set()
        t = type(ev)
        rid = getattr(ev, "id", None)
        if rid is not None and rid in self.active:
            self.touched[rid] = None
        if t is Schedule:
            self._schedule()
        elif t is Process:
            self._process(ev)
        elif t is AddRequest:
            self._add(ev)
        elif t is ResetPrefixCache:
            self._reset_prefix_cache()
        elif t is Preempt:
            raise EventUnsupported(NO_PREEMPT_CALL)
        elif t is FailLoad:
            self._fail_load(ev)
        elif t is Finish or t is Abort:
            self._finish(ev)
        else:
            raise EventRejected(f"unknown event {ev!r}")
        return Observed(items=self.items, counters=self._counters())

    def _add(self, ev: AddRequest) -> None:
        if ev.id in self.reqs or ev.id in self.ended:
            raise EventRejected(f"request {ev.id} was already added")
        if ev.prompt_len + ev.max_new_tokens > self.cfg.max_model_len:
            raise EventRejected(f"request {ev.id} exceeds max_model_len")
        if ev.external_tokens:
            if self.connector is None:
                raise EventUnsupported(
                    "external tokens need a KV-consumer connector, which vLLM runs with "
                    "hazard=unordered only")
            if not 0 < ev.external_tokens < ev.prompt_len:
                raise EventRejected("external_tokens must be in (0, prompt_len)")
        prompt = [prompt_token(t, ev.variant) for t in range(ev.prompt_len)]
        self.arrival += 1
        enc = _encoder_len(self.cfg)
        req = compat.make_request(
            self.Request, ev.id, prompt,
            compat.make_sampling_params(self.SamplingParams, ev.max_new_tokens),
            self.block_hasher, float(self.arrival),
            None if enc is None else compat.encoder_input(ev.id, enc))
        if ev.external_tokens:
            self.connector.offers[ev.id] = ev.external_tokens
        self._rec("add", ev.id, ev.prompt_len, ev.variant, ev.max_new_tokens, ev.external_tokens)
        self.reqs[ev.id] = req
        self.active[ev.id] = req
        self.touched[ev.id] = None
        self.table[ev.id] = [[] for _ in self.mgrs]
        self.live[ev.id] = [0] * len(self.mgrs)
        self.sched.add_request(req)

    def _schedule(self) -> None:
        if len(self.pending) >= self.cfg.depth:
            raise EventRejected(f"{self.cfg.depth} step(s) already in flight")
        out = self.sched.schedule()
        # the copies the worker runs before this step's forward, all at once
        # (copy_kv_cache_blocks_inplace: blocks[dst] = blocks[src])
        self.step_copies += [(self._pid_of(c.src_block_id), self._pid_of(c.dst_block_id))
                             for c in getattr(out, "kv_cache_block_copies", None) or ()]
        self._worker_tables(out)  # the engine hands every output to the worker
        self._rec("schedule", self.next_step if out.total_num_scheduled_tokens else None)
        if not out.total_num_scheduled_tokens:
            # an empty step: the engine queues its batch too, and takes its
            # (empty) output in turn (step_with_batch_queue)
            step = self.next_step
            self.next_step += 1
            self.pending.append(_Pending(step, out, {}, {}))
            self.items.append(StepObs(step, (), tuple(self.step_copies)))
            self.step_copies = []
            return
        meta = getattr(out, "kv_connector_metadata", None)
        loads = getattr(meta, "loads", None) or {}
        spec = out.scheduled_spec_decode_tokens
        step = self.next_step
        self.next_step += 1
        obs: dict[str, ReqStep] = {}
        samples: dict[str, bool] = {}
        touched = self.touched
        for rid, n in out.num_scheduled_tokens.items():
            touched[rid] = None
            r = self.reqs[rid]
            end = r.num_computed_tokens
            if self.null_id == NULL:
                tables = tuple(tuple(map(_block_id, m.req_to_blocks.get(rid, ())))
                               for m in self.mgrs)
            else:
                tables = tuple(tuple(self._pid(b) for b in m.req_to_blocks.get(rid, ()))
                               for m in self.mgrs)
            mine = self.table[rid]
            for g, tab in enumerate(tables):
                if list(tab) != mine[g]:
                    raise InstrumentationError(
                        f"step {step}: request {rid} group {g} is scheduled with table "
                        f"{list(tab)}, observations say {mine[g]}")
            if self.worker_groups:
                tables = self._worker_view(rid, step, tables)
            last = self.last_tables.get(rid)
            # an unchanged table is the same object, a long changed one shares
            # the leaves that did not change (memory per change, as the reference)
            if last is not None:
                tables = tuple(b if b == t else BlockTable.of(t, b)
                               for b, t in zip(last, tables, strict=True))
            else:
                tables = tuple(BlockTable.of(t) for t in tables)
            self.last_tables[rid] = tables
            obs[rid] = ReqStep(rid, end - n, end, len(spec.get(rid, ())), loads.get(rid, 0),
                               tables)
            # the model runner samples where the step reaches the tokens it
            # knows (its seq_len against num_tokens, the scheduler's output
            # tokens plus those of its steps in flight); the scheduler's
            # is_prefill_chunk says the same unless a placeholder went stale: a
            # failed load discards a step's output and keeps its placeholder,
            # and the runner, aligned to the output tokens, samples anyway
            samples[rid] = not r.is_prefill_chunk or (
                end >= r.num_tokens and not any(q.samples.get(rid) for q in self.pending))
        self.pending.append(_Pending(step, out, obs, samples))
        self.items.append(StepObs(step, tuple(obs.values()), tuple(self.step_copies)))
        self.step_copies = []

    def _worker_tables(self, out: Any) -> None:
        """The model runner's block tables after it took ``out``, as vLLM's
        model runners build them (``GPUModelRunner._update_states``; V2's
        ``add_requests`` / ``update_requests``): a request in
        ``scheduled_new_reqs`` gets its row from ``block_ids`` (the whole
        table; V2 lists resumed requests there too), one in
        ``scheduled_cached_reqs`` with ``resumed_req_ids`` (or
        ``resumed_from_preemption``) gets it replaced by ``new_block_ids``, and
        any other cached one has ``new_block_ids`` appended: a running
        request's row is append-only, never rewritten where the scheduler put
        NULL or moved a block. A finished request's row is dropped."""
        w, pid = self.wtable, self._pid_of
        for rid in getattr(out, "finished_req_ids", ()) or ():
            w.pop(rid, None)
        for nr in out.scheduled_new_reqs:
            w[nr.req_id] = [list(map(pid, ids)) for ids in nr.block_ids]
        cr = out.scheduled_cached_reqs
        resumed = getattr(cr, "resumed_req_ids", None)
        flags = getattr(cr, "resumed_from_preemption", None)
        for i, rid in enumerate(cr.req_ids):
            new = cr.new_block_ids[i]
            again = rid in resumed if resumed is not None else bool(flags and flags[i])
            if again or rid not in w:
                if new is None:
                    raise InstrumentationError(
                        f"request {rid} is resumed in the worker without a block table")
                w[rid] = [list(map(pid, ids)) for ids in new]
            elif new is not None:
                for row, ids in zip(w[rid], new, strict=True):
                    row.extend(map(pid, ids))

    def _worker_view(self, rid: str, step: int, tables: tuple[tuple[int, ...], ...]
                     ) -> tuple[tuple[int, ...], ...]:
        """``tables`` (the scheduler's) with the worker's row in the groups it is
        reported for. vLLM keeps the two in step but where the scheduler has
        NULL since: a slot it freed, or a speculative Mamba block it relocated
        (the worker still names it there, and at its new slot). In the other
        groups a departure raises; in the reported ones the properties judge
        it (a step reading a block its request does not hold there)."""
        row = self.wtable.get(rid)
        if row is None:
            raise InstrumentationError(f"step {step}: request {rid} is scheduled but the "
                                       "worker has no block table for it")
        out = list(tables)
        for gi, (w, t) in enumerate(zip(row, tables, strict=True)):
            if gi in self.worker_groups:
                out[gi] = tuple(w)  # what it names where, the properties judge
            elif len(w) != len(t) or any(a != b and b != NULL
                                         for a, b in zip(w, t, strict=True)):
                raise InstrumentationError(
                    f"step {step}: request {rid} group {gi}: the worker's block table {w} "
                    f"departs from the scheduler's {list(t)} other than at NULL slots")
        return tuple(out)

    def _process(self, ev: Process) -> None:
        if not self.pending:
            raise EventRejected("no step in flight")
        p = self.pending.popleft()
        out = p.output
        rids = list(out.num_scheduled_tokens)
        self.touched.update(dict.fromkeys(rids))
        self.touched.update((q.id, None) for q in self.queued)
        sampled: list[list[int]] = []
        accepted: list[tuple[str, int]] = []
        for rid in rids:
            k = p.obs[rid].spec
            a = min(ev.accepted.get(rid, k), k)
            if k or p.samples[rid]:  # a step with output (tokens or drafts)
                accepted.append((rid, a))
            sampled.append([OUTPUT_TOKEN] * (1 + a) if p.samples[rid] else [])
        kv_out = None
        if p.failed:
            kv_out = compat.dataclass_kwargs(
                self.outputs.KVConnectorOutput,
                invalid_block_ids=self._invalid_blocks(p),
            )
        gone_before = {rid for rid in rids
                       if rid not in self.sched.requests or self.reqs[rid].is_finished()}
        ntok_before = {rid: self.reqs[rid].num_output_tokens for rid in rids}
        mro = compat.dataclass_kwargs(
            self.outputs.ModelRunnerOutput,
            req_ids=rids, req_id_to_index={rid: i for i, rid in enumerate(rids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[], kv_connector_output=kv_out,
        )
        at = len(self.items)
        self.failed_now = {}
        queued, self.queued = self.queued, []
        for q in queued:  # the sync engine's abort queue: after the step ran, before its output
            self._finish(q)
        if self.script is not None and rids:  # an empty step's output changes nothing
            B = self.cfg.block_size
            # a failed load names the loaded blocks from the first bad one on
            # (_invalid_blocks): their slots in the loading step's table
            self._rec("process", p.step, {rid: len(t) for rid, t in zip(rids, sampled,
                                                                        strict=True)},
                      {rid: [s for s in range(k, min(len(p.obs[rid].tables[0]),
                                                     -(-p.obs[rid].start // B)))
                             if p.obs[rid].tables[0][s] != NULL]
                       for rid, k in p.failed.items()})
        self.sched.update_from_output(out, mro)
        discarded = []
        for rid in rids:
            if rid in gone_before or rid in self.failed_now:
                discarded.append(rid)
            elif p.samples[rid] and self.reqs[rid].num_output_tokens == ntok_before[rid]:
                discarded.append(rid)  # vLLM dropped the output (stale after preemption)
        # accepted names the requests whose output counts (not the discarded)
        accepted = [(rid, a) for rid, a in accepted if rid not in discarded]
        self.items.insert(at, ProcessObs(p.step, tuple(accepted), tuple(discarded),
                                         tuple(sorted(self.failed_now.items()))))
        if self.cfg.depth == 1 and self.cfg.spec_tokens:
            self._propose_drafts(rids)

    def _propose_drafts(self, rids: list[str]) -> None:
        """Synchronous scheduling: the drafter proposes ``spec_tokens`` drafts
        on the step's output, and the engine hands them to the scheduler."""
        live = [rid for rid in rids
                if rid in self.sched.requests and self.reqs[rid].status == self.RS.RUNNING]
        if live:
            self._rec("drafts", tuple(live))
            self.sched.update_draft_token_ids(self.outputs.DraftTokenIds(
                live, [[DRAFT_TOKEN] * self.cfg.spec_tokens for _ in live]))

    def _invalid_blocks(self, p: _Pending) -> set[int]:
        """What a worker-side connector reports for a failed load: the physical
        blocks it loaded into from the first bad block on, as the loading step
        was scheduled with them (group 0; vLLM takes block ids of one group)."""
        bad: set[int] = set()
        B = self.cfg.block_size
        for rid, k in p.failed.items():
            rs = p.obs[rid]
            tab = rs.tables[0]
            for slot in range(k, min(len(tab), -(-rs.start // B))):
                if tab[slot] != NULL:
                    bad.add(self._vid(tab[slot]))
        return bad

    def _hold_for_engine(self, ev: Any) -> bool:
        """At depth 1 vLLM's engine never ends a request while its one step
        runs: it takes an abort / stop that arrives then after the step has
        run, right before processing its output. So hold such an event until
        that Process."""
        if self.cfg.depth == 1 and self.pending:
            r = self.sched.requests.get(ev.id)
            if r is None or r.is_finished():
                raise EventRejected(f"request {ev.id} is not live")
            self.queued.append(ev)
            return True
        return False

    def _reset_prefix_cache(self) -> None:
        """The engine's utility call, between two steps of its loop: every
        running request preempted (the last admitted first), then the cache
        reset if no block is in use. vLLM raises RuntimeError where the reset
        fails with requests preempted (blocks still held: deferred frees,
        loads); the engine's utility handler returns that error to the
        caller and its loop goes on, so the driver does too."""
        if len(self.pending) >= self.cfg.depth:
            raise EventRejected(f"{self.cfg.depth} step(s) in flight: the engine takes a "
                                f"utility call only between two steps of its loop")
        for r in self.sched.running:
            self.touched[r.request_id] = None
        self._rec("reset")
        try:
            self.sched.reset_prefix_cache(reset_running_requests=True)
        except RuntimeError as e:
            if "Failed to reset KV cache" not in str(e):
                raise

    def _fail_load(self, ev: FailLoad) -> None:
        # With several KV-cache groups too: a worker-side connector reports the
        # blocks it failed to load by id, and what vLLM does with them (it
        # raises: findings/) is what a real engine meets.
        B = self.cfg.block_size
        for p in self.pending:
            rs = p.obs.get(ev.id)
            if rs is not None and rs.loaded and rs.start - rs.loaded <= ev.first_bad_block * B \
                    < rs.start:
                p.failed[ev.id] = min(ev.first_bad_block, p.failed.get(ev.id, ev.first_bad_block))
                return
        raise EventRejected(f"request {ev.id} has no unprocessed load covering block "
                            f"{ev.first_bad_block}")

    def _finish(self, ev: Finish | Abort) -> None:
        if self._hold_for_engine(ev):
            return
        r = self.sched.requests.get(ev.id)
        if r is None or r.is_finished():
            if any(q.id == ev.id for q in self.queued) or ev.id in self.finished_now:
                return  # already ending (vLLM's finish is idempotent)
            raise EventRejected(f"request {ev.id} is not live")
        status = self.RS.FINISHED_STOPPED if type(ev) is Finish else self.RS.FINISHED_ABORTED
        self._rec("finish", ev.id, "FINISHED_STOPPED" if type(ev) is Finish
                  else "FINISHED_ABORTED")
        self.sched.finish_requests(ev.id, status)

    # --------------------------------------------------------------- counters

    def _status(self, r: Any) -> str:
        st = r.status
        if st == self.RS.RUNNING:
            return "running"
        if st == self.RS.PREEMPTED:
            return "preempted"
        if r.is_finished():
            return "finished"
        return "waiting"

    def _counters(self) -> Counters:
        """Counters of the requests this event may have changed (``touched``:
        added, scheduled or processed in it, preempted, ended, named by it, or
        whose blocks vLLM allocated, popped or freed in it); a request not
        listed keeps the counters it was last listed with
        (``docs/SEMANTICS.md``; ``tests/test_vllm_counters.py`` folds them
        against every live request's at every event). A finished one is listed
        in the event it ended in and in the one its last block left it in;
        then it leaves them, and the driver forgets it once no step in flight
        has it. The cost follows what the event touched, not what is live."""
        reqs: dict[str, ReqCounters] = {}
        gone = []
        active = self.active
        for rid in self.touched:
            r = active.get(rid)
            if r is None:
                continue  # left the counters already
            live = tuple(self.live[rid])
            status = self._status(r)
            reqs[rid] = ReqCounters(r.num_computed_tokens, compat.in_flight(r), live, status)
            if status == "finished" and not any(live):
                gone.append(rid)
        self.touched.clear()
        for rid in gone:
            del active[rid]
        if self.leaving or gone:
            self._forget(gone)
        return Counters(self.pool.get_num_free_blocks(), self.cfg.num_blocks, reqs, self.bound,
                        self._pool_faults())

    def _pool_faults(self) -> tuple[str, ...]:
        """The block pool's own integrity, read off vLLM's objects: its free
        queue walked from head to tail (each block once, as many as
        ``num_free_blocks``, none with a reference left), and no reference
        count below zero."""
        pool = self.pool
        q = getattr(pool, "free_block_queue", None)
        if not all(hasattr(q, a) for a in ("fake_free_list_head", "fake_free_list_tail",
                                            "num_free_blocks")):
            return ()  # a tree whose pool is built otherwise: the sums still judge it
        faults, seen = [], set()
        b = q.fake_free_list_head.next_free_block
        n = len(pool.blocks) + 1
        while b is not None and b is not q.fake_free_list_tail and n > 0:
            if b.block_id in seen:
                faults.append(f"block {b.block_id} is in the free queue twice")
                break
            seen.add(b.block_id)
            if b.ref_cnt != 0:
                faults.append(f"block {b.block_id} is in the free queue with "
                              f"{b.ref_cnt} reference(s) held")
            b, n = b.next_free_block, n - 1
        if b is None:
            faults.append("the free queue is cut off before its tail")
        elif not faults and len(seen) != q.num_free_blocks:
            faults.append(f"the free queue holds {len(seen)} blocks but counts "
                          f"{q.num_free_blocks}")
        # the NULL block's count means nothing (releases before 0.26 drop it on
        # every free of a table that maps it)
        faults += [f"block {x.block_id} has reference count {x.ref_cnt}"
                   for x in pool.blocks if x.ref_cnt < 0 and not x.is_null]
        return tuple(faults)

    def _forget(self, gone: list[str]) -> None:
        """Drop what the driver keeps of finished requests that no step in
        flight scheduled (their outputs still look them up)."""
        self.leaving.extend(gone)
        busy = {rid for p in self.pending for rid in p.obs}
        keep = []
        for rid in self.leaving:
            if rid in busy:
                keep.append(rid)
                continue
            del self.reqs[rid], self.table[rid], self.live[rid]
            self.last_tables.pop(rid, None)
            self.ended.add(rid)
        self.leaving = keep


_MODEL_CONFIGS: dict[int, Any] = {}  # max_model_len -> a ModelConfig never handed out
_PLANS: dict[Config, Any] = {}  # config -> Driver._plan's result (or its refusal)
_block_id = attrgetter("block_id")
_BROKEN = (TypeError, AttributeError, NameError)  # bugs, where a refusal is a ValueError


def _encoder_len(cfg: Config) -> int | None:
    """The encoder's output length of an encoder-decoder config (None: decoder only)."""
    return next((g.param for g in cfg.groups if g.spec.encoder), None)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


