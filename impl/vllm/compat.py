"""Everything that differs between vLLM releases, in one place.

Two halves:

* release bookkeeping that needs neither vLLM nor torch (the parent process,
  ``scripts/install-vllm.sh``): which releases are supported, where one is
  installed, what version a source checkout is, whether a tree tracks
  in-flight tokens;
* adapters used inside the worker process, given the imported vLLM modules:
  building a request, a scheduler, a step's output; reading counters;
  entering the preemption path. Each one names the releases it covers.

Differences found between 0.25.1, 0.26.0 and 0.33.0 (what the adapters and
the driver cover; impl/vllm/__init__.py tells what they mean for the checks):

================================  ==========  ==========  ========================
                                  0.25.1      0.26.0      0.33.0
================================  ==========  ==========  ========================
Request.num_in_flight_tokens      absent      present     present
out-of-window free basis          c           c - f       c - f
preempted request's in-flight     applied     applied     stale: tokens delivered,
output                                                    counters untouched;
                                                          resume waits for it
_preempt_request(...)             (r, ts)     (r, ts)     (r, ts, drop_stale_output)
pop_blocks_for_free result        all slots   all slots   leading NULLs trimmed
KVConnectorOutput.failed_recving  absent      absent      present (async loads)
invalid_block_ids, >1 group       unpack err  unpack err  RuntimeError
get_request_block_hasher          (B, fn)     (B, fn)     (B, fn, lookahead=0)
async + PP (Model Runner V2)      refused     refused     yes
================================  ==========  ==========  ========================
"""

from __future__ import annotations

import functools
import inspect
import re
import subprocess
from pathlib import Path
from typing import Any

MIN_RELEASE = (0, 25, 1)
MAX_LINE = (0, 33)
TESTED = ("0.25.1", "0.26.0", "0.33.0")

REPO = Path(__file__).resolve().parents[2]
INSTALL_ROOT = REPO / ".vllm"


# ------------------------------------------------------------------ releases


def parse_release(version: str) -> tuple[int, int, int] | None:
    m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)", version.strip())
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def _range_text() -> str:
    return f"{'.'.join(map(str, MIN_RELEASE))} .. {'.'.join(map(str, MAX_LINE))}.x"


def release_problem(version: str) -> str | None:
    """None if ``version`` is a supported release, else a one-line reason."""
    v = parse_release(version)
    if v is None:
        return f"{version!r} is not a vLLM release number like 0.33.0 (supported: {_range_text()})"
    if v < MIN_RELEASE or v[:2] > MAX_LINE:
        return (
            f"vllm {version} is not supported (supported: {_range_text()}; "
            f"tested {', '.join(TESTED)})"
        )
    return None


def install_dir(version: str) -> Path:
    return INSTALL_ROOT / version


def install_command(version: str) -> str:
    return f"scripts/install-vllm.sh {version}"


def installed_releases() -> list[str]:
    """Releases installed under .vllm/, oldest first."""
    found = []
    if INSTALL_ROOT.is_dir():
        for d in INSTALL_ROOT.iterdir():
            v = parse_release(d.name)
            if v and (d / "vllm" / "__init__.py").is_file() and not release_problem(d.name):
                found.append((v, d.name))
    return [name for _, name in sorted(found)]


def checkout_version(tree: Path) -> str | None:
    """The release line of a vLLM source checkout (``tree`` holds ``vllm/``):
    from its generated ``vllm/_version.py``, else from ``git describe``."""
    vf = tree / "vllm" / "_version.py"
    if vf.is_file():
        m = re.search(r"""(?:__version__|version)\s*(?::[^=]*)?=\s*['"]v?(\d+\.\d+\.\d+)""",
                      vf.read_text(errors="replace"))
        if m:
            return m[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(tree), "describe", "--tags", "--abbrev=0"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"v?(\d+\.\d+\.\d+)", out.stdout.strip())
    return m[1] if out.returncode == 0 and m else None


def tracks_in_flight(vllm_pkg: Path) -> bool:
    """Whether the vLLM package at ``vllm_pkg`` has ``Request.num_in_flight_tokens``
    (the settled-count fix). Read from the source, without importing it."""
    try:
        text = (vllm_pkg / "v1" / "request.py").read_text(errors="replace")
    except OSError:
        return False
    return "num_in_flight_tokens" in text


