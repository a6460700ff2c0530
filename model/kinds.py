"""Attention kinds: one small class each, as vLLM writes one manager per kind.

A kind answers, for one KV-cache group and one request whose prompt has
``P`` tokens (``P`` matters to ``rswa`` only):

* :meth:`Kind.window`: the positions that computing position ``t`` reads, as
  half-open ranges (every kind reads one contiguous range ending at ``t``,
  R-SWA two: its prompt and its recent tokens);
* :meth:`Kind.span`: what a step computing ``[a, e)`` reads, the union of
  those windows;
* :meth:`Kind.freeable`: the logical blocks no position ``>= n`` reads, which
  a manager may replace by NULL once ``n`` tokens are settled;
* :meth:`Kind.live_span`: how many tokens' blocks a request keeps when the
  manager runs ``ahead`` tokens past the count it frees on (None: all);
* :meth:`Kind.reserved_blocks`: physical blocks the kind keeps for itself
  (the static sink's KV), read by every step of every request;
* :meth:`Kind.reprefill`: positions below its start a step continuing the
  request's prefill computes again (a sliding window's retained tokens).

Besides, what the other layers need of a kind, as facts of its class:
``frees_early`` (it returns blocks before the request ends), ``holds_state``
(a block holds one recurrent state, not positions), ``vllm_spec`` and
``vllm_param`` (the ``KVCacheSpec`` class of vLLM that builds its layer and
the keyword its parameter goes to), :meth:`Kind.kernel_window` (how vLLM's
attention kernel expresses its window), and the fuzzer's draws
(``fuzz_window_blocks``, ``long_outputs``, :meth:`Kind.fuzz_param`).

``KINDS`` maps each name to its class; ``model.events.Group`` names a kind
and its parameter, and ``Group.spec`` is the kind object. The reference
manager (impl/reference/managers.py), the vLLM spec builder
(impl/vllm/driver.py) and the Z3 terms (prove/z3model.py) have one entry per
kind each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from .mamba_slots import running_slot

Ranges = tuple[tuple[int, int], ...]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Kind:
    name: ClassVar[str]
    param_name: ClassVar[str] = ""  # what the parameter is called ("" for none)
    vllm_manager: ClassVar[str]  # the vLLM manager class it models
    vllm_spec: ClassVar[str]  # the vLLM KVCacheSpec class of its layers
    vllm_param: ClassVar[str] = ""  # the spec's keyword for the parameter
    # keywords of the spec that differ from an attention layer's (the driver's
    # one KV head of 8 dims, K and V)
    vllm_spec_extra: ClassVar[dict[str, int]] = {}
    frees_early: ClassVar[bool] = True  # returns blocks before the request ends
    holds_state: ClassVar[bool] = False  # a block holds one state, not positions
    # logical block i holds positions [i*B, (i+1)*B) of the request's own tokens
    # (False: a ring or the encoder's outputs; no content rule, no attention replay)
    reads_positions: ClassVar[bool] = True
    prefix_cacheable: ClassVar[bool] = True  # vLLM's manager takes prefix hits
    # the group models always put beside this kind (its config is that pair)
    beside: ClassVar[str | None] = None
    # vLLM turns chunked prefill off for its models: a prefill is one step
    whole_prefill: ClassVar[bool] = False
    # the model is an encoder-decoder and the parameter is the encoder's length
    encoder: ClassVar[bool] = False
    # the fuzzer draws a window of up to this many blocks (kinds with a window)
    fuzz_window_blocks: ClassVar[int] = 4
    long_outputs: ClassVar[bool] = False  # what it frees lies among long outputs
    # a group of it may take a block size of its own (a multiple of the config's
    # ``B``, as vLLM's page-size unification gives one; Mamba's state blocks and
    # the sink's reserved blocks are sized by ``B``)
    own_block_size: ClassVar[bool] = True
    # vLLM's prefix lookup for it asserts that its block size is the hit
    # alignment (0.33.0's chunked-local manager): no other block size beside it
    vllm_one_block_size: ClassVar[bool] = False
    # vLLM's manager looks a hit up at hash units inside its blocks
    # (``supports_fine_grained_hash_lookup``): full attention and its
    # subclasses, Mamba
    sub_block_lookup: ClassVar[bool] = False

    retained: int = 0  # tokens kept below the window (sliding only; vLLM's extra_retained_tokens)
    # tokens vLLM's manager frees behind :meth:`freeable` on the same count
    # (R-SWA: its gap ends at ``n - R``, one token short of the window)
    vllm_frees_behind: ClassVar[int] = 0
    # vLLM's manager takes a prefix hit's blocks whole, window or not (the
    # full-attention lookup), after it let go of the request's skipped blocks
    # for that step: a hit block the rule lets go of is let go at the
    # request's next step (R-SWA's gap, on a preempted request's resumption)
    vllm_hit_keeps_gap: ClassVar[bool] = False
    # vLLM's planner gives its layers a drafter's retained tokens (SlidingWindowSpec)
    retains_tokens: ClassVar[bool] = False

    def __init__(self, param: int = 0) -> None:
        self.param = param

    def label(self) -> str:
        return f"{self.name}({self.param_name[0].upper()}={self.param})" if self.param_name \
            else self.name

    def problem(self, block_size: int) -> str | None:
        """Why this kind cannot run with ``block_size`` (None: it can)."""
        if self.param_name and self.param < 1:
            return f"{self.name} needs a positive {self.param_name}, got {self.param}"
        return None

    # ------------------------------------------------------------- reading

    def lo(self, t: int) -> int:
        """The lowest position of the range ending at ``t`` that ``t`` reads."""
        raise NotImplementedError

    def window(self, t: int, prompt_len: int | None = None) -> Ranges:
        if t < 0:
            raise ValueError("position must be >= 0")
        return ((self.lo(t), t + 1),)

    def span(self, a: int, e: int, prompt_len: int | None = None) -> Ranges:
        """Positions a step computing ``[a, e)`` reads (``e > a``): the windows
        move right with ``t``, so it is ``window(a)`` stretched to ``e``."""
        w = self.window(a, prompt_len)
        return (*w[:-1], (w[-1][0], e))

    def span_blocks(self, a: int, e: int, block_size: int,
                    prompt_len: int | None = None) -> range | list[int]:
        """Logical blocks a step computing ``[a, e)`` reads (empty if none)."""
        if e <= a:
            return range(0)
        w = self.span(a, e, prompt_len)
        if len(w) == 1:
            return range(w[0][0] // block_size, (w[0][1] - 1) // block_size + 1)
        out: list[int] = []
        for x, y in self.span(a, e, prompt_len):
            first, last = x // block_size, (y - 1) // block_size
            out.extend(range(max(first, out[-1] + 1 if out else first), last + 1))
        return out

    # ------------------------------------------------------------- freeing

    def skipped(self, n: int) -> int:
        """Leading tokens no position ``>= n`` reads (vLLM's
        ``get_num_skipped_tokens``); kinds that free a middle range say 0."""
        return self.lo(n) if n > 0 else 0

    def freeable(self, n: int, block_size: int, prompt_len: int | None = None) -> range:
        """Logical blocks wholly outside the window of every position ``>= n``."""
        return range(self.skipped(n) // block_size)

    def live_span(self, ahead: int) -> int | None:
        """Tokens whose blocks stay live when the manager frees on a count
        ``ahead`` tokens behind the newest scheduled one (None: every token)."""
        return None

    def live_bound(self, block_size: int, max_model_len: int, ahead: int) -> int:
        """Most live blocks one request holds: a span of ``L`` tokens not
        aligned to blocks touches ``cdiv(L, B) + 1`` blocks at most; never more
        than the whole request needs."""
        full = cdiv(max_model_len, block_size)
        span = self.live_span(ahead)
        return full if span is None else min(full, cdiv(span, block_size) + 1)

    def admission_cap(self, block_size: int, max_model_len: int, ahead: int) -> int | None:
        """The most blocks admission asks for per request (vLLM's
        ``max_admission_blocks_per_request``; None: the whole request), which
        sizes the pool at startup. Property 5 judges against
        :meth:`live_bound`, the checker's own bound, not this."""
        return None

    def reserved_blocks(self, block_size: int) -> range:
        """Physical blocks the kind holds for itself for the pool's lifetime."""
        return range(0)

    def startup_share(self, block_size: int, budget: int) -> int | None:
        """Blocks vLLM's startup check sets aside for one request where that is
        not the admission rule's figure (None: it is)."""
        return None

    def speculative_blocks(self, spec_tokens: int) -> int:
        """Blocks a request holds beyond its tokens' for drafts (vLLM's
        ``num_speculative_blocks``)."""
        return 0

    def reprefill(self) -> int:
        """Positions below its start that a step continuing the request's own
        prefill computes again (a multi-module MTP drafter's lagging modules);
        its reads reach the windows of those positions too. 0 for every kind
        but a sliding window with retained tokens."""
        return 0

    # ------------------------------------------------------------- others' views

    def kernel_window(self) -> tuple[int, int] | None:
        """vLLM's ``unified_attention`` window ``(left, right)`` for this kind
        (``(-1, -1)``: causal over the rows given; None: the kernel cannot
        express it). :attr:`kernel_from_lo` kinds pass each row's table from
        the block of ``lo(t)`` on."""
        return (-1, -1)

    kernel_from_lo: ClassVar[bool] = False

    @classmethod
    def fuzz_param(cls, window: int, chunk: int, block_size: int,
                   draw_int: Callable[[int, int], int]) -> int:
        """The parameter the fuzzer gives this kind: of the window and the chunk
        it drew for every config, or its own (``draw_int(lo, hi)``)."""
        return 0


