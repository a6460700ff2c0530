"""model/: events and traces round-trip and reject bad input; windows agree
with their definitions."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from model.events import (
    AddRequest,
    Config,
    FailLoad,
    Group,
    Process,
    Schedule,
    Trace,
    TraceError,
    config_for,
)
from model.policy import Counts, basis
from model.windows import (
    freeable,
    freeable_blocks,
    live_bound,
    read_blocks,
    skipped,
    startup_blocks,
    window,
)


def _trace(**kw):
    return Trace(config_for("sliding", **kw),
                 [AddRequest("r0", 100, 8, 32), Schedule(), FailLoad("r0", 1),
                  Process({"r0": 0})])


def test_trace_round_trip(tmp_path):
    t = _trace(spec_tokens=2)
    p = t.save(tmp_path / "t.json")
    back = Trace.load(p)
    assert back.config == t.config
    assert back.events == t.events
    # a prompt variant travels; variant 0 is left out, as traces before variants
    v = Trace(t.config, [AddRequest("r0", 10, 2, variant=3), AddRequest("r1", 10, 2)])
    d = json.loads(v.dumps())
    assert d["events"][0]["variant"] == 3 and "variant" not in d["events"][1]
    assert Trace.from_json(d).events == v.events


def test_a_draft_group_round_trips_and_needs_a_model_drafter(tmp_path):
    """``draft: true`` names the group of an EAGLE / MTP drafter's layer (vLLM
    plans it apart beside Mamba); its KV is the draft's (Config.draft_group)."""
    gs = (Group("full"), Group("full", draft=True), Group("mamba"))
    cfg = Config(groups=gs, spec_tokens=2, drafter="eagle", prefix_caching=True)
    p = Trace(cfg, [AddRequest("r0", 9, 2)]).save(tmp_path / "t.json")
    assert json.loads(p.read_text())["config"]["groups"][1] == {"kind": "full", "draft": True}
    assert Trace.load(p).config == cfg and cfg.draft_group == 1
    assert Config(groups=(Group("full"),), spec_tokens=2, drafter="eagle").draft_group == 0
    assert Config(groups=(Group("full"),), spec_tokens=2).draft_group is None
    for bad in (Config(groups=gs, spec_tokens=2),  # no model drafter
                Config(groups=(Group("mamba"), Group("sliding", 4, draft=True)),
                       spec_tokens=2, drafter="eagle"),
                Config(groups=(Group("full", draft=True),), spec_tokens=2, drafter="eagle")):
        with pytest.raises(TraceError, match="draft group"):
            bad.validate()
    d = cfg.to_json()
    d["groups"][1]["draft"] = 1
    with pytest.raises(TraceError, match="draft must be true or false"):
        Config.from_json(d)