# ------------------------------------------------ worker-side adapters (vLLM)


def _params(fn: Any) -> frozenset[str]:
    """The parameter names of ``fn`` (a bound method: of its function, self
    left out), read once per function."""
    func = getattr(fn, "__func__", None)
    return _func_params(fn) if func is None else _bound_params(func)


@functools.cache
def _func_params(fn: Any) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


@functools.cache
def _bound_params(func: Any) -> frozenset[str]:
    return frozenset(list(inspect.signature(func).parameters)[1:])


def make_sampling_params(SamplingParams: type, max_tokens: int) -> Any:
    """Greedy-irrelevant params: the engine stops only on max_tokens (EOS ignored)."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def make_request(Request: type, rid: str, prompt: list[int], params: Any,
                 block_hasher: Any, arrival: float, mm_features: Any = None) -> Any:
    """``Request(...)`` from the signature the release has (all: request_id,
    prompt_token_ids, sampling_params, pooling_params, arrival_time,
    block_hasher; older lines also take ``eos_token_id``); ``mm_features``:
    an encoder-decoder request's encoder input (:func:`encoder_input`)."""
    kw: dict[str, Any] = dict(
        request_id=rid, prompt_token_ids=prompt, sampling_params=params,
        pooling_params=None, arrival_time=arrival, block_hasher=block_hasher,
    )
    if mm_features is not None:
        kw["mm_features"] = mm_features
    names = _params(Request.__init__)
    if "eos_token_id" in names:
        kw["eos_token_id"] = None
    return Request(**{k: v for k, v in kw.items() if k in names})