class Full(Kind):
    """full: every position reads all earlier ones; nothing is ever skipped::

        t = 9            [ 0  1  2  3  4  5  6  7  8  9 ]
                         |------------ read -----------|
    """

    name = "full"
    vllm_manager = "FullAttentionManager"
    sub_block_lookup = True
    vllm_spec = "FullAttentionSpec"
    frees_early = False

    def lo(self, t: int) -> int:
        return 0


class Sliding(Kind):
    """sliding(W): position ``t`` reads ``[t-W+1, t]``. W = 4, n = 7 computed::

        tokens           [ 0  1  2  3  4  5  6  7 ]
                         |---- computed ----|
                                     |--- read --|        skipped = n - W + 1 = 4

    sliding(W, R): ``R`` retained tokens (vLLM's ``extra_retained_tokens``,
    ``num_prefill_lookahead_tokens - 1``: ``K - 1`` for a multi-module MTP
    drafter of ``K`` drafts). At a chunked-prefill boundary the drafter's
    later modules lag the chunk by up to ``R`` positions; the next chunk
    computes them again, so a step continuing the prefill from ``a`` reads the
    windows of ``[a-R, e)``, and the manager keeps ``R`` more tokens (vLLM
    always; the checker asks for them only while ``n`` is inside the prompt).
    W = 4, R = 2, n = 7::

        tokens           [ 0  1  2  3  4  5  6  7 ]
                         |---- computed ----|
                                       |R |              computed again: 5, 6
                               |----- read ----|         skipped = n - W + 1 - R = 2
    """

    name = "sliding"
    param_name = "window"
    vllm_manager = "SlidingWindowManager"
    retains_tokens = True
    vllm_spec, vllm_param = "SlidingWindowSpec", "sliding_window"

    def __init__(self, param: int = 0, retained: int = 0) -> None:
        super().__init__(param)
        self.retained = retained

    def label(self) -> str:
        return f"sliding(W={self.param}, R={self.retained})" if self.retained \
            else super().label()

    def problem(self, block_size: int) -> str | None:
        if self.retained < 0:
            return f"sliding needs retained tokens >= 0, got {self.retained}"
        return super().problem(block_size)

    def lo(self, t: int) -> int:
        return max(0, t - self.param + 1)

    def skipped(self, n: int) -> int:
        return max(0, n - self.param + 1 - self.retained) if n > 0 else 0

    def freeable(self, n: int, block_size: int, prompt_len: int | None = None) -> range:
        # the retained tokens matter only while the prefill can continue: from
        # the prompt's end on no step computes a position below its start again
        if self.retained and prompt_len is not None and n >= prompt_len:
            return range(max(0, n - self.param + 1) // block_size)
        return range(self.skipped(n) // block_size)

    def reprefill(self) -> int:
        return self.retained

    def kernel_window(self) -> tuple[int, int] | None:
        return (self.param - 1, 0)

    @classmethod
    def fuzz_param(cls, window, chunk, block_size, draw_int) -> int:
        return window

    def live_span(self, ahead: int) -> int | None:
        return self.param - 1 + self.retained + ahead

    def admission_cap(self, block_size: int, max_model_len: int, ahead: int) -> int | None:
        # the last W-1+R settled tokens plus those ahead, and one block for a
        # window that does not start at a block edge
        return cdiv(min(self.param - 1 + self.retained + ahead, max_model_len), block_size) + 1


class ChunkedLocal(Kind):
    """chunked_local(C): position ``t`` reads ``[floor(t/C)*C, t]``. C = 8, n = 13::

        tokens           [ 0 .. 7 | 8  9 10 11 12 13 14 15 ]
                                  |------ read ----|      skipped = floor(n/C)*C = 8
    """

    name = "chunked_local"
    param_name = "chunk"
    vllm_manager = "ChunkedLocalAttentionManager"
    vllm_spec, vllm_param = "ChunkedLocalAttentionSpec", "attention_chunk_size"
    kernel_from_lo = True
    vllm_one_block_size = True

    @classmethod
    def fuzz_param(cls, window, chunk, block_size, draw_int) -> int:
        return chunk

    def problem(self, block_size: int) -> str | None:
        if self.param < 1:
            return f"chunked_local needs a positive chunk, got {self.param}"
        if self.param % block_size:
            return f"chunk {self.param} must be a multiple of the block size {block_size}"
        return None

    def lo(self, t: int) -> int:
        return (t // self.param) * self.param

    def live_span(self, ahead: int) -> int | None:
        return self.param - 1 + ahead

    def admission_cap(self, block_size: int, max_model_len: int, ahead: int) -> int | None:
        # one chunk plus the tokens ahead (chunk-aligned: no extra block)
        return cdiv(min(self.param + ahead, max_model_len), block_size)


class Mamba(Kind):
    """mamba: the recurrent state after position ``t-1`` is all that ``t`` reads;
    vLLM keeps "the state of the last computed token" (``skipped(n) = n - 1``),
    so in token terms a window of 2. The state after ``t`` lives in the slot
    of ``t`` (an assumption, written down)::

        n = 7            [ 0  1  2  3  4  5  6 | 7 ]
                                           |-read-|       skipped = n - 1 = 6

    mamba with ``K`` speculative blocks (drafts, vLLM's align mode): a step
    computing ``[a, e)`` keeps its running state and the state after each of
    its ``K`` drafts in the ``1 + K`` slots from ``s = (e-1)//B`` on (the
    worker's ``mamba_get_block_table_tensor``); the next step starts from the
    accepted draft's slot, ``s + accepted``, copying it into its own ``s``.
    K = 2, B = 4, a decode computing [5, 8) (two drafts)::

        tokens    [ 0..3 | 4..7 |      |      ]
        slots        0      1      2      3
                   in: 4   s=1: after 5, 2: after 6, 3: after 7
    """

    name = "mamba"
    vllm_manager = "MambaManager"
    sub_block_lookup = True
    vllm_spec = "MambaSpec"
    holds_state = True
    own_block_size = False

    def kernel_window(self) -> tuple[int, int] | None:
        return (1, 0)

    def __init__(self, param: int = 0, spec_blocks: int = 0) -> None:
        super().__init__(param)
        self.spec_blocks = spec_blocks

    def speculative_blocks(self, spec_tokens: int) -> int:
        return spec_tokens  # a state slot per draft token

    def lo(self, t: int) -> int:
        return max(0, t - 1)

    def span_blocks(self, a: int, e: int, block_size: int,
                    prompt_len: int | None = None) -> range | list[int]:
        """A step computing ``[a, e)`` reads the state after ``a - 1`` and
        writes the state after ``e - 1``; the states in between never leave
        the kernel, so their slots may be NULL (vLLM's ``align`` mode keeps
        only the last block of a prefill chunk)::

            a = 4, e = 12, B = 4   [ 0..3 | 4..7 | 8..11 ]
                                      in     NULL    out

        With ``K`` speculative blocks it also writes the ``K`` slots after the
        last (a draft's state each), and the state it starts from is the
        previous step's accepted one: in the slot of ``a - 1`` or among the
        slots it writes, as long as a step moves by at most ``B`` tokens per
        block (``K < B``). With more drafts it lies in the previous step's
        running slot plus its accepted drafts, which the checker takes from
        that step (:func:`model.mamba_slots.start_slot`)."""
        if e <= a:
            return range(0)
        last = running_slot(e, block_size)
        first = (a - 1) // block_size if a > 0 else last
        out = [first, last] if first < last else [last]
        if self.spec_blocks:
            out.extend(range(last + 1, last + 1 + self.spec_blocks))
        return out

    def live_span(self, ahead: int) -> int | None:
        return 1 + ahead

    def live_bound(self, block_size: int, max_model_len: int, ahead: int) -> int:
        return super().live_bound(block_size, max_model_len, ahead) + self.spec_blocks


class RSWA(Kind):
    """rswa(R): reference sliding window. Position ``t`` reads the whole prompt
    ``[0, P)`` and the last ``R`` positions ``[t-R+1, t]`` (vLLM's
    ``rswa_mask_mod``: ``kv < prefix_len or q - kv < window``). The gap
    between them is freed, a middle range rather than a head prefix.
    P = 5, R = 3, n = 12 settled, B = 2::

        tokens   [ 0  1  2  3  4 | 5  6  7  8  9 10 | 11 12 ]
                 |--- prompt ----|                  |- read -|   t = 12
                                    |- gap: freeable -|          blocks wholly in [5, 10)
        blocks   [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ]
                               ^ first block past the prompt: cdiv(P, B) = 3
                                          freeable = blocks 3, 4 (positions [6, 10))
    """

    name = "rswa"
    param_name = "window"
    vllm_manager = "RSWAManager"
    sub_block_lookup = True
    vllm_spec, vllm_param = "RSWASpec", "rswa_window"
    vllm_frees_behind = 1
    vllm_hit_keeps_gap = True  # RSWAManager inherits FullAttentionManager's lookup
    # R-SWA frees only once the outputs run R tokens past the prompt: short
    # windows, longer generations
    fuzz_window_blocks = 1
    long_outputs = True

    def kernel_window(self) -> tuple[int, int] | None:
        return None

    @classmethod
    def fuzz_param(cls, window, chunk, block_size, draw_int) -> int:
        return window

    def label(self) -> str:
        return f"rswa(R={self.param})"

    def lo(self, t: int) -> int:
        return max(0, t - self.param + 1)

    def window(self, t: int, prompt_len: int | None = None) -> Ranges:
        if t < 0:
            raise ValueError("position must be >= 0")
        if prompt_len is None:
            raise ValueError("rswa reads depend on the prompt length")
        lo = t - self.param + 1
        if lo <= prompt_len:
            return ((0, t + 1),)
        return ((0, prompt_len), (lo, t + 1))

    def skipped(self, n: int) -> int:
        return 0  # the prompt is always read

    def freeable(self, n: int, block_size: int, prompt_len: int | None = None) -> range:
        if prompt_len is None:
            raise ValueError("rswa frees depend on the prompt length")
        first = cdiv(prompt_len, block_size)
        return range(first, max(first, (n - self.param + 1) // block_size))


class Sink(Kind):
    """sink(S): full attention behind ``S`` static sink tokens. vLLM's
    ``StaticSinkAttention`` writes the sink's KV once into physical blocks
    ``1 .. S/B`` and puts them in front of every request's block table, so
    every step of every request reads them; they must never be handed to a
    request (``SinkFullAttentionManager`` takes them out of the pool)::

        read by t        [ sink: blocks 1..S/B ][ 0  1  2 .. t ]
    """

    name = "sink"
    param_name = "sink_len"
    vllm_manager = "SinkFullAttentionManager"
    sub_block_lookup = True
    vllm_spec, vllm_param = "SinkFullAttentionSpec", "sink_len"
    frees_early = False
    own_block_size = False

    def kernel_window(self) -> tuple[int, int] | None:
        return None

    @classmethod
    def fuzz_param(cls, window, chunk, block_size, draw_int) -> int:
        return block_size * draw_int(1, 2)

    def label(self) -> str:
        return f"sink(S={self.param})"

    def problem(self, block_size: int) -> str | None:
        if self.param < 1 or self.param % block_size:
            return (f"sink needs a positive sink length that is a multiple of the block "
                    f"size {block_size}, got {self.param}")
        return None

    def lo(self, t: int) -> int:
        return 0

    def reserved_blocks(self, block_size: int) -> range:
        return range(1, 1 + self.param // block_size)


class Ring(Kind):
    """ring: vLLM's circular buffer (``CircularBufferSpec``), one block of ``B``
    slots per request that a compressor's kernel writes at slot ``t % B`` (the
    raw keys of the token group it has not closed yet) and every step reads.
    The block is claimed at the request's first allocation and kept until the
    request ends: nothing is freeable, and no prefix hit is taken. B = 4::

        positions        [ 0  1  2  3 | 4  5  6  7 | 8  9 ]        t = 9
        ring block       [ 8  9  6  7 ]   slot t % 4; slots 2, 3 still hold 6, 7
        logical blocks   0 (the ring) and nothing else          freeable: none
    """

    name = "ring"
    vllm_manager = "CircularBufferManager"
    vllm_spec = "CircularBufferSpec"
    # keys only, of twice the head: the page of the attention layer beside it,
    # so vLLM's planner keeps B tokens a block in both groups
    vllm_spec_extra = {"head_size": 16, "head_size_v": 0}
    frees_early = False
    reads_positions = False
    prefix_cacheable = False
    beside = "full"  # the compressor's ring lies beside the attention layers

    def lo(self, t: int) -> int:
        return max(0, t)  # what the ring holds is the kernel's; its one block is read

    def span_blocks(self, a: int, e: int, block_size: int,
                    prompt_len: int | None = None) -> range | list[int]:
        return range(1) if e > a else range(0)

    def skipped(self, n: int) -> int:
        return 0

    def live_bound(self, block_size: int, max_model_len: int, ahead: int) -> int:
        return 1

    def admission_cap(self, block_size: int, max_model_len: int, ahead: int) -> int | None:
        return 1

    def kernel_window(self) -> tuple[int, int] | None:
        return None


class Cross(Kind):
    """cross(E): encoder-decoder cross attention (``CrossAttentionSpec``). The
    encoder runs once, when the request is first scheduled, and writes its
    ``E`` outputs (Whisper: ``max_source_positions``) into ``cdiv(E, B)``
    blocks that every decoder position reads and that are kept until the
    request ends. Decoder positions index nothing here. E = 6, B = 4::

        encoder outputs  [ e0 e1 e2 e3 | e4 e5 -- -- ]   blocks 0, 1: allocated at admission
        decoder t        reads e0 .. e5, for every t      freeable: none
    """

    name = "cross"
    param_name = "encoder_len"
    vllm_manager = "CrossAttentionManager"
    vllm_spec = "CrossAttentionSpec"
    frees_early = False
    reads_positions = False
    prefix_cacheable = False
    beside = "full"  # the decoder's self-attention
    whole_prefill = True  # encoder-decoder models: no chunked prefill in vLLM
    encoder = True

    def label(self) -> str:
        return f"cross(E={self.param})"

    def lo(self, t: int) -> int:
        return 0

    def encoder_blocks(self, block_size: int) -> int:
        return cdiv(self.param, block_size)

    def span_blocks(self, a: int, e: int, block_size: int,
                    prompt_len: int | None = None) -> range | list[int]:
        return range(self.encoder_blocks(block_size)) if e > a else range(0)

    def skipped(self, n: int) -> int:
        return 0

    def live_bound(self, block_size: int, max_model_len: int, ahead: int) -> int:
        return self.encoder_blocks(block_size)

    def admission_cap(self, block_size: int, max_model_len: int, ahead: int) -> int | None:
        return self.encoder_blocks(block_size)

    def startup_share(self, block_size: int, budget: int) -> int | None:
        # CrossAttentionSpec.max_memory_usage_bytes: the encoder budget
        # (max_num_encoder_input_tokens, at least the batch budget), not E
        return cdiv(max(budget, self.param), block_size)

    def kernel_window(self) -> tuple[int, int] | None:
        return None

    @classmethod
    def fuzz_param(cls, window, chunk, block_size, draw_int) -> int:
        return draw_int(1, 3 * block_size)


KINDS: dict[str, type[Kind]] = {
    k.name: k for k in (Full, Sliding, ChunkedLocal, Mamba, RSWA, Sink, Ring, Cross)
}


def make_kind(name: str, param: int = 0, retained: int = 0, spec_blocks: int = 0) -> Kind:
    cls = KINDS[name]
    if retained:
        if not cls.retains_tokens:
            raise ValueError(f"only sliding windows retain tokens, not {name}")
        return cls(param, retained)  # type: ignore[call-arg]
    if spec_blocks:
        if not cls.holds_state:
            raise ValueError(f"only Mamba holds speculative state blocks, not {name}")
        return cls(param, spec_blocks)  # type: ignore[call-arg]
    return cls(param)