def test_save_never_overwrites(tmp_path):
    t = _trace()
    a = t.save(tmp_path / "t.json")
    a.write_text("user data")
    b = t.save(tmp_path / "t.json")
    assert a != b and a.read_text() == "user data"


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.pop("version"), "version"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d["events"].append({"type": "Teleport"}), "unknown event type"),
    (lambda d: d["events"].append({"type": "Preempt"}), "missing field 'id'"),
    (lambda d: d["events"].append({"type": "Preempt", "id": "nobody"}), "never added"),
    (lambda d: d["events"].insert(0, {"type": "AddRequest", "id": "r0", "prompt_len": 5,
                                      "max_new_tokens": 1}), "added twice"),
    (lambda d: d["config"]["groups"][0].update(kind="hisparse"), "unknown kind"),
    (lambda d: d["config"].update(depth=9), "depth"),
    (lambda d: d["config"].update(policy="hopeful"), "unknown policy"),
    (lambda d: d["config"].update(block_size=0), "block_size"),
    (lambda d: d["config"].update(bogus=1), "unknown field"),
    (lambda d: d["events"][0].update(prompt_len=-3), ">= 0"),
    (lambda d: d["events"][0].update(prompt_len="many"), "integer"),
    (lambda d: d["events"][0].update(external_tokens=100), "external_tokens"),
    (lambda d: d["events"][0].update(variant=5), "variant"),
    (lambda d: d.update(meta={"props": "abc"}), "meta.props"),
    (lambda d: d.update(meta={"props": [9]}), "meta.props"),
    (lambda d: d.update(meta={"props": ["1"]}), "meta.props"),
    (lambda d: d.update(meta={"props": [1, 1]}), "meta.props"),
    (lambda d: d.update(meta={"props": []}), "meta.props"),
    (lambda d: d.update(meta={"target": 5}), "meta.target"),
    (lambda d: d["events"][0].update(variant="b"), "integer"),
    (lambda d: d["events"][3].update(accepted={"r0": 7}), "spec_tokens"),
    (lambda d: d["config"].update(stream_ordered="yes"), "stream_ordered"),
])
def test_malformed_traces_are_one_line_errors(mutate, fragment):
    d = json.loads(_trace().dumps())
    mutate(d)
    with pytest.raises(TraceError) as e:
        Trace.from_json(d)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_not_json(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        Trace.load(p)


def test_chunk_must_align_with_blocks():
    with pytest.raises(TraceError, match="multiple of the block size"):
        Config(groups=(Group("chunked_local", 20),), block_size=16).validate()


G = {"full": Group("full"), "sliding": Group("sliding", 5),
     "chunked_local": Group("chunked_local", 8), "mamba": Group("mamba")}


@given(st.sampled_from(sorted(G)), st.integers(0, 500))
def test_window_definitions(kind, t):
    g = G[kind]
    lo, hi = window(g, t)
    assert hi == t and 0 <= lo <= t
    if kind == "full":
        assert lo == 0
    elif kind == "sliding":
        assert hi - lo + 1 == min(5, t + 1)
    elif kind == "chunked_local":
        assert lo % 8 == 0 and t - lo < 8
    else:
        assert lo == max(0, t - 1)


@given(st.sampled_from(sorted(G)), st.integers(0, 500), st.sampled_from([1, 4, 16]))
def test_freeable_blocks_are_never_read_by_the_next_token(kind, n, B):
    g = G[kind]
    k = freeable(g, n, B)
    # the next position n and every later one read nothing in the freeable blocks
    for t in range(n, n + 40):
        assert window(g, t)[0] >= k * B
    assert skipped(g, n) <= n


@given(st.sampled_from(sorted(G)), st.integers(0, 300), st.integers(1, 40),
       st.sampled_from([1, 4, 16]))
def test_read_blocks_cover_every_window(kind, start, n, B):
    g = G[kind]
    blocks = set(read_blocks(g, start, start + n, B))
    if kind == "mamba":
        # the state in (after start - 1) and the state out (after the last
        # position); the states in between stay inside the kernel
        state_in = {(start - 1) // B} if start else set()
        assert blocks == state_in | {(start + n - 1) // B}
        return
    for t in range(start, start + n):
        lo, hi = window(g, t)
        assert set(range(lo // B, hi // B + 1)) <= blocks


@given(st.sampled_from(["sliding", "chunked_local"]), st.integers(1, 64), st.integers(1, 200),
       st.integers(0, 50), st.sampled_from([1, 4, 16]))
def test_settled_frees_nothing_an_in_flight_or_next_position_reads(kind, p, c, f, B):
    """The blocks freed on the settled count lie below the window of every
    position from the oldest unprocessed one (``c - f``) up to the next one
    to schedule (``c``); never more than the optimistic count frees."""
    g = Group(kind, p * B if kind == "chunked_local" else p)
    f = min(f, c)
    n = freeable(g, basis("settled", g, Counts(c, f)), B)
    for t in range(c - f, c + 1):
        assert n <= window(g, t)[0] // B, (t, n)
    assert n <= freeable(g, basis("optimistic", g, Counts(c, f)), B)


def test_live_bound_grows_with_tokens_ahead():
    g = Group("sliding", 16)
    assert live_bound(g, 16, 4096, 64) < live_bound(g, 16, 4096, 128)
    assert live_bound(Group("full"), 16, 100, 64) == 7


@pytest.mark.parametrize("kind,param,blocks", [("ring", 0, 1), ("cross", 40, 3)])
def test_ring_and_cross_free_nothing_and_read_all_their_blocks(kind, param, blocks):
    """A ring (one block) and cross attention (cdiv(E, B) blocks of encoder
    outputs) hold no positions: every step reads all their blocks, nothing is
    ever freeable, and a request holds exactly that many blocks."""
    g = Group(kind, param)
    for n in range(0, 300, 7):
        assert list(freeable_blocks(g, n, 16, 10)) == []
        assert list(read_blocks(g, n, n + 3, 16, 10)) == list(range(blocks))
    assert live_bound(g, 16, 4096, 512) == blocks
    assert g.spec.beside == "full" and not g.spec.frees_early


def test_cross_attention_takes_the_encoder_budget_at_startup():
    """vLLM's startup check sets aside cdiv(max(budget, E), B) blocks for cross
    attention (its encoder budget), beside full attention's cdiv(L, B)."""
    cfg = config_for("cross", block_size=16, max_model_len=128, max_num_batched_tokens=128,
                     encoder_len=40, num_blocks=40)
    assert startup_blocks(cfg) == 1 + 8 + 8


def test_stream_ordered_is_saved_only_when_set():
    cfg = Config(groups=(Group("sliding", 4),), block_size=1)
    assert "stream_ordered" not in cfg.to_json()
    on = Config.from_json({**cfg.to_json(), "stream_ordered": True})
    assert on.stream_ordered and on.to_json()["stream_ordered"] is True
    assert "stream-ordered" in on.label() and "stream-ordered" not in cfg.label()


# ---------------------------------------------------------- block tables


@st.composite
def _table_edits(draw):
    """A table past one leaf, and the table after a few slots changed, slots
    appended or cut (as a decode's table changes between steps)."""
    ids = st.integers(0, 3)
    a = draw(st.lists(ids, min_size=0, max_size=200))
    b = list(a)
    for _ in range(draw(st.integers(0, 4))):
        if b and draw(st.booleans()):
            b[draw(st.integers(0, len(b) - 1))] = draw(ids)
        else:
            b += draw(st.lists(ids, max_size=40))
    if b and draw(st.booleans()):
        del b[draw(st.integers(0, len(b))):]
    return a, b


@given(_table_edits())
def test_a_block_table_is_the_tuple_of_its_ids(edit):
    import pickle

    from model.observations import BlockTable

    a, b = edit
    ta = BlockTable.of(a)
    tb = BlockTable.of(b, ta)
    for t, ids in ((ta, tuple(a)), (tb, tuple(b))):
        assert (type(t) is tuple) == (len(ids) <= 32)
        assert t == ids and ids == t and (t != ids) is False and hash(t) == hash(ids)
        assert repr(t) == repr(ids) and tuple(t) == ids and list(t) == list(ids)
        assert len(t) == len(ids) and t[:5] == ids[:5] and t[7:] == ids[7:]
        assert [t[i] for i in range(-len(ids), len(ids))] == [*ids, *ids]
        assert (3 in t) == (3 in ids) and t.count(0) == ids.count(0)
        assert t + (9,) == ids + (9,) and (9,) + t == (9,) + ids
        assert pickle.loads(pickle.dumps(t)) == ids
        with pytest.raises(IndexError):
            t[len(ids)]
    assert (ta == tb) == (a == b) and (ta < tb) == (tuple(a) < tuple(b))


def test_a_block_table_shares_what_did_not_change_with_the_one_before():
    """A table made from the one before it holds only the leaves that changed
    anew (and the path to them): a long decode's tables cost what changed."""
    from model.observations import BlockTable

    ids = [0] * 2000 + [5, 6]
    before = BlockTable.of(ids)
    ids[2000] = 0
    ids.append(7)
    after = BlockTable.of(ids, before)
    old = {id(leaf) for leaf in before._leaves()}
    new = [leaf for leaf in after._leaves() if id(leaf) not in old]
    assert len(new) == 1 and new[0] == tuple(ids[2000 - 2000 % 32:])
    assert after == tuple(ids) and before == tuple([0] * 2000 + [5, 6])
