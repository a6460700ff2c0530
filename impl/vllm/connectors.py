"""vLLM's shipped KV connectors, and whether their scheduler half runs here.

:data:`SHIPPED` lists every connector under vLLM 0.33.0's
``distributed/kv_transfer/kv_connector/v1`` with the settings a user gives it
(``KVTransferConfig.kv_connector_extra_config``). :func:`probe_job` (run in a
vLLM worker: ``properties.jobs._call(target, 0, "impl.vllm.connectors:probe_job",
())``) builds each one's scheduler half as vLLM's engine does: a
``KVTransferConfig`` in the ``VllmConfig``, the KV-cache layout planned by
:mod:`impl.vllm.build` (so ``kv_cache_tensors`` are the planner's, which
SimpleCPUOffload sizes its CPU pool from), the scheduler constructing the
connector with ``KVConnectorRole.SCHEDULER`` and binding the block pool. What
that says, one line per connector, is the table of docs/TARGETS.md
(``scripts/connector_table.py`` writes it; ``tests/test_vllm_connectors.py``
holds it to what the probe says).

Driven today: kvcheck's own connector (:mod:`impl.vllm.connector`), the KV
consumer of ``--hazard unordered``. A shipped connector is driven once a
stand-in for its worker half reports its transfers through
``KVConnectorOutput`` as the real worker does.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

CPU_BYTES = 1 << 24  # a CPU tier of 16 MiB for the offloading connectors


@dataclass(frozen=True)
class Shipped:
    name: str  # the factory name (KVTransferConfig.kv_connector)
    module: str  # its files under kv_connector/v1 (" + " between two)
    what: str  # what it moves, in a few words
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    driven: str = ""  # "" not driven; else how kvcheck drives it


def _offload(name: str) -> dict[str, Any]:
    return {"kv_connector": name, "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": CPU_BYTES}}


SHIPPED: tuple[Shipped, ...] = (
    Shipped("ExampleConnector", "example_connector.py",
            "every request's KV to files, prefix hits loaded back",
            {"shared_storage_path": "<tmp>"}),
    Shipped("DecodeBenchConnector", "decode_bench_connector.py",
            "fills the prompt's KV with noise, to benchmark decode alone"),
    Shipped("LMCacheConnectorV1", "lmcache_connector.py", "LMCache's CPU/disk/remote tiers"),
    Shipped("LMCacheMPConnector", "lmcache_mp_connector.py", "LMCache in a server process"),
    Shipped("NixlConnector", "nixl/", "prefill to decode over NIXL (pull)"),
    Shipped("NixlPushConnector", "nixl/", "prefill to decode over NIXL (push)"),
    Shipped("MooncakeConnector", "mooncake/", "prefill to decode over Mooncake's transfer engine"),
    Shipped("MooncakeStoreConnector", "mooncake/store/", "Mooncake's distributed KV store"),
    Shipped("MoRIIOConnector", "moriio/", "prefill to decode over AMD's MoRI-IO"),
    Shipped("FlexKVConnectorV1", "flexkv_connector.py", "FlexKV's CPU/SSD tiers"),
    Shipped("HF3FSKVConnector", "hf3fs/", "3FS (a distributed file system) as a KV store"),
    Shipped("UMBPStoreConnector", "umbp/", "UMBP's store, through a runtime adapter",
            {"<module>": "vllm.distributed.kv_transfer.kv_connector.v1.umbp.connector"}),
    Shipped("HiSparseConnector", "hisparse/", "sparse attention's KV offloaded to the host"),
    Shipped("ExampleHiddenStatesConnector", "example_hidden_states_connector.py",
            "the hidden states of speculative decoding's extraction to files",
            {"shared_storage_path": "<tmp>"}),
    Shipped("OffloadingConnector", "offloading_connector.py + offloading/",
            "GPU blocks to a CPU tier",
            {"cpu_bytes_to_use": CPU_BYTES}),
    Shipped("SimpleCPUOffloadConnector", "simple_cpu_offload_connector.py",
            "GPU blocks to a CPU tier, eagerly or lazily", {"cpu_bytes_to_use": CPU_BYTES}),
    Shipped("MultiConnector", "multi_connector.py",
            "several connectors at once: the first with a hit loads, all store",
            {"connectors": [_offload("OffloadingConnector"),
                            _offload("SimpleCPUOffloadConnector")]}),
)


def outcome(e: BaseException | None) -> str:
    """One line on what building a connector's scheduler half did: ``builds``,
    the package it needs, or vLLM's refusal."""
    if e is None:
        return "builds"
    missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
    if missing:
        return f"needs `{missing.split('.')[0]}`"
    text = " ".join(str(e).split())
    m = re.search(r"Value error, (.+?)(?: \[type=|$)", text)  # pydantic's wrapping
    if m:
        text = m[1]
    m = re.search(r"(\w+) is not installed", text)
    if m:
        return f"needs `{m[1].lower()}`"
    return f"refused: {text[:110]}"


def probe_job() -> dict[str, str]:
    """Each shipped connector's :func:`outcome`, built on full attention
    (blocks of 16, prefix caching on, role ``kv_both``)."""
    import logging

    from impl.vllm import build

    logging.disable(logging.WARNING)  # the connectors log their setup
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = {}
            for c in SHIPPED:
                try:
                    _build(c, tmp, build)
                    out[c.name] = outcome(None)
                except Exception as e:  # noqa: BLE001 - what the user would meet
                    out[c.name] = outcome(e)
            return out
    finally:
        logging.disable(logging.NOTSET)


def _build(c: Shipped, tmp: str, build: Any) -> Any:
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from impl.vllm.driver import MODEL_DIR

    extra = {k: (tmp if v == "<tmp>" else v) for k, v in c.extra.items() if k != "<module>"}
    ktc = KVTransferConfig(kv_connector=c.name, kv_role="kv_both",
                           kv_connector_extra_config=extra,
                           kv_connector_module_path=c.extra.get("<module>"))
    vc = VllmConfig(
        model_config=ModelConfig(model=str(MODEL_DIR), skip_tokenizer_init=True,
                                 max_model_len=512),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                         max_model_len=512, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return build.build_scheduler(vc, {"layer.0": spec}, 64)


BEGIN, END = "<!-- connectors:begin -->", "<!-- connectors:end -->"


def render(outcomes: dict[str, str]) -> str:
    """The table of docs/TARGETS.md, from :func:`probe_job`'s outcomes."""
    rows = ["| connector | file (`kv_connector/v1/`) | what it moves | its scheduler half "
            "here | driven |", "|---|---|---|---|---|"]
    for c in SHIPPED:
        got = outcomes.get(c.name, "not probed")
        driven = c.driven or ("no: no stand-in for its worker half yet" if got == "builds"
                              else "no")
        rows.append(f"| {c.name} | {c.module} | {c.what} | {got} | {driven} |")
    return "\n".join(rows)
