"""vLLM's shipped KV connectors (impl/vllm/connectors.py, docs/TARGETS.md).

The table of docs/TARGETS.md is what building each connector's scheduler
half on this machine does; every connector vLLM 0.33.0 ships is in it; the
scheduler builder keeps the hybrid KV-cache manager on only where CUDA would
(a connector without HMA support turns it off there, and is built, not
refused)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from impl.vllm.connectors import SHIPPED, outcome, render
from properties.jobs import _call

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
V1 = ROOT / ".vllm" / "0.33.0" / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
# helpers of the connectors, not connectors
NOT_CONNECTORS = {"__init__.py", "base.py", "metrics.py", "ssm_conv_transfer_utils.py",
                  "lmcache_integration", "__pycache__"}


def test_every_connector_vllm_ships_is_in_the_table():
    files = {p.name for p in V1.iterdir()} - NOT_CONNECTORS
    listed = {m.rstrip("/").split("/")[0] for c in SHIPPED for m in c.module.split(" + ")}
    assert files == listed, (files - listed, listed - files)
    factory = (V1.parent / "factory.py").read_text()
    registered = set(re.findall(r'register_connector\(\s*"(\w+)"', factory))
    names = {c.name for c in SHIPPED}
    # NixlPullConnector is NixlConnector's other name; UMBP is not registered
    assert registered - names == {"NixlPullConnector"}, registered - names
    assert names - registered == {"UMBPStoreConnector"}, names - registered


def test_the_table_is_what_the_probe_says():
    got = _call("vllm@0.33.0", 0, "impl.vllm.connectors:probe_job", ())
    assert set(got) == {c.name for c in SHIPPED}
    # the offloading connectors and vLLM's example build here; a connector
    # without HMA support is built with the hybrid manager off, as on CUDA
    for name in ("OffloadingConnector", "SimpleCPUOffloadConnector", "MultiConnector",
                 "ExampleConnector"):
        assert got[name] == "builds", (name, got[name])
    assert got["LMCacheConnectorV1"] == "needs `lmcache`"
    doc = (ROOT / "docs" / "TARGETS.md").read_text()
    assert render(got) in doc, "docs/TARGETS.md: run scripts/connector_table.py"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "connector_table.py"),
                        "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_an_outcome_is_one_line():
    assert outcome(None) == "builds"
    e = ModuleNotFoundError("No module named 'lmcache.v1'", name="lmcache.v1")
    assert outcome(e) == "needs `lmcache`"
    assert outcome(ImportError("FlexKV is not installed. Run pip install")) == "needs `flexkv`"
    wrapped = ValueError("1 validation error for VllmConfig\n  Value error, HiSparse "
                         "needs CUDA. [type=value_error, input_value=...]")
    assert outcome(wrapped) == "refused: HiSparse needs CUDA."
