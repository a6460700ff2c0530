"""The Hypothesis state machine: events as rules, properties as checks.

One :class:`KVMachine` subclass is made per fuzz setting (target, kind,
policy, and the knobs fixed on the command line; :func:`make_machine`); its
``initialize`` rule draws the rest of the config from
:func:`config_strategy`, and its rules then interleave the events of
docs/DESIGN.md. Preconditions come from the checker's shadow of the observations,
so every target is driven the same way. An added request's id goes into the
``requests`` Bundle, which Finish / Abort consume and Preempt (on a target
with such a call) draws from; a rule's choices are one draw each (its
arguments, or one strategy built per config), and the FailLoad rule exists
only where loads can fail. The rules compose only orders the engine's loop
can take (``EngineCore.step_with_batch_queue``): a Schedule while the batch
queue, empty steps included, has room and the scheduler has requests;
preemption inside schedule(), at an abort, or at the client's
reset_prefix_cache call.

The checker judges each event's observations. A violation of a property about
the event itself (a free, a read, a step: properties 1, 2, 5, 6, 7) fails the
rule that applied it; the accounting properties (3: the pool, 4: the
in-flight counts) are state invariants, checked by Hypothesis after every rule
(``@invariant``). A failure is shrunk by Hypothesis, and the exception of the
shrunk example carries its config and events (:class:`PropertyFailed`,
``TargetCrash.example``), which :func:`fuzz` saves as a trace.

The database key of a fuzz setting is its class name, which ends in a digest
of :meth:`FuzzSpec.key`: a saved failure is replayed first by the next run of
the same setting, and by no other.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from hypothesis import HealthCheck, Phase, reject, settings
from hypothesis import seed as with_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from impl.target import SMALL_BLOCKS, Target, TargetCrash, Unsupported, make_target
from model.events import (
    Abort,
    AddRequest,
    Config,
    Drain,
    Event,
    FailLoad,
    Finish,
    Group,
    Preempt,
    Process,
    ResetPrefixCache,
    Schedule,
    Trace,
)
from model.kinds import KINDS, Kind
from model.observations import LiveCounters, Observed
from model.streams import EngineState
from model.tokens import MAX_VARIANT
from model.windows import startup_blocks
from properties.invariants import Checker, Violation, expected_witnesses
from properties.twin import Twin

MAX_REQUESTS = 4  # live at once
MAX_ADDED = 8  # per example
ACCOUNTING = (3, 4)  # the properties checked as invariants of the state

# Health checks left on: too_slow (with no deadline it fires when drawing the
# first ten examples' choices takes 30 s: a target's own time is not a draw),
# data_too_large, large_base_example, return_value and the rest. Off:
# filter_too_much. The machine's own draws never reject (its Bundle filters
# run under preconditions that leave them a match); an example is rejected only
# where the target refuses a config or an event (a layout its version does not
# build), counted in RunStats.refused and printed, and a run that reaches
# nothing is caught as vacuous rather than stopped by the health check.
SUPPRESSED = [HealthCheck.filter_too_much]


def _sampled(elements: Any) -> st.SearchStrategy:
    """``st.sampled_from(list(elements))``, built once per tuple of elements:
    Hypothesis builds a sampled_from (its label over every element) anew at
    every call. The strategy is the one of a list, as the rules always drew
    (a tuple of strings would get a label from its hash, which varies per
    process), so its draws and labels are those of a fresh one."""
    key = tuple(elements)
    strat = _SAMPLED.get(key)
    if strat is None:
        if len(_SAMPLED) > 4096:
            _SAMPLED.clear()
        strat = _SAMPLED[key] = st.sampled_from(list(key))
    return strat


_SAMPLED: dict[tuple, st.SearchStrategy] = {}
_ints = functools.lru_cache(maxsize=4096)(st.integers)  # the strategy Hypothesis caches itself


@functools.lru_cache(maxsize=4096)
def _zero_or(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(0), st.integers(lo, hi))


class StopRun(KeyboardInterrupt):
    """Raised at the start of an example to end a run early (a time budget, a
    parallel run that already has its verdict). A KeyboardInterrupt to
    Hypothesis: it stops at once and saves nothing to the database."""


class _PassedOver(Exception):
    """A drain's failure the base shows alike: the example ends holding."""


class PropertyFailed(AssertionError):
    """A violation, with the config and events of the example that made it."""

    def __init__(self, violation: Violation, config: Config | None = None,
                 events: list[Event] | None = None):
        super().__init__(str(violation))
        self.violation = violation
        self.config = config
        self.events = list(events or [])


