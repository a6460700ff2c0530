"""One manager per attention kind: the block tables of one KV-cache group.

Mirrors ``vllm/v1/core/single_type_kv_cache_manager.py``. A manager keeps, per
request, the block table of its group (logical slot ``i`` holds positions
``[i*B, (i+1)*B)``; ``NULL`` = 0 for a slot whose KV is not needed) and
implements, for its kind:

* ``get_num_skipped_tokens(n)``: how many leading tokens the next position
  no longer reads when ``n`` are computed (cross-checked against
  ``model.windows.skipped`` in the tests);
* ``find_longest_cache_hit(max_len)``: the prefix-cache hit, NULL where the
  kind does not need the block.

The shared machinery (free the skipped prefix, allocate slots, admit a
request with its prefix hit, cache full prompt blocks, pop a request's
blocks) lives in the base class, as in vLLM. Managers return what changed as
``(logical, block)`` pairs; the coordinator turns them into observations.
"""

from __future__ import annotations

from model.events import Group

from .block_pool import NULL, BlockPool, partial_key

Change = tuple[int, int]  # (logical slot, physical block)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager:
    """Block tables of one group; the kind-specific parts are overridden."""

    def __init__(self, group: Group, gid: int, pool: BlockPool, block_size: int,
                 spec_tokens: int = 0) -> None:
        self.group = group
        self.gid = gid
        self.pool = pool
        self.B = block_size
        # slots held beyond the scheduled tokens (Mamba's speculative blocks)
        self.extra_tokens = 0
        # the most blocks a request is asked to have free at admission (None: all)
        self.admission_cap: int | None = None
        self.tables: dict[str, list[int]] = {}
        # leading slots already offered to the prefix cache (vLLM's num_cached_block)
        self.num_cached: dict[str, int] = {}
        # rid -> prompt length (the coordinator's dict, shared by every group)
        self.prompt_len: dict[str, int] = {}
        # hits inside a block (Config.partial_hits): the hash unit, and the
        # request's chained hashes per unit for the call at hand (the coordinator's)
        self.unit = 0
        self.fine: list[int] = []

    def tail_boundary(self, rid: str) -> int:
        """The prompt's last hash-unit boundary a later request can resume at
        (it recomputes at least the prompt's last token)."""
        return (self.prompt_len[rid] - 1) // self.unit * self.unit

    def cow(self, rid: str, slot: int) -> tuple[int, int]:
        """A hit ending inside slot ``slot``'s block: the request takes a
        private copy of it (its reference of the hit block becomes the copy's,
        the copy takes one of the new block besides the request's), cached
        again once full."""
        table = self.tables[rid]
        src = table[slot]
        dst = self.pool.get_new_blocks(1)[0]
        self.pool.ref[dst] += 1
        table[slot] = dst
        self.num_cached[rid] = min(self.num_cached.get(rid, 0), slot)
        return src, dst

    # --------------------------------------------------------- kind-specific

    def get_num_skipped_tokens(self, n: int) -> int:
        return 0

    def find_longest_cache_hit(self, max_len: int, hashes: list[int]) -> tuple[list[int], int]:
        raise NotImplementedError

    # ----------------------------------------------------------------- frees

    def remove_skipped_blocks(self, rid: str, basis: int) -> list[Change]:
        """Replace the slots wholly before ``skipped(basis)`` by NULL and free them.

        Walks backward from the last skipped slot and stops at the first NULL
        (the skipped slots of earlier calls), like vLLM's
        ``_remove_blocks_in_range``. Returns the freed ``(logical, block)``
        in the order they go back to the pool."""
        return self._remove_range(rid, 0, self.get_num_skipped_tokens(basis) // self.B)

    def _remove_range(self, rid: str, first: int, last: int) -> list[Change]:
        """Free the slots ``[first, last)`` (capped at the table), backward
        from ``last - 1`` to the first NULL (vLLM's ``_remove_blocks_in_range``)."""
        table = self.tables.get(rid)
        if not table or last <= first:
            return []
        freed: list[Change] = []
        for i in range(min(last, len(table)) - 1, first - 1, -1):
            b = table[i]
            if b == NULL:
                break
            freed.append((i, b))
            table[i] = NULL
        if freed:
            self.pool.free_blocks([b for _, b in freed])
        return freed

    def pop_blocks_for_free(self, rid: str) -> list[Change]:
        """Forget the request's table; return its non-NULL slots in table order.
        The caller returns them to the pool (tail first) now or later."""
        table = self.tables.pop(rid, None)
        self.num_cached.pop(rid, None)
        if not table:
            return []
        return [(i, b) for i, b in enumerate(table) if b != NULL]

    def truncate(self, rid: str, keep: int) -> list[Change]:
        """Cut the table to its first ``keep`` slots (a failed load); return the
        dropped non-NULL slots in table order (not yet back in the pool)."""
        table = self.tables.get(rid)
        if table is None or len(table) <= keep:
            return []
        dropped = [(i, b) for i, b in enumerate(table[keep:], keep) if b != NULL]
        del table[keep:]
        if self.num_cached.get(rid, 0) > keep:
            self.num_cached[rid] = keep
        return dropped

    # ------------------------------------------------------------ allocation

    def get_num_blocks_to_allocate(self, rid: str, num_tokens: int) -> int:
        """New blocks a running request needs to hold slots for ``num_tokens``.
        (After a rejection the table can be longer than needed: 0 then.)"""
        num_tokens += self.extra_tokens
        return max(0, cdiv(num_tokens, self.B) - len(self.tables.get(rid, ())))

    def allocate_new_blocks(self, rid: str, num_tokens: int) -> list[Change]:
        table = self.tables.setdefault(rid, [])
        n = cdiv(num_tokens + self.extra_tokens, self.B) - len(table)
        if n <= 0:
            return []
        first = len(table)
        new = self.pool.get_new_blocks(n)
        table.extend(new)
        return list(enumerate(new, first))

    def set_admission_cap(self, tokens_ahead: int, max_model_len: int) -> None:
        """Kinds that recycle blocks cap the blocks admission asks for (the
        kind's ``admission_cap``, vLLM's ``max_admission_blocks_per_request``)."""
        self.admission_cap = self.group.spec.admission_cap(self.B, max_model_len, tokens_ahead)

    def admission_cost(self, hit: list[int], computed: int, num_tokens: int,
                       capped: bool = False) -> int:
        """Blocks a first-time allocation takes from the free queue: evictable
        hit blocks (free but cached) plus new blocks. ``computed`` = local hit
        plus external tokens; the slots it skips are padded with NULL. With
        ``capped``, the blocks needed are at most the kind's admission cap."""
        pad = self.get_num_skipped_tokens(computed) // self.B
        ref = self.pool.ref
        evictable = sum(1 for b in hit[pad:] if b != NULL and ref[b] == 0)
        need = cdiv(num_tokens + self.extra_tokens, self.B)
        if capped and self.admission_cap is not None:
            need = min(need, self.admission_cap)
        return max(0, need - max(pad, len(hit))) + evictable

    def add_computed_blocks(self, rid: str, hit: list[int], computed: int) -> list[Change]:
        """First-time allocation, phase 1: NULL-pad the slots skipped at
        ``computed`` and take the prefix-hit blocks after them. Returns the hit
        slots taken (touched)."""
        pad = self.get_num_skipped_tokens(computed) // self.B
        kept = [b for b in hit[pad:] if b != NULL]
        assert len(kept) == len(hit[pad:]), "a hit's NULL slots are a prefix"
        self.pool.touch(kept)
        table = [NULL] * pad + kept
        self.tables[rid] = table
        self.num_cached[rid] = len(table)
        return list(enumerate(kept, pad))

    def new_step_starts(self) -> None:
        """A scheduler iteration begins."""

    def cache_blocks(self, rid: str, num_tokens: int, hashes: list[int]) -> None:
        """Offer the full blocks among the first ``num_tokens`` positions to the
        prefix cache (``num_tokens`` is already capped to the known tokens)."""
        n_full = num_tokens // self.B
        done = self.num_cached.get(rid, 0)
        if n_full <= done:
            return
        table = self.tables[rid]
        pool, gid = self.pool, self.gid
        for i in range(done, min(n_full, len(table))):
            b = table[i]
            if b != NULL:
                pool.cache_block(b, (gid, hashes[i]))
        self.num_cached[rid] = n_full

    def uncache_from(self, rid: str, slot: int) -> None:
        table = self.tables.get(rid, [])
        self.pool.uncache([b for b in table[slot:] if b != NULL])
        if self.num_cached.get(rid, 0) > slot:
            self.num_cached[rid] = slot

    def window_present(self, rid: str, n: int) -> bool:
        """Whether every slot position ``n`` reads below slot ``n // B`` is held
        (not NULL): ``n`` is a safe point to recompute from."""
        table = self.tables.get(rid, [])
        hi = n // self.B
        if hi > len(table):
            return False
        return all(table[i] != NULL for i in self.read_slots(rid, n))

    def read_slots(self, rid: str, n: int) -> range:
        """Slots below ``n // B`` that position ``n`` reads."""
        return range(self.get_num_skipped_tokens(n) // self.B, n // self.B)


class FullAttentionManager(SingleTypeManager):
    """full: every position reads all earlier ones; nothing is ever skipped::

        t = 9            [ 0  1  2  3  4  5  6  7  8  9 ]
                         |------------ read -----------|

    Prefix hit: the longest run of cached blocks from block 0 (chained
    hashes: a miss ends the run)."""

    def find_longest_cache_hit(self, max_len: int, hashes: list[int]) -> tuple[list[int], int]:
        out: list[int] = []
        get, gid = self.pool.get_cached_block, self.gid
        for i in range(max_len // self.B):
            b = get((gid, hashes[i]))
            if b == NULL:
                break
            out.append(b)
        u = self.unit
        if u:  # into the next block: its hash-unit boundaries, the longest first
            first = len(out) * (self.B // u)
            for idx in range(min(first + self.B // u - 1, max_len // u) - 1, first - 1, -1):
                b = get(partial_key(gid, self.fine[idx]))
                if b != NULL:
                    return [*out, b], (idx + 1) * u
        return out, len(out) * self.B

    def cache_blocks(self, rid: str, num_tokens: int, hashes: list[int]) -> None:
        """Full blocks, and with hits inside a block the block holding the
        prompt's last hash boundary, keyed there once its positions up to it
        are scheduled (vLLM's ``_cache_partial_tail_block``)."""
        super().cache_blocks(rid, num_tokens, hashes)
        if not self.unit:
            return
        T = self.tail_boundary(rid)
        table = self.tables.get(rid, ())
        if 0 < T <= num_tokens and T % self.B and len(table) > T // self.B \
                and table[T // self.B] != NULL:
            self.pool.cache_block(table[T // self.B],
                                  partial_key(self.gid, self.fine[T // self.unit - 1]))


class RSWAManager(FullAttentionManager):
    """rswa(R): position ``t`` reads the prompt ``[0, P)`` and ``[t-R+1, t]``
    (model/kinds.py draws it). As vLLM's ``RSWAManager``, frees the gap::

        slots wholly inside [cdiv(P, B) * B, max(P, n - R))   (n: the basis)

    one token short of what the window allows. Nothing before the prompt's
    end is skipped, so admission and prefix hits are full attention's."""

    def __init__(self, group: Group, gid: int, pool: BlockPool, block_size: int,
                 spec_tokens: int = 0) -> None:
        super().__init__(group, gid, pool, block_size)
        self.window = group.param

    def remove_skipped_blocks(self, rid: str, basis: int) -> list[Change]:
        P = self.prompt_len.get(rid)
        if P is None:
            return []
        return self._remove_range(rid, cdiv(P, self.B), max(P, basis - self.window) // self.B)

    def read_slots(self, rid: str, n: int) -> list[int]:
        P = self.prompt_len[rid]
        below = n // self.B
        return [i for i in self.group.spec.span_blocks(n, n + 1, self.B, P) if i < below]


class SinkFullAttentionManager(FullAttentionManager):
    """sink(S): full attention behind ``S`` static sink tokens whose KV lives in
    physical blocks ``1 .. S/B``, read by every step (model/kinds.py). The
    block pool keeps those blocks out of its free queue for good (vLLM 0.25-0.26:
    ``free_block_queue.popleft_n`` in the manager's constructor); the tables
    are full attention's."""


class SlidingWindowManager(SingleTypeManager):
    """sliding(W): position ``t`` reads ``[t-W+1, t]``.

    Example: W = 4, 7 tokens computed, next position 7::

        Tokens:   [ 0  1  2  3  4  5  6  7 ]
                  | ---- computed -----|
                                         ^ next token to be computed
                              |-----------|  sliding window for next token
                  |--skipped---|

    ``get_num_skipped_tokens(7) == 4``: slots wholly inside ``[0, 4)`` become NULL.

    Prefix hit: scan right to left for ``cdiv(W-1, B)`` contiguous cached
    blocks (the window of the first recomputed token); slots before them are
    NULL. A shorter run that reaches block 0 is a hit too."""

    def __init__(self, group: Group, gid: int, pool: BlockPool, block_size: int,
                 spec_tokens: int = 0) -> None:
        super().__init__(group, gid, pool, block_size)
        self.window = group.param

    def get_num_skipped_tokens(self, n: int) -> int:
        return max(0, n - self.window + 1)


    def find_longest_cache_hit(self, max_len: int, hashes: list[int]) -> tuple[list[int], int]:
        need = cdiv(self.window - 1, self.B)
        n = max_len // self.B
        get, gid = self.pool.get_cached_block, self.gid
        found: list[int] = []  # the current run, right to left
        for i in range(n - 1, -1, -1):
            b = get((gid, hashes[i]))
            if b == NULL:
                found = []
                continue
            found.append(b)
            if len(found) >= need:
                run = found[::-1]
                return [NULL] * i + run, (i + len(run)) * self.B
        run = found[::-1]  # contiguous from block 0 (or empty)
        return run, len(run) * self.B


class ChunkedLocalManager(SingleTypeManager):
    """chunked_local(C): position ``t`` reads ``[floor(t/C)*C, t]``.

    Example: C = 8, 13 tokens computed, next position 13::

        Tokens:  [ 0 1 2 3 4 5 6 7 | 8 9 10 11 12 13 14 15 ] ...
                 | ----- computed ---------------|
                                                  ^^ next token to be computed
                                   |----------------| window of the next token
                 |--- skipped -----|

    ``get_num_skipped_tokens(13) == 8``; at 16 computed, all 16 are skipped.

    Prefix hit: slots before the chunk of ``max_len`` are NULL (no lookup
    needed: nothing reads them), then cached blocks from the chunk start."""

    def __init__(self, group: Group, gid: int, pool: BlockPool, block_size: int,
                 spec_tokens: int = 0) -> None:
        super().__init__(group, gid, pool, block_size)
        self.chunk = group.param

    def get_num_skipped_tokens(self, n: int) -> int:
        return (n // self.chunk) * self.chunk


    def find_longest_cache_hit(self, max_len: int, hashes: list[int]) -> tuple[list[int], int]:
        start_block = ((max_len // self.chunk) * self.chunk) // self.B
        out = [NULL] * start_block
        get, gid = self.pool.get_cached_block, self.gid
        for i in range(start_block, max_len // self.B):
            b = get((gid, hashes[i]))
            if b == NULL:
                break
            out.append(b)
        return out, len(out) * self.B


class MambaManager(SingleTypeManager):
    """mamba: the recurrent state after the last computed token is all the next
    token needs; ``get_num_skipped_tokens(n) = n - 1`` as in vLLM.

    Assumption (model/windows.py): the state after position ``t`` lives in the
    slot of ``t``, so a slot is needed while it holds the state of the last
    computed token, i.e. position ``t`` reads slots of ``[t-1, t]``::

        n = 7 computed    [ 0  1  2  3  4  5  6 | 7 ]
                                            |-read-|     skipped = 6

    A full slot therefore holds the state after its last position, which is
    what a prefix hit resumes from: the hit is the right-most cached block,
    with NULL before it. Slots are allocated like attention slots
    (``cdiv(tokens, B)``), plus one speculative slot per spec token (vLLM's
    ``num_speculative_blocks``, which a model with drafts sets to the number
    of spec tokens, allocated as ``B`` more tokens each), and only the
    trailing ones stay live."""

    def __init__(self, group: Group, gid: int, pool: BlockPool, block_size: int,
                 spec_tokens: int = 0) -> None:
        super().__init__(group, gid, pool, block_size)
        self.extra_tokens = spec_tokens * block_size
        # A state cached in this scheduler iteration is written by a step that
        # has not run yet: a hit ending on it waits for a later iteration.
        self.cached_this_step: set[tuple[int, int]] = set()
        # rid -> the slot whose state (after the prompt's last hash boundary,
        # inside the block) is keyed there and must be copied out before the
        # request's next step overwrites it
        self.producer: dict[str, int] = {}

    def new_step_starts(self) -> None:
        self.cached_this_step.clear()

    def cache_blocks(self, rid: str, num_tokens: int, hashes: list[int]) -> None:
        before = self.num_cached.get(rid, 0)
        super().cache_blocks(rid, num_tokens, hashes)
        table = self.tables.get(rid, ())
        for i in range(before, min(self.num_cached.get(rid, 0), len(table))):
            if table[i] != NULL:
                self.cached_this_step.add((self.gid, hashes[i]))
        if self.unit and num_tokens == self.tail_boundary(rid) and num_tokens % self.B:
            # a chunk ended at the prompt's last hash boundary: its state is
            # reusable there until the request's next step moves it on
            slot = num_tokens // self.B
            if slot < len(table) and table[slot] != NULL and rid not in self.producer:
                k = partial_key(self.gid, self.fine[num_tokens // self.unit - 1])
                self.pool.cache_block(table[slot], k)
                if self.pool.key[table[slot]] == k:
                    self.cached_this_step.add(k)
                    self.producer[rid] = slot

    def copy_out_state(self, rid: str) -> tuple[int, int] | None:
        """Before the request's next step: the state keyed at the prompt's last
        hash boundary goes to a fresh block, which takes its cache entry (held
        by the copy until the step ran; vLLM's producer copy-on-write)."""
        slot = self.producer.pop(rid, None)
        table = self.tables.get(rid)
        if slot is None or table is None or slot >= len(table) or table[slot] == NULL:
            return None
        src = table[slot]
        dst = self.pool.get_new_blocks(1)[0]
        self.pool.ref[src] += 1
        self.pool.move_key(src, dst)
        return src, dst

    def get_num_blocks_to_allocate(self, rid: str, num_tokens: int) -> int:
        return super().get_num_blocks_to_allocate(rid, num_tokens) + (rid in self.producer)

    def pop_blocks_for_free(self, rid: str) -> list[Change]:
        self.producer.pop(rid, None)  # nothing overwrites the state any more
        return super().pop_blocks_for_free(rid)

    def admission_cost(self, hit: list[int], computed: int, num_tokens: int,
                       capped: bool = False) -> int:
        if hit and self.pool.key[hit[-1]] in self.cached_this_step:
            return self.pool.num_blocks + 1  # cannot be admitted in this iteration
        return super().admission_cost(hit, computed, num_tokens, capped)

    def get_num_skipped_tokens(self, n: int) -> int:
        return max(0, n - 1)

    def find_longest_cache_hit(self, max_len: int, hashes: list[int]) -> tuple[list[int], int]:
        get, gid = self.pool.get_cached_block, self.gid
        u, B = self.unit, self.B
        if u:  # every hash-unit boundary, the right-most state first
            for idx in range(max_len // u - 1, -1, -1):
                n = (idx + 1) * u
                b = get((gid, hashes[n // B - 1]) if n % B == 0
                        else partial_key(gid, self.fine[idx]))
                if b != NULL:
                    return [NULL] * (idx // (B // u)) + [b], n
            return [], 0
        for i in range(max_len // self.B - 1, -1, -1):
            b = get((gid, hashes[i]))
            if b != NULL:
                return [NULL] * i + [b], (i + 1) * self.B
        return [], 0


class _HeldToTheEnd(SingleTypeManager):
    """A group whose blocks hold no positions of the request's tokens and stay
    until the request ends: ``need`` blocks, claimed at the first allocation;
    nothing skipped or freed early, no prefix hit, nothing cached; a failed
    load leaves them (what they hold is not the load's positions)."""

    def need(self) -> int:
        raise NotImplementedError

    def find_longest_cache_hit(self, max_len: int, hashes: list[int]) -> tuple[list[int], int]:
        return [], 0

    def remove_skipped_blocks(self, rid: str, basis: int) -> list[Change]:
        return []

    def get_num_blocks_to_allocate(self, rid: str, num_tokens: int) -> int:
        return max(0, self.need() - len(self.tables.get(rid, ())))

    def allocate_new_blocks(self, rid: str, num_tokens: int) -> list[Change]:
        table = self.tables.setdefault(rid, [])
        n = self.need() - len(table)
        if n <= 0:
            return []
        first = len(table)
        new = self.pool.get_new_blocks(n)
        table.extend(new)
        return list(enumerate(new, first))

    def admission_cost(self, hit: list[int], computed: int, num_tokens: int,
                       capped: bool = False) -> int:
        return self.need()

    def add_computed_blocks(self, rid: str, hit: list[int], computed: int) -> list[Change]:
        self.tables[rid] = []
        self.num_cached[rid] = 0
        return []

    def cache_blocks(self, rid: str, num_tokens: int, hashes: list[int]) -> None:
        return

    def truncate(self, rid: str, keep: int) -> list[Change]:
        return []

    def window_present(self, rid: str, n: int) -> bool:
        return True

    def read_slots(self, rid: str, n: int) -> range:
        return range(0)


class CircularBufferManager(_HeldToTheEnd):
    """ring: one block per request, written at slot ``t % B`` by the kernel
    (model/kinds.py draws it), claimed at the first allocation and kept until
    the request ends, as vLLM's ``CircularBufferManager``::

        positions   [ 0  1  2  3 | 4  5  6  7 | 8  9 ]     B = 4
        table       [ ring ]                              always one slot
    """

    def need(self) -> int:
        return 1


class CrossAttentionManager(_HeldToTheEnd):
    """cross(E): the encoder's ``E`` outputs in ``cdiv(E, B)`` blocks, allocated
    when the request is first scheduled (the encoder runs with it) and kept
    until it ends, as vLLM's ``CrossAttentionManager``::

        table       [ e0..e3 | e4 e5 ]     E = 6, B = 4: every decoder step reads both
    """

    def need(self) -> int:
        return cdiv(self.group.param, self.B)


MANAGERS: dict[str, type[SingleTypeManager]] = {
    "full": FullAttentionManager,
    "sliding": SlidingWindowManager,
    "chunked_local": ChunkedLocalManager,
    "mamba": MambaManager,
    "rswa": RSWAManager,
    "sink": SinkFullAttentionManager,
    "ring": CircularBufferManager,
    "cross": CrossAttentionManager,
}


def make_manager(group: Group, gid: int, pool: BlockPool, block_size: int,
                 spec_tokens: int = 0) -> SingleTypeManager:
    return MANAGERS[group.kind](group, gid, pool, block_size, spec_tokens)