def encoder_input(rid: str, length: int) -> list[Any]:
    """The encoder input of an encoder-decoder request as the engine's input
    processor hands it to the scheduler: one audio item at offset 0 whose
    encoder emits ``length`` outputs (vLLM's Whisper: ``max_source_positions``),
    its data already with the worker (``data=None``, as for a cached item)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(data=None, modality="audio", identifier=f"{rid}-audio",
                                  mm_position=PlaceholderRange(offset=0, length=length))]


def make_block_hasher(kv_cache_utils: Any, hashing: Any, algo: str, block_size: int,
                      lookahead: int = 0) -> Any:
    """The engine core's request block hasher; ``lookahead``: tokens past each
    block its hash covers (0.33's ``num_hash_lookahead_tokens``, EAGLE)."""
    fn = hashing.get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    if lookahead:
        return kv_cache_utils.get_request_block_hasher(block_size, fn, lookahead)
    return kv_cache_utils.get_request_block_hasher(block_size, fn)


@functools.cache
def _init_params(cls: type) -> frozenset[str]:
    """Named parameters of ``cls(...)``, looking through ``*args, **kwargs``
    pass-through constructors (AsyncScheduler) to the base that names them."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            ps = inspect.signature(klass.__init__).parameters.values()
            names = {p.name for p in ps if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            if names - {"self"}:
                return frozenset(names)
    return frozenset()


def scheduler_kwargs(cls: type, block_size: int, hash_block_size: int) -> dict[str, Any]:
    names = _init_params(cls)
    kw: dict[str, Any] = {}
    if "block_size" in names:
        kw["block_size"] = block_size
    if "hash_block_size" in names:
        kw["hash_block_size"] = hash_block_size
    if "log_stats" in names:
        kw["log_stats"] = False
    return kw


# Bytes of device memory offered to vLLM's planner: far more than any pool the
# checker asks for, so ``num_gpu_blocks_override`` alone decides the pool size.
PLANNER_MEMORY = 1 << 40


def planned_on(vllm_config: Any, num_blocks: int, kvc: Any = None) -> None:
    """What :func:`plan_kv_cache` sets on the VllmConfig it plans with (the
    planner's own writes to it, the layout and saved overrides, are the same
    for every plan of one VllmConfig); on releases the engine's steps plan
    (impl/vllm/build.py), the block-size update and capacity of ``kvc`` too."""
    if kvc is not None and getattr(kvc, "hash_block_size", None) is not None:
        from vllm.v1.core import kv_cache_utils

        if hasattr(kv_cache_utils, "update_kv_cache_capacity"):
            from impl.vllm import build

            build.replan(vllm_config, kvc, num_blocks)
            return
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False


def plan_kv_cache(vllm_config: Any, layer_specs: dict[str, Any],
                  num_blocks: int) -> tuple[Any, int, int]:
    """The KV-cache layout as vLLM's engine core plans it
    (``EngineCore._initialize_kv_caches``), for one worker whose layers are
    ``layer_specs``: ``num_gpu_blocks_override = num_blocks``, then the
    release's own grouping, page-size unification and pool sizing
    (``get_kv_cache_configs``; 0.33 first resolves the cache layout and groups
    the layers with ``get_global_kv_cache_groups``, which also sets sliding
    windows' ``extra_retained_tokens`` and EAGLE groups), then
    ``resolve_kv_cache_block_sizes``. Returns ``(KVCacheConfig,
    scheduler_block_size, hash_block_size)``.

    The one thing set by hand is the hybrid-manager switch: vLLM's CPU
    platform turns the hybrid KV-cache manager off (``support_hybrid_kv_cache``
    is False there), which would plan every sliding or chunked layer as full
    attention; the checker drives the engine as it runs on CUDA, where it stays
    on for these configs (kvcheck's connector supports HMA; chunked-local
    layers are planned as with ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``).
    """
    import dataclasses

    from vllm.v1.core import kv_cache_utils

    try:
        from vllm.v1.core import kv_cache_planning as planning  # 0.33
    except ImportError:  # 0.25.1, 0.26.0: planning lives in kv_cache_utils
        planning = kv_cache_utils
    from impl.vllm import build

    if build.engine_built(planning):  # the engine's own steps (impl/vllm/build.py)
        return build.plan_kv_cache(vllm_config, layer_specs, num_blocks)
    planned_on(vllm_config, num_blocks)
    specs = [dict(layer_specs)]
    memory = [PLANNER_MEMORY]
    if hasattr(planning, "get_global_kv_cache_groups"):
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

        resolve_kv_cache_layout(vllm_config, [["NHD"]], list(layer_specs.values()))
        groups = planning.get_global_kv_cache_groups(vllm_config, specs)
        kvc = planning.get_kv_cache_configs(vllm_config, specs, memory, groups)[0]
    else:
        kvc = planning.get_kv_cache_configs(vllm_config, specs, memory)[0]
    resolve = getattr(planning, "resolve_kv_cache_block_sizes", None) or \
        kv_cache_utils.resolve_kv_cache_block_sizes
    scheduler_block_size, hash_block_size = resolve(kvc, vllm_config)
    if "hash_block_size" in {f.name for f in dataclasses.fields(kvc)}:
        kvc.hash_block_size = hash_block_size  # 0.33: the engine core records it
    return kvc, scheduler_block_size, hash_block_size


def dataclass_kwargs(cls: type, **kw: Any) -> Any:
    """Instantiate a vLLM output dataclass with the fields this release has."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kw.items() if k in names})


def in_flight(request: Any) -> int | None:
    """``num_in_flight_tokens`` (>= 0.26.0), else None."""
    return getattr(request, "num_in_flight_tokens", None)


def admission_cap(manager: Any) -> int | None:
    """The per-request block cap a single-type manager admits with (None: none)."""
    return getattr(manager, "_max_admission_blocks_per_request", None)


def preempt(scheduler: Any, request: Any, timestamp: float) -> None:
    """The scheduler's own preemption path, entered as its schedule() enters it
    (pool pressure): remove from the running list, then ``_preempt_request``.
    0.33 passes ``drop_stale_output=self.requires_kv_delivery`` there."""
    scheduler.running.remove(request)
    if "drop_stale_output" in _params(scheduler._preempt_request):
        scheduler._preempt_request(
            request, timestamp,
            drop_stale_output=bool(getattr(scheduler, "requires_kv_delivery", False)),
        )
    else:
        scheduler._preempt_request(request, timestamp)