@dataclass
class FuzzSpec:
    """What is fixed for a run; ``None`` lets Hypothesis draw it."""

    target: str = "reference"
    kind: str = "sliding"
    policy: str = "settled"
    depth: int | None = None
    spec_tokens: int | None = None
    drafter: str = "ngram"  # how drafts are proposed (model.events.DRAFTERS)
    hazard: str | None = None
    prefix_caching: bool | None = None
    stream_ordered: bool | None = None  # Config.stream_ordered (a target pins it)
    block_size: int | None = None
    # "engine": the block sizes the target's engine builds (Capabilities.
    # engine_blocks, filled in as engine_blocks by impl.target.fit_spec):
    # attention layouts at its attention size, Mamba hybrids at the sizes it
    # pads published models to; "small" (default): 4, 8 or 16, short runs reach
    # a block's edge
    layout: str = "small"
    # the small sizes drawn (the first is where shrinking goes): the target's
    # (Capabilities.small_blocks, filled in by impl.target.fit_spec)
    small_blocks: tuple[int, ...] = SMALL_BLOCKS
    engine_blocks: tuple[int, tuple[int, ...]] | None = None
    # "mixed": a hybrid's groups draw block sizes of 1, 2 or 4 times B (vLLM's
    # page-size unification), so prefix hashes are finer than some groups' blocks
    block_sizes: str = "uniform"
    # "fine": full attention beside Mamba with a hash unit (prefix_match_unit) of
    # B/2 or B/4, where vLLM serves prefix hits ending inside a block
    match_unit: str = "block"
    external: bool = True  # whether requests may carry connector-loaded tokens
    aligned_loads: bool = True  # connectors offer whole blocks (False: any token count)
    fail_loads: bool = True  # whether connector loads may fail
    # Mamba joins hybrids with connector loads (set by fuzz() where the target
    # survives failed loads on hybrids, VllmTarget.hybrid_failed_loads)
    mamba_loads: bool = False
    load_failure: str = "recompute"  # Config.kv_load_failure_policy
    max_steps: int | None = None  # events per example; None: 30, 50 for R-SWA (long outputs)
    props: frozenset[int] = frozenset({1, 2, 3, 4, 5, 6, 7})  # the properties enforced

    def key(self) -> str:
        return (f"{self.target}|{self.kind}|{self.policy}|d{self.depth}|s{self.spec_tokens}|"
                f"h{self.hazard}|pc{self.prefix_caching}|b{self.block_size}"
                + ("|so" if self.stream_ordered else "")
                + ("" if self.fail_loads else "|nofail")
                + ("" if self.aligned_loads else "|unaligned")
                + ("" if self.drafter == "ngram" else f"|{self.drafter}")
                + ("" if self.block_sizes == "uniform" else f"|{self.block_sizes}")
                + ("" if self.layout == "small" else f"|{self.layout}")
                + ("" if self.small_blocks == SMALL_BLOCKS
                   else "|pages" + "-".join(map(str, self.small_blocks)))
                + ("" if self.match_unit == "block" else f"|unit-{self.match_unit}")
                + ("" if self.load_failure == "recompute" else f"|{self.load_failure}")
                + ("" if len(self.props) == 7 else f"|p{''.join(map(str, sorted(self.props)))}"))


@dataclass
class RunStats:
    examples: int = 0
    events: Counter = field(default_factory=Counter)
    witness: Counter = field(default_factory=Counter)
    expected: set = field(default_factory=set)
    # witnesses the target says its engine does not reach (Capabilities.unrequired): why
    unrequired: dict = field(default_factory=dict)
    refused: Counter = field(default_factory=Counter)  # what the target could not take
    refusals: Counter = field(default_factory=Counter)  # the target's words for it
    # examples run per group mix ("full+mamba"; "draft": a drafter's own group)
    layouts: Counter = field(default_factory=Counter)
    # failing examples that fail the same way on the gate's base, passed over
    # (KVMachine.base_fails), and the shortest of them: (config, events,
    # violation or None, crash text or None)
    on_base: int = 0
    base_example: tuple | None = None


