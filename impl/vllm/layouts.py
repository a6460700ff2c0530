"""The block sizes vLLM's engine builds, and whether a trace's layout is one.

On CUDA, vLLM 0.33 builds attention blocks of ``cache_config.block_size``
tokens: 16 unless the user sets another, and FlashAttention, the backend
these models run on, takes multiples of 16. A pure Mamba model in ``align``
mode takes the same block size for its states. A hybrid of attention and
Mamba layers shares one pool, so ``Platform._align_hybrid_block_size``
grows the attention block until its page holds one Mamba state, and the
Mamba block follows (``mamba_block_size``)::

    page(attention, 1 token) * B  >=  page(Mamba state)
    B = 16 * ceil(page(Mamba state) / (16 * page(attention, 1 token)))

    Qwen3-Next-80B-A3B (GDN, bf16)   TP 1-2: 544   TP 4: 272   TP 8: 144
    Jamba-v0.1 (Mamba-1, bf16)       TP 1-8: 80

``families/NAME/config.json`` hold those models' published dimensions (a
config, no weights); :func:`measure` runs vLLM's own function on them with
CUDA's FlashAttention backend, and ``families/block_sizes.json`` keeps what
it returned (``scripts/engine_layouts.py`` writes it,
``tests/test_engine_layouts.py`` holds it to vLLM). The fuzzer draws these
sizes with ``--block-size engine``; :func:`note` says of any trace whether
its layout is one no published model builds (the small blocks that make
short runs reach a block's edge are such layouts).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

FAMILIES_DIR = Path(__file__).resolve().parent / "families"
TABLE = FAMILIES_DIR / "block_sizes.json"
# the published model each family's config.json is taken from
FAMILIES = {"qwen3-next": "Qwen/Qwen3-Next-80B-A3B-Instruct", "jamba": "ai21labs/Jamba-v0.1"}
TENSOR_PARALLEL = (1, 2, 4, 8)


def measure() -> dict[str, Any]:
    """vLLM's block sizes for every family and tensor-parallel size, from
    vLLM itself (the release on ``sys.path``; needs ``HF_HUB_OFFLINE=1``)."""
    import vllm
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    families: dict[str, dict[str, int]] = {}
    for name in FAMILIES:
        model = ModelConfig(model=str(FAMILIES_DIR / name), skip_tokenizer_init=True,
                            max_model_len=4096)
        sizes = {}
        for tp in TENSOR_PARALLEL:
            cache_config = CacheConfig(block_size=CacheConfig.DEFAULT_BLOCK_SIZE,
                                       enable_prefix_caching=True, mamba_cache_mode="align")
            vc = VllmConfig(model_config=model, cache_config=cache_config,
                            device_config=DeviceConfig(device="cpu"),
                            parallel_config=ParallelConfig(tensor_parallel_size=tp))
            # what update_block_size_for_backend does on CUDA for a hybrid
            vc.cache_config.block_size = CacheConfig.DEFAULT_BLOCK_SIZE
            Platform._align_hybrid_block_size.__func__(Platform, vc, FlashAttentionBackend)
            assert vc.cache_config.mamba_block_size == vc.cache_config.block_size
            sizes[str(tp)] = vc.cache_config.block_size
        families[name] = sizes
    kernel = FlashAttentionBackend.get_supported_kernel_block_sizes()
    return {"release": vllm.__version__, "attention": CacheConfig.DEFAULT_BLOCK_SIZE,
            "kernel_multiple": min(getattr(s, "base", s) for s in kernel),
            "families": families}


@cache
def table() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def attention_block_size() -> int:
    """The block size vLLM builds for attention on CUDA unless told otherwise."""
    return int(table()["attention"])


def hybrid_block_sizes() -> tuple[int, ...]:
    """Every block size vLLM pads a Mamba hybrid of a known family to."""
    return tuple(sorted({b for f in table()["families"].values() for b in f.values()}))


def _hybrid_sizes_text() -> str:
    parts = []
    for name, sizes in table()["families"].items():
        vals = sorted(set(sizes.values()))
        parts.append(f"{FAMILIES[name].split('/')[-1]} {'-'.join(map(str, (vals[0], vals[-1])))}"
                     if len(vals) > 1 else f"{FAMILIES[name].split('/')[-1]} {vals[0]}")
    return ", ".join(parts)


def note(config: Any) -> str | None:
    """One line where ``config``'s layout is one no published model builds
    on vLLM (a model.events.Config); None where the engine builds it."""
    sizes = {g.block_size or config.block_size for g in config.groups}
    stateful = any(g.spec.holds_state for g in config.groups)
    # the model's own attention layers: a drafter's (EAGLE, MTP) does not make
    # a pure Mamba model a hybrid (vLLM's is_hybrid)
    attention = [g for g in config.groups if not g.spec.holds_state and not g.draft]
    if stateful and attention:
        if sizes <= set(hybrid_block_sizes()):
            return None
        return (f"layout no published model builds: blocks of {_sizes(sizes)} tokens beside "
                f"a Mamba state, where vLLM pads a hybrid's blocks until one holds a state "
                f"({_hybrid_sizes_text()} tokens by tensor-parallel size)")
    multiple = int(table()["kernel_multiple"])
    if all(b % multiple == 0 for b in sizes):
        return None
    if stateful:  # a pure Mamba model: no attention backend takes part
        return (f"layout no published model builds: Mamba blocks of {_sizes(sizes)} tokens, "
                f"where vLLM builds {attention_block_size()} unless told otherwise")
    return (f"layout no published model builds: blocks of {_sizes(sizes)} tokens, where vLLM "
            f"on CUDA builds {attention_block_size()} unless told otherwise and its "
            f"FlashAttention backend takes multiples of {multiple}")


def _sizes(sizes: set[int]) -> str:
    return "/".join(map(str, sorted(sizes)))
