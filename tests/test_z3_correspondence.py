"""The Z3 terms say what model/windows.py says.

The proofs in prove/proof.py are about the Z3 terms of prove/z3model.py; these
tests tie those terms to the executable model (and, where a vLLM tree is at
hand, to vLLM's own get_num_skipped_tokens), on many sampled inputs each.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import z3

from model import windows
from model.events import Group
from prove.z3_arith import LEMMAS, Arith, prove_lemmas
from prove.z3model import Z3_KINDS as KINDS
from prove.z3model import (
    eval_freeable,
    eval_live_bound,
    eval_skipped,
    eval_skipped_many,
    eval_term,
    exact_bound,
    exact_bound_tokens,
)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = 10_000


def _param(rng: random.Random, kind: str, B: int) -> int:
    if kind == "sliding":
        return rng.randint(1, 300)
    if kind == "chunked_local":
        return B * rng.randint(1, 12)  # Config.validate: a multiple of B
    return 0


def _cases(seed: int, n: int = SAMPLES):
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.choice(KINDS)
        B = rng.choice([1, 2, 3, 4, 5, 8, 16, 32, rng.randint(1, 64)])
        yield rng, kind, B, _param(rng, kind, B)


def test_window_lo_matches_windows():
    for rng, kind, _b, param in _cases(1):
        t = rng.randint(0, 2000)
        got = eval_term("window_lo", kind, t=t, param=param)
        assert got == windows.window(Group(kind, param), t)[0], (kind, param, t)


def test_skipped_matches_windows():
    for rng, kind, _b, param in _cases(2):
        n = rng.randint(-3, 2000)
        assert eval_skipped(kind, param, n) == windows.skipped(Group(kind, param), n), (
            kind, param, n)


def test_freeable_matches_windows():
    for rng, kind, B, param in _cases(3):
        n = rng.randint(-3, 2000)
        want = windows.freeable(Group(kind, param), n, B)
        assert eval_freeable(kind, param, n, B) == want, (kind, param, n, B)
        tokens = eval_term("freeable_tokens", kind, n=n, param=param, block_size=B)
        assert tokens == want * B


def test_live_bound_matches_windows():
    for rng, kind, B, param in _cases(4):
        L = rng.randint(1, 5000)
        ahead = rng.randint(0, 4000)
        want = windows.live_bound(Group(kind, param), B, L, ahead)
        got = eval_live_bound(kind, param, B, L, ahead)
        assert got == want, (kind, param, B, L, ahead)
        tokens = eval_term("live_bound_tokens", kind, param=param, block_size=B,
                           max_model_len=L, tokens_ahead=ahead)
        assert tokens == want * B


def test_exact_bound_term_matches_its_python_twin():
    Bv, W, L, A = z3.Ints("B W L A")
    terms = {k: exact_bound_tokens(k, L, A, W, Arith(Bv, C=W)) for k in KINDS}
    for rng, kind, B, param in _cases(5, 3000):
        Lv, Av = rng.randint(2, 5000), rng.randint(0, 4000)
        got = z3.simplify(z3.substitute(terms[kind], (Bv, z3.IntVal(B)), (W, z3.IntVal(param)),
                                        (L, z3.IntVal(Lv)), (A, z3.IntVal(Av))))
        assert got.as_long() == exact_bound(kind, B, Lv, Av, param) * B


def test_exact_bound_is_the_largest_span_a_window_keeps():
    """Brute force: over every settled count s, the blocks touched by
    [lo(s), s + ahead) (what the settled manager holds) peak at exact_bound."""
    rng = random.Random(6)
    for _ in range(300):
        kind = rng.choice(("sliding", "chunked_local", "mamba"))
        B = rng.randint(1, 8)
        param = _param(rng, kind, B) if kind != "sliding" else rng.randint(1, 40)
        ahead = rng.randint(0, 40)
        g = Group(kind, param)
        most = 0
        for s in range(0, 4 * (param + B + ahead) + 4):
            lo = windows.skipped(g, s)
            most = max(most, windows.blocks_for(s + ahead, B) - lo // B)
        big = 10 ** 6
        assert most == exact_bound(kind, B, big, ahead, param), (kind, B, param, ahead)
        assert most <= windows.live_bound(g, B, big, ahead)


def test_eval_skipped_many():
    assert eval_skipped_many("sliding", 4, [0, 3, 7, 8]) == [0, 0, 4, 5]
    assert eval_skipped_many("chunked_local", 8, [7, 8, 13]) == [0, 8, 8]
    assert eval_skipped_many("mamba", 0, [0, 1, 7]) == [0, 0, 6]
    assert eval_skipped_many("full", 0, [0, 100]) == [0, 0]


def test_every_lemma_is_proved_for_all_integers():
    results = prove_lemmas()
    assert [r.name for r in results] == [lem.name for lem in LEMMAS]
    assert all(r.status == "proved" for r in results), [
        (r.name, r.status) for r in results if r.status != "proved"]


def test_abstract_lemmas_do_not_prove_false_things():
    """The uninterpreted block arithmetic with its lemma instances still has
    models: a wrong claim is not provable from the lemmas."""
    B, x = z3.Ints("B x")
    ar = Arith(B, abstract=True, tag="_t")
    claim = ar.fb(x) == x  # false in general
    sol = z3.Solver()
    hyps = ar.side_conditions() + [x >= 0]
    sol.add(*hyps, *ar.instances(hyps + [z3.Not(claim)]), z3.Not(claim))
    assert sol.check() == z3.sat


# ------------------------------------------------------------- vLLM's own

_VLLM_SNIPPET = r"""
import json, sys
from vllm.v1.core import single_type_kv_cache_manager as m
cases = json.loads(sys.stdin.read())
out = []
for kind, param, n in cases:
    if kind == "sliding":
        mgr = m.SlidingWindowManager.__new__(m.SlidingWindowManager)
        mgr.sliding_window = param
        mgr.extra_retained_tokens = 0
    elif kind == "chunked_local":
        mgr = m.ChunkedLocalAttentionManager.__new__(m.ChunkedLocalAttentionManager)
        mgr.attention_chunk_size = param
    elif kind == "mamba":
        mgr = m.MambaManager.__new__(m.MambaManager)
    else:
        mgr = m.FullAttentionManager.__new__(m.FullAttentionManager)
    out.append(mgr.get_num_skipped_tokens(n))
print(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.33.0", "0.25.1"])
def test_skipped_matches_vllm_get_num_skipped_tokens(version):
    tree = ROOT / ".vllm" / version
    if not (tree / "vllm").is_dir():
        pytest.fail(f"no vLLM {version} tree at {tree}: run make vllm VLLM={version}")
    rng = random.Random(7)
    cases = []
    for _ in range(SAMPLES):
        kind = rng.choice(KINDS)
        param = _param(rng, kind, rng.choice([1, 4, 16]))
        cases.append((kind, param, rng.randint(0, 5000)))
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", _VLLM_SNIPPET], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        pytest.fail(f"vLLM {version} not importable: {proc.stderr.strip().splitlines()[-1:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (kind, param, n), v in zip(cases, got, strict=True):
        # vLLM's Mamba manager returns n - 1 (= -1 at n = 0): "nothing to skip"
        assert max(0, v) == eval_skipped(kind, param, n), (version, kind, param, n, v)