def config_strategy(spec: FuzzSpec) -> st.SearchStrategy[Config]:
    @st.composite
    def build(draw: Any) -> Config:
        engine = spec.engine_blocks if spec.layout == "engine" else None
        B = spec.block_size or (engine[0] if engine else draw(_sampled(spec.small_blocks)))
        # async (depth 2, vLLM's default) about half the time: the situations the
        # invariants are about need a step in flight, and PP depths stagger decodes
        depth = spec.depth or draw(_DEPTHS)
        # an EAGLE drafter proposes at least one token; a multi-module MTP
        # drafter a multiple of its modules (model.events.MTP_MODULES)
        spec_tokens = spec.spec_tokens if spec.spec_tokens is not None else draw(
            _sampled((2, 4)) if spec.drafter == "mtp" else
            _ints(0 if spec.drafter == "ngram" else 1, 3))
        hazard = spec.hazard or draw(_sampled(("ordered", "unordered")))
        prefix = spec.prefix_caching if spec.prefix_caching is not None else draw(st.booleans())
        kind = KINDS.get(spec.kind)
        window = draw(_ints(1, (kind.fuzz_window_blocks if kind else 4) * B))
        chunk = B * draw(_ints(1, 4))

        def param(k: type[Kind]) -> int:
            return k.fuzz_param(window, chunk, B, lambda lo, hi: draw(_ints(lo, hi)))

        # vLLM plans an EAGLE / MTP drafter's attention layer as a group of its
        # own beside a Mamba or hybrid model's groups (after the first
        # attention group, or after the Mamba group of a Mamba-only model)
        drafted = spec.drafter in ("eagle", "mtp") and (
            spec.kind == "hybrid" or bool(kind and kind.holds_state))
        if drafted and spec.prefix_caching is None:
            prefix = True  # Mamba's align mode (the CLI refuses it off)
        if kind is not None:
            groups = (Group(spec.kind, param(kind)),)
            if kind.beside:  # a ring or cross attention lies beside attention layers
                groups = (Group(kind.beside), *groups)
            if drafted:
                groups = (*groups, Group("full", draft=True))
        elif spec.kind == "hybrid":
            # full plus one or two local groups (Gemma-, Llama-4-style models),
            # or Mamba beside them (Jamba-, Qwen3-Next-style): vLLM builds
            # block-sized Mamba states only with prefix caching (align mode),
            # and with connector loads it stops at findings/README.md's finding
            # 5 (the Mamba kind finds that): Mamba joins only with --no-external,
            # or on a tree that survives failed loads on hybrids (mamba_loads)
            # (with a model-based drafter, only these: the CLI holds the options)
            mixes = [] if drafted else [("sliding",), ("chunked_local",),
                                        ("sliding", "chunked_local")]
            if prefix and (not spec.external or spec.mamba_loads):
                # no published family puts sliding windows beside Mamba
                mixes += [("mamba",)] if engine else [("mamba",), ("sliding", "mamba")]
            if spec.block_sizes == "mixed":
                # vLLM's chunked-local manager takes no block size but the
                # scheduler's (an assertion in its find_longest_cache_hit),
                # and a Mamba state takes the config's: a mix needs an
                # attention group beside full attention to differ from it
                mixes = [m for m in mixes if not any(KINDS[k].vllm_one_block_size for k in m)
                         and any(KINDS[k].own_block_size for k in m)]
            if spec.match_unit == "fine":
                # the layout where vLLM enables hits inside a block: full
                # attention and Mamba, hashed finer than their common block
                mixes, prefix = [("mamba",)], True
            local = draw(_sampled(mixes))
            groups = (Group("full"), *((Group("full", draft=True),) if drafted else ()),
                      *(Group(k, param(KINDS[k])) for k in local))
            if spec.block_sizes == "mixed":
                groups = draw(_mixed_block_sizes(groups, B))
        else:
            raise Unsupported(f"unknown kind {spec.kind!r}")
        if engine and any(g.spec.holds_state for g in groups) and any(
                not g.spec.holds_state and not g.draft for g in groups):
            # a Mamba hybrid (a drafter's layer aside): the engine pads its
            # blocks until one holds a state (full attention and Mamba take no
            # parameter drawn at B)
            B = draw(_sampled(engine[1]))
        budget = draw(_ints(max(spec_tokens + 1, B), 8 * B))
        # the longest request add_request draws (prompt 6B, outputs 2B or 5B)
        max_len = (11 if kind is not None and kind.long_outputs else 8) * B
        if spec.prefix_caching is None and not all(g.spec.prefix_cacheable for g in groups):
            prefix = False
        if any(g.spec.whole_prefill for g in groups):
            budget = max(budget, max_len)  # vLLM runs the model without chunked prefill
        cfg = Config(groups=groups, block_size=B, num_blocks=2,
                     max_num_batched_tokens=budget, max_num_seqs=MAX_REQUESTS,
                     max_model_len=max_len, spec_tokens=spec_tokens, depth=depth,
                     policy=spec.policy, hazard=hazard, prefix_caching=prefix,
                     stream_ordered=bool(spec.stream_ordered),
                     drafter=spec.drafter if spec_tokens else "ngram",
                     kv_load_failure_policy=spec.load_failure,
                     prefix_match_unit=(B // draw(_sampled((2, 4)))
                                        if spec.match_unit == "fine" else 0))
        # pools an engine starts with (one request of max_model_len fits), small
        # ones half the time: pool pressure is where preemption, eviction of
        # cached blocks and their reuse happen
        extra = draw(_EXTRA)
        return replace(cfg, num_blocks=startup_blocks(cfg) + extra)

    return build()


_DEPTHS = st.one_of(st.just(2), st.integers(1, 4))
_EXTRA = st.one_of(st.integers(0, 10), st.integers(0, 58))


@st.composite
def _mixed_block_sizes(draw: Any, groups: tuple[Group, ...], B: int) -> tuple[Group, ...]:
    """Give each attention group ``r * B`` tokens per block (``r`` in 1, 2, 4;
    at least one group keeps ``B``, another does not), as vLLM's page-size
    unification does for layers whose pages differ (``r`` times smaller page,
    ``r`` times the block). Windows and chunks are drawn again at the group's
    size; Mamba takes the config's ``B``."""
    own = [i for i, g in enumerate(groups) if g.spec.own_block_size]
    keep = draw(_sampled(own))
    out = []
    for i, g in enumerate(groups):
        r = 1 if i == keep or not g.spec.own_block_size else draw(_sampled((1, 2, 4)))
        out.append(_at_block_size(draw, g, r * B) if r > 1 else g)
    if all(not g.block_size for g in out):  # one group other than ``keep`` doubles
        i = next(j for j in own if j != keep)
        out[i] = _at_block_size(draw, out[i], 2 * B)
    return tuple(out)


def _at_block_size(draw: Any, g: Group, Bg: int) -> Group:
    """``g`` with ``Bg`` tokens per block, its parameter drawn again at that size."""
    window = draw(_ints(1, g.spec.fuzz_window_blocks * Bg))
    chunk = Bg * draw(_ints(1, 2))
    param = type(g.spec).fuzz_param(window, chunk, Bg, lambda lo, hi: draw(_ints(lo, hi)))
    return Group(g.kind, param, Bg)


