"""Events, configs and traces: the one language every layer speaks.

A trace is a :class:`Config` plus a list of events, saved as JSON::

    {"version": 1,
     "config": {"groups": [{"kind": "sliding", "window": 16}], "block_size": 16, ...},
     "events": [{"type": "AddRequest", "id": "r0", "prompt_len": 100, ...},
                {"type": "Schedule"}, {"type": "Schedule"},
                {"type": "Process", "accepted": {"r0": 1}}]}

Loading checks shape and consistency and raises :class:`TraceError` (one line,
the CLI turns it into exit status 2) for anything malformed.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .kinds import KINDS as KIND_CLASSES
from .kinds import Kind, make_kind
from .tokens import MAX_VARIANT

TRACE_VERSION = 1

# The stated input limits (README, "Input limits"): a trace or config past one
# is refused with one line (exit 2) before anything is allocated for it.
MAX_TRACE_BYTES = 64 * 2**20  # a trace file
MAX_NESTING = 32  # JSON nesting depth (a trace needs 4; meta may use the rest)
MAX_EVENTS = 1_000_000  # events in one trace
MAX_REQUESTS = 100_000  # AddRequest events in one trace
MAX_ID_LEN = 256  # characters of a request id
MAX_NUM_BLOCKS = 262_144  # physical blocks in the pool (NULL included)
MAX_MODEL_LEN = 131_072  # tokens of one request (prompt + new); also caps block_size,
#                            window, chunk, sink, the token budget and first_bad_block
MAX_NUM_SEQS = 4_096  # requests running at once
MAX_SPEC_TOKENS = 64  # draft tokens per decode

# the kinds the fuzzer, the prover and the targets take (model/kinds.py has their classes)
KINDS = tuple(KIND_CLASSES)
HAZARDS = ("ordered", "unordered")
# how drafts are proposed when spec_tokens > 0: "ngram" (prompt lookup, no KV
# of its own), "eagle" (a draft layer beside the model's: vLLM drops the last
# block of a prefix hit, or hashes one token past each block, and never ends a
# prefill chunk one token short of the prompt), "mtp" (a multi-module MTP
# drafter of two modules, as EAGLE plus: drafts in multiples of two, a lookahead
# of spec_tokens, and sliding windows retaining spec_tokens - 1 tokens)
DRAFTERS = ("ngram", "eagle", "mtp")
MTP_MODULES = 2  # num_nextn_predict_layers of impl/vllm/tiny-mtp
# what a failed connector load does to its request: recompute it (the checked
# default of the traces), or end it with an error (vLLM's default, FINISHED_ERROR)
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


class TraceError(ValueError):
    """A malformed or inconsistent trace or config (exit status 2)."""


# --------------------------------------------------------------------- events


@dataclass(frozen=True)
class AddRequest:
    """A new request: ``prompt_len`` prompt tokens, the first ``external_tokens``
    of which a KV connector offers to load instead of computing. ``variant``
    picks the prompt (:func:`model.tokens.prompt_token`): variant ``v > 0``
    differs from variant 0 at position ``v - 1`` only."""

    id: str
    prompt_len: int
    max_new_tokens: int
    external_tokens: int = 0
    variant: int = 0


@dataclass(frozen=True)
class Schedule:
    """One scheduler iteration; puts a step in flight. A step that schedules
    nothing is in flight too: the engine queues its empty batch and takes its
    (empty) output in turn (``EngineCore.step_with_batch_queue``)."""


@dataclass(frozen=True)
class Process:
    """The oldest unprocessed step's output arrives. ``accepted[id]`` is how many
    of request ``id``'s draft (spec) tokens in that step survive; a request not
    named accepts all of them. Rejection is this event."""

    accepted: dict[str, int] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.accepted.items())))


@dataclass(frozen=True)
class Preempt:
    """Preempt request ``id``: all its blocks go back, it recomputes later.

    Only on a target whose engine has a call that preempts one chosen request
    (``Capabilities.preempt_call``). vLLM has none: it preempts inside
    ``schedule()`` under pool pressure, at an abort, or all running requests
    at once (:class:`ResetPrefixCache`); nor has SGLang (it retracts inside
    ``update_running_batch``). A trace holding one is refused there with one
    line."""

    id: str


# why a Preempt does not run on a target without such a call (one line)
NO_PREEMPT_CALL = ("vLLM has no call that preempts one chosen request: it preempts inside "
                   "schedule() under pool pressure, at an abort, or every running request "
                   "at reset_prefix_cache(reset_running_requests=True) (ResetPrefixCache)")


@dataclass(frozen=True)
class ResetPrefixCache:
    """The engine's ``reset_prefix_cache(reset_running_requests=True)``
    utility call (vLLM's ``/reset_prefix_cache`` endpoint): every running
    request is preempted, the last admitted first, then the prefix cache is
    emptied if no block is in use. The engine takes it between two of its
    loop's steps: fewer than ``depth`` steps in flight."""


@dataclass(frozen=True)
class FailLoad:
    """The connector's load for request ``id`` fails from logical block
    ``first_bad_block`` on; reported with the output of the step that loaded,
    so the scheduler must recompute from that block."""

    id: str
    first_bad_block: int


@dataclass(frozen=True)
class Finish:
    """Request ``id`` stops (the engine finishes it, e.g. a stop string)."""

    id: str


@dataclass(frozen=True)
class Abort:
    """The client aborts request ``id``."""

    id: str


@dataclass(frozen=True)
class Drain:
    """No new requests and no failures from here on: the engine runs its loop
    (schedule while the batch queue has room, else take the oldest output,
    every draft accepted) until every request has finished. Not a target
    call: the runner expands it into Schedule and Process events, and
    property 7 (progress) judges that it ends (properties/drain.py)."""


Event = (AddRequest | Schedule | Process | Preempt | ResetPrefixCache | FailLoad | Finish
         | Abort | Drain)
EVENT_TYPES: dict[str, type] = {
    c.__name__: c
    for c in (AddRequest, Schedule, Process, Preempt, ResetPrefixCache, FailLoad, Finish,
              Abort, Drain)
}


def event_to_json(ev: Event) -> dict[str, Any]:
    d = {"type": type(ev).__name__}
    d.update(asdict(ev))
    if isinstance(ev, AddRequest) and not ev.variant:
        del d["variant"]  # the common prompt, as traces written before variants
    return d


_SCHEDULE = Schedule()


def event_from_json(d: Any, where: str = "event") -> Event:
    if not isinstance(d, dict) or "type" not in d:
        raise TraceError(f"{where}: expected an object with a 'type' field, got {d!r:.80}")
    if not isinstance(d["type"], str):
        raise TraceError(f"{where}: 'type' must be an event name, got {d['type']!r:.60}")
    cls = EVENT_TYPES.get(d["type"])
    if cls is None:
        raise TraceError(
            f"{where}: unknown event type {d['type']!r} (known: {', '.join(EVENT_TYPES)})"
        )
    if cls is Schedule and len(d) == 1:
        return _SCHEDULE  # immutable and alike: a long trace's Schedules are one object
    names = {f.name: f for f in fields(cls)}
    extra = set(d) - set(names) - {"type"}
    if extra:
        raise TraceError(f"{where}: {d['type']} has unknown field(s) {sorted(extra)}")
    kwargs = {}
    for name, f in names.items():
        if name not in d:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise TraceError(f"{where}: {d['type']} is missing field {name!r}")
        kwargs[name] = d[name]
    try:
        ev = cls(**kwargs)
    except TypeError as e:
        raise TraceError(f"{where}: {e}") from None
    _check_event_types(ev, where)
    return ev


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(v: Any) -> str:
    """``repr(v)`` cut to a readable length (a 4,000-digit integer included)."""
    if _is_int(v) and abs(v) >= 10**18:
        return f"an integer of about {len(str(abs(v)))} digits"
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _nesting(doc: Any) -> int:
    """How deeply ``doc`` nests lists and objects (walked without recursion)."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, dict):
            x = list(x.values())
        elif not isinstance(x, list):
            continue
        deepest = max(deepest, d)
        if d > MAX_NESTING:
            break
        todo.extend((y, d + 1) for y in x if isinstance(y, (list, dict)))
    return deepest


def _check_meta(meta: dict[str, Any]) -> None:
    """The meta fields that steer a replay: ``props`` narrows what is checked,
    ``target`` picks where it runs; anything else there is free text."""
    if "props" in meta:
        p = meta["props"]
        if (not isinstance(p, list) or not p or len(set(map(repr, p))) != len(p)
                or not all(_is_int(x) and 1 <= x <= 7 for x in p)):
            raise TraceError(f"trace: meta.props must be a list of distinct property "
                             f"numbers 1-7, got {p!r:.60}")
    if "target" in meta and (not isinstance(meta["target"], str) or not meta["target"]):
        raise TraceError(f"trace: meta.target must be a target name, got {meta['target']!r:.60}")


def _check_event_types(ev: Event, where: str) -> None:
    for f in fields(ev):
        v = getattr(ev, f.name)
        if f.name == "id":
            if not isinstance(v, str) or not v or len(v) > MAX_ID_LEN:
                raise TraceError(f"{where}: 'id' must be a non-empty string of at most "
                                 f"{MAX_ID_LEN} characters")
        elif f.name == "accepted":
            if not isinstance(v, dict) or not all(
                isinstance(k, str) and _is_int(n) and n >= 0 for k, n in v.items()
            ):
                raise TraceError(f"{where}: 'accepted' must map request ids to counts >= 0")
        elif not _is_int(v) or v < 0:
            raise TraceError(f"{where}: {f.name!r} must be an integer >= 0, got {_short(v)}")
        elif v > MAX_MODEL_LEN:
            raise TraceError(f"{where}: {f.name!r} {_short(v)} over the limit of "
                             f"{MAX_MODEL_LEN:,}")


# --------------------------------------------------------------------- config


_SPECS: dict[tuple[str, int], Kind] = {}


@dataclass(frozen=True)
class Group:
    """One KV-cache group: its attention kind and the kind's parameter.

    ``param`` is the window ``W`` for ``sliding``, the chunk ``C`` for
    ``chunked_local``, the recent window ``R`` for ``rswa``, the sink length
    ``S`` for ``sink``, unused (0) for ``full`` and ``mamba``. ``spec`` is
    the kind object (model/kinds.py) that says what it reads and frees.

    ``block_size``: the group's own tokens per block, a multiple of the
    config's ``block_size`` (0: the config's). vLLM gives groups of a hybrid
    model different block sizes when their layers' pages differ
    (``unify_kv_cache_spec_page_size`` raises a smaller page's block size
    until the pages match); see :attr:`Config.hash_block_size`."""

    kind: str
    param: int = 0
    block_size: int = 0
    # tokens a sliding window keeps below itself (vLLM's extra_retained_tokens);
    # not saved: the Config sets it from its drafter, as vLLM's planner does
    retained: int = 0
    # state blocks a Mamba group holds for drafts (vLLM's num_speculative_blocks,
    # the model's num_speculative_tokens); not saved: the Config sets it
    spec_blocks: int = 0
    # the group of an EAGLE / MTP drafter's attention layer (full attention):
    # vLLM plans it apart from a hybrid or Mamba model's own groups (an EAGLE
    # group, is_eagle_group). Its KV at a prompt position is built with the next
    # token. Saved as "draft": true
    draft: bool = False

    @property
    def spec(self) -> Kind:
        key = (self.kind, self.param, self.retained, self.spec_blocks)
        k = _SPECS.get(key)
        if k is None:
            if self.kind not in KIND_CLASSES:
                raise TraceError(f"unknown kind {self.kind!r} (known: {', '.join(KINDS)})")
            k = _SPECS[key] = make_kind(self.kind, self.param, self.retained, self.spec_blocks)
        return k

    def label(self) -> str:
        name = self.spec.label() if self.kind in KIND_CLASSES else self.kind
        name = f"{name}(draft)" if self.draft else name
        return f"{name}[B={self.block_size}]" if self.block_size else name


@dataclass(frozen=True)
class Config:
    groups: tuple[Group, ...]
    block_size: int = 16
    num_blocks: int = 64  # physical blocks, NULL block (id 0) included
    max_num_batched_tokens: int = 64  # token budget per step
    max_num_seqs: int = 8
    max_model_len: int = 512
    spec_tokens: int = 0
    depth: int = 2  # steps in flight at most: 1 sync, 2 async, >2 pipeline parallel
    policy: str = "settled"
    hazard: str = "ordered"  # "unordered": a KV-consumer connector may write freed blocks
    prefix_caching: bool = False
    drafter: str = "ngram"  # DRAFTERS; saved only when not "ngram"
    kv_load_failure_policy: str = "recompute"  # KV_LOAD_FAILURE_POLICIES; saved when "fail"
    # vLLM's cache_config.prefix_match_unit: the hash unit, finer than the blocks
    # (0: unset, vLLM's default); saved when set. See :attr:`partial_hits`.
    prefix_match_unit: int = 0
    # the engine runs every batch on one ordered forward stream and writes a
    # slot only from a later batch (SGLang: ``_apply_war_barrier``): under
    # ``hazard = ordered`` an out-of-window free that an unprocessed step still
    # reads is harmless (docs/SEMANTICS.md, SGLang); saved when true
    stream_ordered: bool = False

    def __post_init__(self) -> None:
        # vLLM's planner tags every sliding window with the drafter's retained
        # tokens (get_global_kv_cache_groups: extra_retained_tokens)
        # tokens, and every Mamba layer with a state block per draft token
        # (MambaSpec.num_speculative_blocks)
        gs = self.groups
        if isinstance(gs, tuple) and all(isinstance(g, Group) for g in gs):
            r = self.retained_tokens
            k = self.spec_tokens if _is_int(self.spec_tokens) and self.spec_tokens > 0 else 0

            def tagged(g: Group) -> Group:
                cls = KIND_CLASSES.get(g.kind) if isinstance(g.kind, str) else None
                if cls is None:
                    return g  # validate() names the unknown kind
                return replace(g, retained=r if cls.retains_tokens else 0,
                               spec_blocks=k if cls.holds_state else 0)

            if any(tagged(g) != g for g in gs):
                object.__setattr__(self, "groups", tuple(tagged(g) for g in gs))

    @property
    def retained_tokens(self) -> int:
        """vLLM's ``extra_retained_tokens``: ``max(0, num_prefill_lookahead_tokens
        - 1)``, the lookahead being ``spec_tokens`` for a multi-module MTP
        drafter (1 for EAGLE, 0 without a model-based drafter)."""
        if self.drafter != "mtp" or not _is_int(self.spec_tokens) or self.spec_tokens < 2:
            return 0
        return self.spec_tokens - 1

    @property
    def draft_group(self) -> int | None:
        """The group holding an EAGLE / MTP drafter's KV: the group stated as the
        draft layer's (vLLM plans it apart beside a hybrid or Mamba model's
        groups), else group 0, which the draft layer shares (a model of one
        attention group); None without such a drafter."""
        if self.drafter not in ("eagle", "mtp"):
            return None
        return next((i for i, g in enumerate(self.groups) if g.draft), 0)

    @property
    def kind(self) -> str:
        """``hybrid`` for several groups, else the one group's kind."""
        return "hybrid" if len(self.groups) > 1 else self.groups[0].kind

    def group_block_size(self, gi: int) -> int:
        """Tokens per block of group ``gi``: logical block ``i`` of that group
        holds positions ``[i*Bg, (i+1)*Bg)``."""
        return self.groups[gi].block_size or self.block_size

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.block_size or self.block_size for g in self.groups)

    @property
    def scheduler_block_size(self) -> int:
        """vLLM's scheduler block size (``resolve_kv_cache_block_sizes``): the
        LCM of the groups' block sizes. Prefix hits and connector loads land
        on its multiples (a hit must end on a block edge in every group)."""
        return math.lcm(*self.block_sizes)

    @property
    def hash_block_size(self) -> int:
        """The unit a request's block hashes are computed at: with several
        groups and block hashes in use (prefix caching, or the KV connector
        that ``hazard = unordered`` brings), the GCD of the groups' block
        sizes (``resolve_kv_cache_block_sizes``), else the scheduler block
        size. A group whose block is ``k`` units long is keyed by the chained
        hash of its last unit (vLLM's ``BlockHashListWithBlockSize``)."""
        if (self.prefix_caching or self.hazard == "unordered") and len(self.groups) > 1:
            return self.prefix_match_unit or math.gcd(*self.block_sizes)
        return self.scheduler_block_size

    @property
    def partial_hits(self) -> bool:
        """Whether a prefix hit may end inside a block (vLLM's
        ``partial_hash_hits_enabled``): prefix caching on and a Mamba
        (``"align"``) group whose block is longer than the hash unit, every
        other group one that looks up hash units inside its blocks (full
        attention, R-SWA) or no longer than the unit. A hybrid model's Mamba
        block is its attention block (``_align_hybrid_block_size``), so this
        takes ``prefix_match_unit`` below it. Hits then land on hash units
        (``resolve_cache_hit_alignment_tokens``); a full-attention block holding
        the prompt's last hash boundary is keyed there too
        (``cache_partial_block``), and a hit ending inside a block is served
        from a private copy of it (copy-on-write, :class:`model.observations.CopyObs`)."""
        if not self.prefix_caching or len(self.groups) < 2:
            return False
        u = self.hash_block_size
        return any(g.spec.holds_state and u < B for g, B in
                   zip(self.groups, self.block_sizes, strict=True)) and \
            all(g.spec.sub_block_lookup or u == B for g, B in
                zip(self.groups, self.block_sizes, strict=True) if g.spec.prefix_cacheable)

    @property
    def hit_alignment(self) -> int:
        """Tokens a prefix hit's length is a multiple of: the hash unit with
        :attr:`partial_hits`, else the scheduler block size."""
        return self.hash_block_size if self.partial_hits else self.scheduler_block_size

    @property
    def mixed_block_sizes(self) -> bool:
        return len(set(self.block_sizes)) > 1

    def label(self) -> str:
        g = "+".join(x.label() for x in self.groups)
        return (
            f"{g} B={self.block_size} blocks={self.num_blocks} depth={self.depth} "
            f"spec={self.spec_tokens} policy={self.policy} hazard={self.hazard}"
            + (" prefix-caching" if self.prefix_caching else "")
            + (f" drafter={self.drafter}" if self.drafter != "ngram" else "")
            + (" load-failure=fail" if self.kv_load_failure_policy == "fail" else "")
            + (f" prefix-match-unit={self.prefix_match_unit}" if self.prefix_match_unit else "")
            + (" stream-ordered" if self.stream_ordered else "")
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = [{"kind": g.kind, **({"param": g.param} if g.param else {}),
                        **({"block_size": g.block_size} if g.block_size else {}),
                        **({"draft": True} if g.draft else {})}
                       for g in self.groups]
        if self.drafter == "ngram":
            del d["drafter"]  # traces saved before drafters were configurable
        if self.kv_load_failure_policy == "recompute":
            del d["kv_load_failure_policy"]
        if not self.prefix_match_unit:
            del d["prefix_match_unit"]
        if not self.stream_ordered:
            del d["stream_ordered"]
        return d

    @staticmethod
    def from_json(d: Any) -> Config:
        if not isinstance(d, dict):
            raise TraceError("config: expected an object")
        known = {f.name for f in fields(Config)}
        extra = set(d) - known
        if extra:
            raise TraceError(f"config: unknown field(s) {sorted(extra)}")
        if "groups" not in d:
            raise TraceError("config: missing 'groups'")
        gs = d["groups"]
        if not isinstance(gs, list) or not gs:
            raise TraceError("config: 'groups' must be a non-empty list")
        groups = []
        for i, g in enumerate(gs):
            if not isinstance(g, dict) or "kind" not in g or \
                    set(g) - {"kind", "param", "block_size", "draft"}:
                raise TraceError(f"config: groups[{i}] must be {{'kind': K, 'param': N}} "
                                 f"(and optionally 'block_size': N, 'draft': true)")
            if not isinstance(g.get("draft", False), bool):
                raise TraceError(f"config: groups[{i}].draft must be true or false")
            p = g.get("param", 0)
            if not _is_int(p):
                raise TraceError(f"config: groups[{i}].param must be an integer")
            gb = g.get("block_size", 0)
            if "block_size" in g and (not _is_int(gb) or gb < 1):
                raise TraceError(f"config: groups[{i}].block_size must be a positive integer, "
                                 f"got {_short(gb)}")
            groups.append(Group(g["kind"], p, gb, draft=g.get("draft", False)))
        kw = {k: v for k, v in d.items() if k != "groups"}
        cfg = Config(groups=tuple(groups), **kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise :class:`TraceError` for an impossible config."""
        for name, top in (("block_size", MAX_MODEL_LEN), ("num_blocks", MAX_NUM_BLOCKS),
                          ("max_num_batched_tokens", MAX_MODEL_LEN),
                          ("max_num_seqs", MAX_NUM_SEQS), ("max_model_len", MAX_MODEL_LEN),
                          ("depth", 4)):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise TraceError(f"config: {name} must be a positive integer, got {_short(v)}")
            if v > top:
                what = "unsupported (1 sync, 2 async, 3-4 PP)" if name == "depth" else \
                    f"over the limit of {top:,}"
                raise TraceError(f"config: {name} {_short(v)} {what}")
        for name in ("policy", "hazard"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise TraceError(f"config: {name} must be a name, got {_short(v)}")
        if not isinstance(self.groups, tuple) or not self.groups:
            raise TraceError("config: 'groups' must be a non-empty list")
        for g in self.groups:
            if not isinstance(g.kind, str) or g.kind not in KINDS:
                raise TraceError(f"config: unknown kind {_short(g.kind)} "
                                 f"(known: {', '.join(KINDS)})")
            if not _is_int(g.param) or not 0 <= g.param <= MAX_MODEL_LEN:
                raise TraceError(f"config: {g.kind}'s parameter must be an integer in "
                                 f"0..{MAX_MODEL_LEN:,}, got {_short(g.param)}")
            gb = g.block_size
            if gb:
                if not _is_int(gb) or not 0 < gb <= MAX_MODEL_LEN or gb % self.block_size:
                    raise TraceError(f"config: {g.kind}'s block_size must be a multiple of the "
                                     f"config's block_size {self.block_size} up to "
                                     f"{MAX_MODEL_LEN:,}, got {_short(gb)}")
                if not g.spec.own_block_size:
                    own = [k for k, c in KIND_CLASSES.items() if c.own_block_size]
                    raise TraceError(f"config: a {g.kind} group takes the config's block_size "
                                     f"(own block sizes: {', '.join(own)})")
            why = g.spec.problem(gb or self.block_size)
            if why:
                raise TraceError(f"config: {why}")
        if self.prefix_caching is True:
            for g in self.groups:
                if not g.spec.prefix_cacheable:
                    raise TraceError(f"config: {g.kind} takes no prefix hits (vLLM's "
                                     f"{g.spec.vllm_manager}); prefix_caching must be off")
        reserved = sum(len(g.spec.reserved_blocks(self.block_size)) for g in self.groups)
        if reserved and self.num_blocks < reserved + 3:
            raise TraceError(f"config: num_blocks {self.num_blocks} leaves no room beside the "
                             f"NULL block and {reserved} reserved sink block(s)")
        if not _is_int(self.spec_tokens) or not 0 <= self.spec_tokens <= MAX_SPEC_TOKENS:
            raise TraceError(f"config: spec_tokens must be an integer in 0..{MAX_SPEC_TOKENS}, "
                             f"got {_short(self.spec_tokens)}")
        if self.num_blocks < 2:
            raise TraceError("config: num_blocks must leave room beside the NULL block")
        from .policy import REGISTRY

        if self.policy not in REGISTRY:
            raise TraceError(
                f"config: unknown policy {self.policy!r} (known: {', '.join(REGISTRY)})"
            )
        if self.hazard not in HAZARDS:
            raise TraceError(
                f"config: unknown hazard {self.hazard!r} (known: {', '.join(HAZARDS)})"
            )
        if not isinstance(self.prefix_caching, bool):
            raise TraceError("config: prefix_caching must be true or false")
        if not isinstance(self.stream_ordered, bool):
            raise TraceError("config: stream_ordered must be true or false")
        if self.max_num_batched_tokens <= self.spec_tokens:
            raise TraceError("config: the token budget must exceed spec_tokens")
        if not isinstance(self.drafter, str) or self.drafter not in DRAFTERS:
            raise TraceError(f"config: unknown drafter {self.drafter!r:.40} "
                             f"(known: {', '.join(DRAFTERS)})")
        if self.drafter != "ngram" and not self.spec_tokens:
            raise TraceError(f"config: drafter {self.drafter} needs spec_tokens >= 1")
        if self.drafter == "mtp" and self.spec_tokens % MTP_MODULES:
            raise TraceError(f"config: drafter mtp ({MTP_MODULES} modules) needs spec_tokens "
                             f"divisible by {MTP_MODULES}, got {self.spec_tokens}")
        drafts = [g for g in self.groups if g.draft]
        if drafts and (self.drafter == "ngram" or len(drafts) > 1 or drafts[0].kind != "full"
                       or len(self.groups) < 2):
            raise TraceError("config: a draft group is the one full-attention group of an EAGLE "
                             "or MTP drafter's layer, beside the model's own groups (drafter "
                             "eagle or mtp)")
        if not isinstance(self.kv_load_failure_policy, str) or \
                self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise TraceError(f"config: unknown kv_load_failure_policy "
                             f"{self.kv_load_failure_policy!r:.40} "
                             f"(known: {', '.join(KV_LOAD_FAILURE_POLICIES)})")
        self._validate_match_unit()

    def _validate_match_unit(self) -> None:
        """``prefix_match_unit`` as vLLM's ``resolve_kv_cache_block_sizes``
        takes it, and only where the model follows what it does."""
        u = self.prefix_match_unit
        if not _is_int(u) or u < 0:
            raise TraceError(f"config: prefix_match_unit must be a positive integer (0: unset), "
                             f"got {_short(u)}")
        if not u:
            return
        sizes = self.block_sizes
        if len(self.groups) == 1:
            if u != sizes[0] and (self.prefix_caching or self.hazard == "unordered"):
                raise TraceError(f"config: prefix_match_unit {u} with one KV-cache group: vLLM "
                                 f"lands prefix hits on the block size {sizes[0]} and refuses "
                                 f"any other unit")
        elif self.prefix_caching or self.hazard == "unordered":
            cacheable = [B for g, B in zip(self.groups, sizes, strict=True)
                         if g.spec.prefix_cacheable] or list(sizes)
            if any(B % u for B in cacheable):
                raise TraceError(f"config: prefix_match_unit {u} does not divide every group's "
                                 f"block size {list(cacheable)} (vLLM refuses it)")
        if not self.prefix_caching:
            raise TraceError(f"config: prefix_match_unit {u} needs prefix caching on (vLLM "
                             f"hashes no prompt for hits without it)")
        if u != self.scheduler_block_size and not self.partial_hits:
            raise TraceError(f"config: prefix_match_unit {u} below the block size is modelled "
                             f"where it enables sub-block hits (a Mamba group beside full "
                             f"attention, vLLM's partial_hash_hits_enabled)")


def sliding(w: int, **kw: Any) -> Config:
    return Config(groups=(Group("sliding", w),), **kw)


def config_for(kind: str, **kw: Any) -> Config:
    """A config for a named kind (``hybrid`` is full + sliding(W); a kind that
    models put beside another, ``ring`` and ``cross``, comes with it: full + ring)."""
    window = kw.pop("window", 16)
    chunk = kw.pop("chunk", 32)
    sink = kw.pop("sink", kw.get("block_size", 16))
    # a kind's parameter, by what it is called (model/kinds.py: Kind.param_name)
    encoder = kw.pop("encoder_len", 2 * kw.get("block_size", 16))
    params = {"window": window, "chunk": chunk, "sink_len": sink, "encoder_len": encoder}
    if kind in KIND_CLASSES:
        k = KIND_CLASSES[kind]
        groups = (Group(kind, params.get(k.param_name, 0)),)
        if k.beside:
            groups = (Group(k.beside), *groups)
    elif kind == "hybrid":
        groups = (Group("full"), Group("sliding", window))
    else:
        raise TraceError(f"unknown kind {kind!r} (known: {', '.join(KINDS + ('hybrid',))})")
    cfg = Config(groups=groups, **kw)
    cfg.validate()
    return cfg


# ---------------------------------------------------------------------- trace


@dataclass
class Trace:
    config: Config
    events: list[Event]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": TRACE_VERSION,
            "config": self.config.to_json(),
            "events": [event_to_json(e) for e in self.events],
        }
        if self.meta:
            d["meta"] = self.meta
        return d

    def dumps(self) -> str:
        lines = [f'  {json.dumps(event_to_json(e))}' for e in self.events]
        head = {"version": TRACE_VERSION, "config": self.config.to_json()}
        if self.meta:
            head["meta"] = self.meta
        body = json.dumps(head, indent=2)[:-2]
        if not lines:
            return body + ',\n  "events": []\n}\n'
        return body + ',\n  "events": [\n  ' + ",\n  ".join(lines) + "\n  ]\n}\n"

    def save(self, path: str | Path) -> Path:
        """Write the trace; never overwrites an existing file (a suffix is added).
        Written to a temporary file first and linked to the first free name, so
        concurrent savers each get their own file and none is seen half written."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        stem, suffix = p.stem, p.suffix or ".json"
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".kvcheck-", suffix=suffix)
        mask = os.umask(0o022)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # as an ordinary new file, not mkstemp's 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.dumps())
            for n in range(1, 100_001):
                try:
                    os.link(tmp, p)
                    return p
                except FileExistsError:
                    p = p.with_name(f"{stem}-{n}{suffix}")
            raise FileExistsError(f"no free name for {path}")
        finally:
            os.unlink(tmp)

    @staticmethod
    def from_json(d: Any) -> Trace:
        if not isinstance(d, dict):
            raise TraceError("trace: expected a JSON object")
        if not _is_int(d.get("version")) or d.get("version") != TRACE_VERSION:
            raise TraceError(
                f"trace: unsupported version {d.get('version')!r} "
                f"(this kvcheck reads {TRACE_VERSION})"
            )
        extra = set(d) - {"version", "config", "events", "meta"}
        if extra:
            raise TraceError(f"trace: unknown field(s) {sorted(extra)}")
        depth = _nesting(d)
        if depth > MAX_NESTING:
            raise TraceError(f"trace: nested more than {MAX_NESTING} levels deep")
        cfg = Config.from_json(d.get("config"))
        evs = d.get("events")
        if not isinstance(evs, list):
            raise TraceError("trace: 'events' must be a list")
        if len(evs) > MAX_EVENTS:
            raise TraceError(f"trace: {len(evs):,} events, over the limit of {MAX_EVENTS:,}")
        events = [event_from_json(e, f"events[{i}]") for i, e in enumerate(evs)]
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise TraceError("trace: 'meta' must be an object")
        _check_meta(meta)
        t = Trace(cfg, events, meta)
        check_consistent(t)
        return t

    @staticmethod
    def load(path: str | Path) -> Trace:
        """A trace file: only a regular file is opened (a FIFO or a device
        would block or never end), read up to :data:`MAX_TRACE_BYTES`."""
        import stat

        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TraceError(f"cannot read trace {path}: not a regular file")
            os.set_blocking(fd, True)
            with os.fdopen(fd, "rb") as f:
                fd = -1
                data = f.read(MAX_TRACE_BYTES + 1)
        except OSError as e:
            raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
        finally:
            if fd >= 0:
                os.close(fd)
        if len(data) > MAX_TRACE_BYTES:
            raise TraceError(f"{path}: larger than the limit of {MAX_TRACE_BYTES:,} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"{path}: not UTF-8 text (byte {e.start})") from None
        d = loads_trace_json(text, str(path))
        try:
            return Trace.from_json(d)
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from None


def _no_constant(name: str) -> Any:
    raise TraceError(f"{name} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different (JSON leaves duplicates to the
    reader: one would win silently)."""
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise TraceError(f"the key {k[:40]!r} appears twice in one object")
        d[k] = v
    return d


def loads_trace_json(text: str, where: str = "trace") -> Any:
    """``json.loads`` for trace text: every failure a :class:`TraceError` (one
    line), the nesting limit (:data:`MAX_NESTING`) and Python's limit on
    integer digits (4,300) included; ``NaN`` and ``Infinity`` refused."""
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise TraceError(f"{where}: nested more than {MAX_NESTING} levels deep") from None
    except TraceError as e:
        raise TraceError(f"{where}: {e}") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise TraceError(f"{where}: a number too long to read "
                         f"({str(e).split(':')[0].split(' for ')[0]})") from None


def check_consistent(t: Trace) -> None:
    """Static consistency: ids are added once before use, counts fit the config."""
    live: set[str] = set()
    seen: set[str] = set()
    cfg = t.config
    for i, ev in enumerate(t.events):
        where = f"events[{i}] {type(ev).__name__}"
        if isinstance(ev, AddRequest):
            if ev.id in seen:
                raise TraceError(f"{where}: request id {ev.id!r} added twice")
            if len(seen) >= MAX_REQUESTS:
                raise TraceError(f"{where}: more than {MAX_REQUESTS:,} requests")
            if ev.prompt_len < 1 or ev.max_new_tokens < 1:
                raise TraceError(f"{where}: prompt_len and max_new_tokens must be >= 1")
            if ev.external_tokens >= ev.prompt_len:
                raise TraceError(f"{where}: external_tokens must be below prompt_len")
            if not 0 <= ev.variant <= MAX_VARIANT:
                raise TraceError(f"{where}: variant must be in 0..{MAX_VARIANT}")
            if ev.prompt_len + ev.max_new_tokens > cfg.max_model_len:
                raise TraceError(f"{where}: prompt_len + max_new_tokens exceeds max_model_len")
            seen.add(ev.id)
            live.add(ev.id)
        elif isinstance(ev, (Preempt, FailLoad, Finish, Abort)):
            if ev.id not in seen:
                raise TraceError(f"{where}: request {ev.id!r} was never added")
            if isinstance(ev, (Finish, Abort)):
                live.discard(ev.id)
        elif isinstance(ev, Process):
            for rid, n in ev.accepted.items():
                if rid not in seen:
                    raise TraceError(f"{where}: request {rid!r} was never added")
                if n > cfg.spec_tokens:
                    raise TraceError(f"{where}: accepted {n} > spec_tokens {cfg.spec_tokens}")
