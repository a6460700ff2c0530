"""SGLang 0.5.23's real scheduler-side objects on CPU (installed by
``make sglang`` into .sglang/0.5.23): its decode-time sliding-window free,
driven through its own ``Req``, ``ReqToTokenPool``, ``SWAKVPool`` and
``SWATokenToKVPoolAllocator`` (impl/sglang/probe.py, frees read off the
allocator), frees exactly what the ``sglang`` policy of model/policy.py says,
one token later than the settled rule. A missing install fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from impl.sglang import compat
from model import windows
from model.events import Group
from model.policy import Counts, basis

VERSION = "0.5.23"
CASES = [(4, 10, 1), (4, 10, 3), (16, 10, 1), (3, 20, 5), (1, 5, 2), (8, 8, 9)]


def _probe(cases, mode=()):
    d = compat.install_dir(VERSION)
    assert (d / "sglang" / "__init__.py").is_file(), (
        f"sglang {VERSION} is not installed in {d}: run {compat.install_command(VERSION)}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), str(compat.REPO)]),
               OMP_NUM_THREADS="1")
    args = [str(x) for c in cases for x in c]
    p = subprocess.run([sys.executable, "-m", "impl.sglang.probe", *mode, *args], cwd=compat.REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_sglang_decode_free_is_the_sglang_policy():
    got = _probe(CASES)
    assert len(got) == len(CASES)
    freed_any = False
    for (w, prompt, outputs), r in zip(CASES, got, strict=True):
        g = Group("sliding", w)
        # the decode being scheduled: the step before it (position
        # prompt + outputs - 1) still in flight, everything earlier processed
        counts = Counts(computed=prompt + outputs, in_flight=1)
        want = windows.skipped(g, basis("sglang", g, counts))
        lo, hi = r["freed"]
        assert hi == want and (lo == 0 or hi == 0), (w, prompt, outputs, r)
        # one token later than vLLM's settled rule wherever a free happens
        if want:
            freed_any = True
            assert windows.skipped(g, basis("settled", g, counts)) == want + 1
    assert freed_any


def test_radix_chunked_prefill_frees_slots_its_chunk_in_flight_still_reads():
    """findings/sglang/README.md, finding 1: the checkpoint of a chunked
    request (next iteration, its chunk still in flight) frees SWA slots that
    chunk reads: the optimistic count. Stream-ordered in SGLang as shipped."""
    cases = [(4, 16, 8), (4, 24, 16), (2, 12, 6)]
    got = _probe(cases, ("--chunked",))
    assert [r["freed"] for r in got] == [[[0, 3]], [[0, 11]], [[0, 3]]]
    for (w, prompt, chunk), r in zip(cases, got, strict=True):
        g = Group("sliding", w)
        assert r["chunk"] == [0, chunk] and r["next_chunk"] == [chunk, min(prompt, 2 * chunk)]
        (lo, hi), = r["freed"]
        # positions the in-flight chunk [0, chunk) reads, freed under it
        read = {x for t in range(chunk) for x in range(windows.window(g, t)[0], t + 1)}
        assert read & set(range(lo, hi))
        # the settled count (nothing processed yet) frees nothing
        assert windows.skipped(g, basis("settled", g, Counts(chunk, chunk))) == 0


def test_shims_stub_only_what_is_missing_and_fail_loudly_when_used():
    code = (
        "from impl.sglang import shims\n"
        "stubbed = shims.install()\n"
        "import torchvision.transforms as T\n"
        "try:\n"
        "    T.Resize(4)\n"
        "except shims.ShimUsed:\n"
        "    print('raised', stubbed)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=compat.REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "raised ['torchvision']"


def test_unsupported_release_is_refused_by_the_installer():
    p = subprocess.run(["bash", "scripts/install-sglang.sh", "9.9.9"], cwd=compat.REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "not supported" in p.stderr