class KVMachine(RuleBasedStateMachine):
    """The rules and invariants; :func:`make_machine` adds the ``initialize``
    rule of one fuzz setting."""

    spec: ClassVar[FuzzSpec]
    stats: ClassVar[RunStats]
    target: ClassVar[Target | None] = None
    on_example: ClassVar[Any] = None  # callback(phase, machine), phase "setup" / "teardown"
    # the gate's base: callback(config, events, violation, crash text) -> whether
    # the base fails that example the same way (None: every failure counts)
    base_fails: ClassVar[Any] = None

    def __init__(self) -> None:
        super().__init__()
        self.cfg: Config | None = None
        self.checker: Checker | None = None
        self.events: list[Event] = []
        self.counters = None  # the last event's (they list what it may have changed)
        self.live_counters = LiveCounters()  # every live request's, folded
        self.added: list[str] = []
        self.drain = False
        self.twin: Twin | None = None
        self.violation: Violation | None = None  # the one this example failed with
        self.crashed = False  # the target crashed in this example
        self.crash: TargetCrash | None = None  # how, when it did
        self.passed_over = False  # it failed as the base does (base_fails)
        self._tearing_down = False
        self._accounting: Violation | None = None  # for the invariants to raise
        # what the preconditions ask of the state (_live, _holding, _loading),
        # computed once per state: it changes only where _changed() is called
        self._memo: dict[str, Any] = {}

    def _changed(self) -> None:
        self._memo.clear()

    # ----------------------------------------------------------- plumbing

    def _apply(self, ev: Event, record: bool = True) -> Observed:
        """Apply ``ev`` to the target and check it (``record``: it is one of the
        example's events, else a step of a Drain)."""
        cls = type(self)
        can = getattr(cls.target, "can_apply", None)
        if can is not None and not can(ev):
            if isinstance(ev, AddRequest) and ev.external_tokens:
                ev = AddRequest(ev.id, ev.prompt_len, ev.max_new_tokens, 0, ev.variant)
            if not can(ev):
                cls.stats.refused[type(ev).__name__] += 1
                reject()
        if record:
            self.events.append(ev)
        self._changed()
        try:
            obs = cls.target.apply(ev)
        except TargetCrash as e:
            self._pass_over(None, str(e))
            self.crashed, self.crash = True, e
            e.example = (self.cfg, list(self.events))
            raise
        except Exception as e:  # the target itself broke on a valid event
            import traceback

            self.crashed = True
            crash = TargetCrash(
                f"{cls.target.name} raised {type(e).__name__} on {ev}:\n"
                + traceback.format_exc())
            crash.example = (self.cfg, list(self.events))
            self._pass_over(None, str(crash))
            self.crash = crash
            raise crash from e
        cls.stats.events[type(ev).__name__] += 1
        self.engine.observe(obs)
        if obs.counters is not None:
            self.counters = obs.counters
            self.live_counters.update(obs.counters)
        violations = [v for v in self.checker.feed(ev, obs) if v.prop in self.spec.props]
        self._changed()
        if self.twin is not None and 6 in self.spec.props:
            v6 = self.twin.check(ev, obs, self.checker, self.checker.event_index)
            if v6 is not None:
                violations.append(v6)
        if violations:
            first = violations[0]
            if record and first.prop in ACCOUNTING:
                self._accounting = first  # raised by the invariant, right after this rule
            else:
                self._fail(first)
        return obs

    def _fail(self, v: Violation) -> None:
        self._pass_over(v, None)
        self.violation = v
        raise PropertyFailed(v, self.cfg, self.events)

    def _pass_over(self, v: Violation | None, crash: str | None) -> None:
        """With a base to compare against (the gate's), a failure the base
        shows the same way is not the target's: it is counted, the shortest
        kept, and the example rejected, so the run (and its shrinking) looks
        on for one that fails on the target only."""
        check = type(self).base_fails
        if check is None or not check(self.cfg, list(self.events), v, crash):
            return
        st = type(self).stats
        st.on_base += 1
        if st.base_example is None or len(self.events) < len(st.base_example[1]):
            st.base_example = (self.cfg, list(self.events), v, crash)
        self.crashed, self.passed_over = False, True
        if self._tearing_down:  # the example may be over (its data frozen): it just holds
            raise _PassedOver
        reject()

    def _status(self, rid: str) -> str:
        if self.counters is None:
            return "waiting"
        rc = self.live_counters.get(rid)
        # every added request is in the counters until it has finished and left
        return "finished" if rc is None else rc.status

    def _live(self) -> list[str]:
        """The added requests not finished (a list the caller keeps as it is)."""
        live = self._memo.get("live")
        if live is None:
            live = self._memo["live"] = [r for r in self.added if self._status(r) != "finished"]
        return live

    # --------------------------------------------------------- invariants

    def _check_accounting(self, prop: int) -> None:
        if self._accounting is not None and self._accounting.prop == prop:
            self._fail(self._accounting)

    @invariant()
    def pool_accounting(self) -> None:
        """Property 3: free + owned + NULL = total, no double free, no leak."""
        self._check_accounting(3)

    @invariant()
    def in_flight_accounting(self) -> None:
        """Property 4: each request's in-flight count is its unprocessed steps' tokens."""
        self._check_accounting(4)

    # -------------------------------------------------------------- rules

    def _setup(self, cfg: Config, drain: bool) -> None:
        """The ``initialize`` rule (:func:`make_machine` gives it its strategy)."""
        cls = type(self)
        self.cfg = cfg
        self.checker = Checker(cfg)
        # property 7's drain at the end of about half the examples
        self.drain = drain and 7 in self.spec.props
        cls.stats.examples += 1
        skip = dict(cls.target.capabilities.unrequired.get(self.spec.kind, ()))
        cls.stats.expected |= expected_witnesses(cfg) - skip.keys()
        cls.stats.unrequired.update(skip)
        if 7 in self.spec.props:
            cls.stats.expected.add("drained")
        try:
            obs = cls.target.reset(cfg)
        except Unsupported as e:
            # a config this target cannot run (e.g. a layout its version
            # refuses): not an example; counted so a run that can run
            # nothing is visible
            cls.stats.refused["config"] += 1
            cls.stats.refusals[str(e).strip().splitlines()[0][:300] if str(e) else "?"] += 1
            reject()
        cls.stats.layouts["+".join("draft" if g.draft else g.kind for g in cfg.groups)] += 1
        self.checker.feed(None, obs)
        self.engine = EngineState(cfg, loop=cls.target.capabilities.loop)
        self.engine.observe(obs)
        self.counters = obs.counters
        self.live_counters = LiveCounters()
        self.live_counters.update(obs.counters)
        self._changed()
        self.twin = Twin(cls.target, cfg) if 6 in self.spec.props else None
        if self.twin is not None and self.twin.witness:
            cls.stats.expected.add(self.twin.witness)
        if cls.on_example is not None:
            cls.on_example("setup", self)

    # A request enters the ``requests`` Bundle when it is added; Finish / Abort
    # consume it, Preempt (where the target has one) draws it. A request also
    # ends on its own (its last token, a failed load under the 'fail' policy),
    # and its id stays in the Bundle: the draws filter on the request still
    # running (holding blocks, for Preempt), so an ended id costs no step and
    # records no event, and the preconditions ask that one such request exists
    # (a filter that matches nothing would reject the example).
    requests: ClassVar[Bundle] = Bundle("requests")

    @precondition(lambda self: self.cfg is not None and len(self._live()) < MAX_REQUESTS
                  and len(self.added) < MAX_ADDED)
    @rule(target=requests, data=st.data())
    def add_request(self, data: st.DataObject) -> RequestRef:
        cfg = self.cfg
        prompt, new, ext, variant = data.draw(_request_args(
            cfg.block_size, cfg.scheduler_block_size,
            any(g.spec.long_outputs for g in cfg.groups),  # R-SWA: its gap among the outputs
            self.spec.external, self.spec.aligned_loads, cfg.prefix_caching))
        rid = f"r{len(self.added)}"
        self.added.append(rid)
        self._changed()
        self._apply(AddRequest(rid, prompt, new, ext, variant))
        return RequestRef(rid, self)

    def _may_schedule(self) -> bool:
        """vLLM's engine calls schedule() only while the scheduler has
        requests (an ended one not yet told to the workers included); SGLang's
        loop runs an empty iteration, which lets it take the last result."""
        if self.engine.loop == "vllm":
            return self.engine.has_requests()
        return bool(self._live()) or len(self.added) >= MAX_ADDED

    @precondition(lambda self: self.cfg is not None
                  and self.checker.in_flight_steps() < self.cfg.depth and self._may_schedule())
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        # Now and then the client's utility call comes first, between two steps
        # of the loop: reset_prefix_cache(reset_running_requests=True) preempts
        # every running request (a draw that shrinks to "no reset"; a rule of
        # its own would be drawn as often as a schedule). With a step in flight,
        # or at depth 1, where none is ever in flight at a schedule.
        if (type(self).target.capabilities.resets
                and (self.checker.in_flight_steps() or self.cfg.depth == 1)
                and self._holding()
                and data.draw(_RESET_FIRST, label="reset_prefix_cache first")):
            self._apply(ResetPrefixCache())
            if not self._may_schedule():
                return
        self._apply(Schedule())

    @precondition(lambda self: self.cfg is not None and len(self.added) >= MAX_ADDED
                  and not self.checker.in_flight_steps() and not self._may_schedule())
    @rule()
    def idle(self) -> None:
        """Every request added has ended and nothing is in flight: the engine
        waits for input (no event; the example has nothing left to do)."""

    @precondition(lambda self: self.checker is not None and self.checker.in_flight_steps() > 0)
    @rule(data=st.data())
    def process(self, data: st.DataObject) -> None:
        drafted = [(pp.rs.rid, pp.rs.spec) for pp in self.checker.oldest_step()
                   if pp.rs.spec and not pp.dead]
        accepted = {}
        if drafted:  # how many of each request's drafts survive, in one draw
            got = data.draw(_accepted(tuple(n for _, n in drafted)))
            accepted = {rid: k for (rid, _), k in zip(drafted, got, strict=True)}
        self._apply(Process(accepted))

    def _holding(self) -> list[str]:
        held = self._memo.get("holding")
        if held is None:
            if self.counters is None:
                held = []
            else:
                lc = self.live_counters
                held = [r for r in self._live()
                        if r in lc and lc[r].status == "running" and sum(lc[r].live) > 0]
            self._memo["holding"] = held
        return held

    # Preemption as the engine preempts: inside schedule() under pool pressure
    # (the pools drawn are small), at an abort, and at the utility call that
    # preempts every running request (drawn in the schedule rule). A Preempt
    # of one chosen request only where the target's engine has such a call
    # (Capabilities.preempt_call; neither vLLM nor SGLang has one). The rule
    # stays in the rule list either way: the list is part of what every
    # recorded seed draws (the mutant rows, docs/gate-sweep.json).
    @precondition(lambda self: self.checker is not None
                  and type(self).target.capabilities.preempt_call is not None
                  and self.checker.in_flight_steps() < self.cfg.depth and bool(self._holding()))
    @rule(req=requests.filter(lambda r: r.rid in r.machine._holding()))
    def preempt(self, req: RequestRef) -> None:
        self._apply(Preempt(req.rid))

    def _loading(self) -> list[tuple[str, int, int]]:
        out = self._memo.get("loading")
        if out is None:
            out = self._memo["loading"] = self._find_loading()
        return out

    def _find_loading(self) -> list[tuple[str, int, int]]:
        out: list[tuple[str, int, int]] = []
        if self.checker is None:
            return out
        for step in self.checker.pending:
            for pp in step:
                if pp.rs.loaded and not pp.dead and pp.rs.rid not in self.checker.failing:
                    B = self.cfg.block_size
                    lo = (pp.rs.start - pp.rs.loaded) // B
                    hi = (pp.rs.start - 1) // B
                    out.append((pp.rs.rid, lo, hi))
        return out

    @precondition(lambda self: bool(self._live()))
    @rule(req=consumes(requests).filter(lambda r: r.rid in r.machine._live()),
          abort=st.booleans())
    def finish(self, req: RequestRef, abort: bool) -> None:
        self._apply(Abort(req.rid) if abort else Finish(req.rid))

    def teardown(self) -> None:
        try:
            if (self.checker is not None and self.drain and self.violation is None
                    and not self.passed_over):
                self._tearing_down = True
                with contextlib.suppress(_PassedOver):
                    self._drain()
        finally:
            if self.checker is not None:
                type(self).stats.witness.update(self.checker.witness)
            if type(self).on_example is not None:
                type(self).on_example("teardown", self)

    # ------------------------------------------------------- property 7

    def _drain(self) -> None:
        """Property 7's liveness half: a Drain event (properties/drain.py)."""
        from properties.drain import drain

        cls = type(self)
        self.events.append(Drain())
        cls.stats.events["Drain"] += 1
        reqs = {e.id: e for e in self.events if isinstance(e, AddRequest)}
        v = drain(self.cfg, self.checker, self.counters, reqs, self._live,
                  lambda ev: self._apply(ev, record=False), len(self.events) - 1,
                  getattr(cls.target, "can_apply", None))
        if v is not None:
            self._fail(v)


