"""kvcheck's own KV connector: a KV consumer (think: a CPU offloader) that
offers the external tokens of ``AddRequest.external_tokens`` and loads them
synchronously, in the step that admits the request.

Only the scheduler role does anything: it answers vLLM's
``get_num_new_matched_tokens`` with the tokens still offered beyond the local
prefix-cache hit, records what vLLM allocated for the load
(``update_state_after_alloc``) and hands the loads of each step to the driver
through ``build_connector_meta``. A failed load is not decided here: the
driver reports it in the step's ``KVConnectorOutput.invalid_block_ids``, as a
worker-side connector would, and vLLM's own recovery runs.

Registered with vLLM's ``KVConnectorFactory`` under :data:`NAME` by
:func:`register` (worker process only: importing this module imports vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

NAME = "KvcheckConnector"


@dataclass
class KvcheckMetadata(KVConnectorMetadata):
    loads: dict[str, int] = field(default_factory=dict)  # rid -> external tokens loaded


class KvcheckConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        # rid -> external tokens E still on offer (until a step admits the request)
        self.offers: dict[str, int] = {}
        self._loads: dict[str, int] = {}

    # --------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        offered = self.offers.get(request.request_id, 0)
        return max(0, offered - num_computed_tokens), False  # synchronous load

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        rid = request.request_id
        if rid in self.offers:
            # Offered once: the request is admitted now (a retry after
            # preemption or a failed load recomputes instead).
            del self.offers[rid]
            if num_external_tokens > 0:
                self._loads[rid] = num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> KvcheckMetadata:
        meta = KvcheckMetadata(loads=self._loads)
        self._loads = {}
        return meta

    def request_finished(self, request: Any, block_ids: Any):
        self.offers.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        return self.request_finished(request, block_ids)

    # ------------------------------------------ worker side (never called here)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def register() -> None:
    """Register :class:`KvcheckConnector` with vLLM's connector factory (once)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, __name__, "KvcheckConnector")