class FailingLoads(KVMachine):
    """The machine with the FailLoad rule: made where loads can fail (a
    connector loads a request's external tokens, ``FuzzSpec.fail_loads``), so
    a setting without them has no rule that is never enabled."""

    # a failed load names a block of the config's size: not stated for groups
    # of different block sizes (vLLM maps failed block ids to requests only
    # with one KV-cache group anyway)
    @precondition(lambda self: bool(self._loading()) and not self.cfg.mixed_block_sizes)
    @rule(data=st.data())
    def fail_load(self, data: st.DataObject) -> None:
        rid, k = data.draw(_failed_load(tuple(self._loading())))
        self._apply(FailLoad(rid, k))


class RequestRef:
    """A request in the machine's ``requests`` Bundle: its id, and the machine
    that added it (what the Bundle's filters ask whether it still runs)."""

    __slots__ = ("rid", "machine")

    def __init__(self, rid: str, machine: KVMachine) -> None:
        self.rid, self.machine = rid, machine

    def __repr__(self) -> str:
        return self.rid


@functools.lru_cache(maxsize=1024)
def _request_args(B: int, S: int, longer: bool, external: bool, aligned: bool,
                  prefix: bool) -> st.SearchStrategy[tuple[int, int, int, int]]:
    """An AddRequest's prompt length, output length, external (connector)
    tokens and prompt variant, for a config of block size ``B`` and scheduler
    block size ``S``: one draw."""

    @st.composite
    def args(draw: Any) -> tuple[int, int, int, int]:
        prompt = draw(_ints(1, 6 * B))
        new = draw(_ints(1, (5 if longer else 2) * B))
        ext = 0
        if external and not aligned and prompt > 1:
            ext = draw(_zero_or(1, prompt - 1))
        elif external and prompt > S:
            # block-granular connectors (offloading, LMCache, ...) offer whole
            # blocks (of every group: the scheduler block size)
            ext = S * draw(_ints(0, (prompt - 1) // S))
        # with prefix caching, another prompt that shares every block past its
        # one differing token: a prefix hit must not hand it variant 0's KV
        variant = draw(_zero_or(1, MAX_VARIANT)) if prefix else 0
        return prompt, new, ext, variant

    return args()


# one schedule in eight with a step in flight is preceded by the client's
# reset_prefix_cache call (it preempts every request and may empty the cache:
# more often, or with nothing in flight, prefix hits grow rare); at depth 1,
# where nothing is ever in flight at a schedule, one schedule in eight too
_RESET_FIRST = st.integers(0, 7).map(lambda n: n == 7)


@functools.lru_cache(maxsize=1024)
def _accepted(drafts: tuple[int, ...]) -> st.SearchStrategy[tuple[int, ...]]:
    """How many of each request's drafts a step accepts (0..drafts)."""
    return st.tuples(*(_ints(0, n) for n in drafts))


@functools.lru_cache(maxsize=1024)
def _failed_load(loading: tuple[tuple[str, int, int], ...]) -> st.SearchStrategy[tuple[str, int]]:
    """A load in flight, as (request, first logical block, last), and the
    first block of it that fails."""
    return _sampled(loading).flatmap(lambda ld: st.tuples(st.just(ld[0]), _ints(ld[1], ld[2])))


def make_machine(spec: FuzzSpec, target: Target) -> type[KVMachine]:
    """The machine of one fuzz setting: its config strategy in the
    ``initialize`` rule, and a name that keys its example database entries."""
    key = spec.key()
    name = ("KVMachine_" + "".join(c if c.isalnum() else "_" for c in key) + "_"
            + hashlib.sha256(key.encode()).hexdigest()[:16])

    @initialize(cfg=config_strategy(spec), drain=st.booleans())
    def setup(self: KVMachine, cfg: Config, drain: bool) -> None:
        self._setup(cfg, drain)

    base = FailingLoads if spec.fail_loads and spec.external else KVMachine
    return type(name, (base,), {"spec": spec, "stats": RunStats(), "target": target,
                                "setup": setup})


def database_key(spec: FuzzSpec, target: Target | None = None) -> bytes:
    """The key Hypothesis files a fuzz setting's examples under: the digest
    of its state-machine test, which differs between settings by the
    machine's name alone (:func:`make_machine`). Its test in tests/test_gate.py
    holds it to the key Hypothesis itself saves under."""
    from hypothesis.internal.reflection import function_digest
    from hypothesis.stateful import get_state_machine_test

    test = get_state_machine_test(make_machine(spec, target))
    return function_digest(test.hypothesis.inner_test)


@dataclass
class FuzzResult:
    spec: FuzzSpec
    stats: RunStats
    violation: Violation | None = None
    trace: Trace | None = None
    crash: str | None = None
    seconds: float = 0.0
    stopped: bool = False  # ended early (StopRun): fewer examples than asked
    attention: tuple[int, list] | None = None  # (examples replayed, [(trace, bad read)])
    workers: int = 1
    examples_to_fail: int | None = None  # examples run up to the first failing one
    replayed_from_database: int = 0  # saved examples fetched to replay first
    # the base's saved failures replayed first (jobs.fuzz_job(borrow=...)); a
    # run that holds held on every one of them
    borrowed_from_base: int = 0
    # the counterexample's length as Hypothesis shrank it, before
    # properties/minimize.py (what a run without that pass would report)
    shrunk_events: int | None = None
    # Hypothesis's shrinking was cut at fuzz(shrink_seconds=...): the
    # counterexample is the shortest failing one it had run by then
    shrink_cut: bool = False

    def base_result(self) -> FuzzResult | None:
        """The shortest example passed over as failing on the base too
        (``fuzz(base_fails=...)``), as a result of its own; None when there
        was none."""
        ex = self.stats.base_example
        if ex is None:
            return None
        cfg, events, v, crash = ex
        meta = {"target": self.spec.target, "violation": str(v or "target crash")}
        return replace(self, violation=v, crash=crash,
                       trace=Trace(cfg, list(events), meta=meta),
                       shrunk_events=len(events))

    @property
    def vacuous(self) -> list[str]:
        """The expected witnesses the run never reached (every one, as "any
        example", when no example ran: a run whose configs were all refused,
        or stopped before its first)."""
        if not self.stats.examples:
            return ["any example"]
        return sorted(w for w in self.stats.expected if not self.stats.witness.get(w))

    @property
    def verdict(self) -> str:
        """The run's verdict, in the order the CLI decides it: ``crashed``,
        ``violation``, ``missed`` (attention saw a bad read the checker did
        not), ``vacuous`` (an expected witness never reached), ``holds``."""
        if self.crash:
            return "crashed"
        if self.violation is not None:
            return "violation"
        if self.attention is not None and self.attention[1]:
            return "missed"
        return "vacuous" if self.vacuous else "holds"

    def to_json(self, violation: Violation | None = None,
                trace_path: str | None = None) -> dict[str, Any]:
        """The run as JSON (``./kvcheck fuzz --json``): the verdict, the
        violated property and the counterexample's length, the witnesses and
        event counts, and where the trace was saved. ``violation``: the one the
        saved trace replays to, when it is not the run's own."""
        v = violation or self.violation
        verdict = self.verdict
        if verdict == "crashed":
            message = next((ln.strip() for ln in reversed(self.crash.splitlines()) if ln.strip()),
                           "the target crashed")
        elif verdict == "violation":
            message = f"VIOLATION {v}"
        elif verdict == "missed":
            message = str(self.attention[1][0][1])
        elif verdict == "vacuous":
            message = f"never reached: {', '.join(self.vacuous)}"
        else:
            message = "all properties hold"
        st = self.stats
        return {
            "verdict": verdict,
            "property": v.prop if verdict == "violation" else None,
            "property_name": v.name if verdict == "violation" else None,
            "events": len(self.trace.events) if self.trace is not None else None,
            "shrunk_events": self.shrunk_events,
            "message": message,
            "crash": self.crash,
            "target": self.spec.target, "kind": self.spec.kind, "policy": self.spec.policy,
            "examples": st.examples,
            "examples_to_fail": self.examples_to_fail,
            "event_counts": dict(sorted(st.events.items())),
            "witnesses": dict(st.witness),
            "vacuous": self.vacuous,
            "unrequired": dict(sorted(st.unrequired.items())),
            "refused": dict(st.refused),
            "layouts": dict(st.layouts),
            "trace": trace_path,
            "seconds": round(self.seconds, 3),
            "workers": self.workers,
            "shrink_cut": self.shrink_cut,
        }


class _Shortest:
    """The shortest failing example run so far that fails as the first one
    did (the same property and name, or a crash), and when the first failed:
    what :func:`fuzz` reports when it cuts Hypothesis's shrinking short."""

    def __init__(self, seconds: float | None, on_example: Any) -> None:
        self.seconds, self.on_example = seconds, on_example
        self.first_at: float | None = None
        self.sig: tuple | None = None
        self.best: tuple[Config, list[Event], Violation | None, TargetCrash | None] | None = None

    def __call__(self, phase: str, machine: KVMachine) -> None:
        import time

        if (phase == "setup" and self.first_at is not None and self.seconds is not None
                and time.perf_counter() - self.first_at > self.seconds):
            raise StopRun  # at an example's start: the shortest one so far stands
        if self.on_example is not None:
            self.on_example(phase, machine)
        if phase != "teardown" or machine.cfg is None:
            return
        v, crash = machine.violation, machine.crash if machine.crashed else None
        if v is None and crash is None:
            return
        sig = ("crash",) if crash is not None else (v.prop, v.name)
        if self.sig is None:
            self.sig, self.first_at = sig, time.perf_counter()
        if sig == self.sig and (self.best is None or len(machine.events) < len(self.best[1])):
            self.best = (machine.cfg, list(machine.events), v, crash)


def fuzz(spec: FuzzSpec, examples: int = 200, seed: int | None = None,
         database: Any = None, target: Target | None = None,
         on_example: Any = None, minimize_trace: bool = True,
         shrink_seconds: float | None = None, base_fails: Any = None) -> FuzzResult:
    """Run the state machine; returns the verdict with the shrunk trace if any.
    ``shrink_seconds``: once an example fails, let Hypothesis shrink for about
    that long, then keep the shortest example failing the same way it ran
    (``FuzzResult.shrink_cut``; properties/minimize.py still runs on it).
    ``base_fails(config, events, violation, crash)``: whether the gate's base
    fails an example the same way; such failures are passed over
    (:meth:`KVMachine._pass_over`), and the run reports only one the base
    does not show (the shortest passed over: ``FuzzResult.base_example``)."""
    import time

    target = target or make_target(spec.target)
    survives = getattr(target, "hybrid_failed_loads", None)
    if spec.kind == "hybrid" and spec.external and survives is not None:
        spec.mamba_loads = survives(spec.load_failure)
    cls = make_machine(spec, target)
    shortest = _Shortest(shrink_seconds, on_example)
    cls.on_example = staticmethod(shortest)
    if base_fails is not None:
        cls.base_fails = staticmethod(base_fails)
    if seed is not None:
        cls = with_seed(seed)(cls)
    s = settings(
        max_examples=examples,
        stateful_step_count=spec.max_steps or (
            50 if spec.kind in KINDS and KINDS[spec.kind].long_outputs else 30),
        deadline=None,
        database=database,
        suppress_health_check=SUPPRESSED,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        report_multiple_bugs=False,
        print_blob=False,
    )
    t0 = time.perf_counter()
    result = FuzzResult(spec, cls.stats)
    example: tuple[Config | None, list[Event]] = (None, [])
    try:
        run_state_machine_as_test(cls, settings=s)
    except StopRun:
        if shortest.best is None:
            result.stopped = True
        else:  # shrinking cut short: the shortest failing example it ran
            config, events, v, crash = shortest.best
            example, result.shrink_cut = (config, events), True
            if crash is not None:
                result.crash = str(crash)
            else:
                result.violation = v
    except Unsatisfiable:
        st = cls.stats
        if st.on_base:  # every example it ran failed as on the base
            result.seconds = time.perf_counter() - t0
            return result
        # every example drawn was refused: the target cannot run what was asked
        from impl.target import TargetError

        why = st.refusals.most_common(1)[0][0] if st.refusals else "no example could be drawn"
        n = sum(st.refused.values())
        raise TargetError(f"{spec.target} runs none of the examples asked for "
                          f"(kind {spec.kind}; {n} refused): {why}") from None
    except PropertyFailed as e:
        result.violation = e.violation
        example = (e.config, e.events)
    except TargetCrash as e:
        result.crash = str(e)
        example = getattr(e, "example", example)
    except Exception as e:  # noqa: BLE001 - hypothesis wraps; report the first error
        if not isinstance(getattr(e, "violation", None), Violation):
            raise
        result.violation = e.violation
        example = (getattr(e, "config", None), getattr(e, "events", []))
    result.seconds = time.perf_counter() - t0
    config, events = example
    if config is not None and (result.violation is not None or result.crash is not None):
        meta = {"target": spec.target, "violation": str(result.violation or "target crash")}
        if len(spec.props) < 7:
            meta["props"] = sorted(spec.props)
        result.trace = Trace(config, list(events), meta=meta)
        result.shrunk_events = len(events)
        if result.violation is not None and minimize_trace:
            from properties.minimize import minimize

            keep = None
            if base_fails is not None:
                v = result.violation

                def keep(t: Trace) -> bool:
                    return not base_fails(t.config, t.events, v, None)

            result.trace = minimize(result.trace, target, result.violation.prop, keep=keep,
                                    seconds=shrink_seconds)
    return result
