"""The coordinator: several KV-cache groups over one block pool.

Mirrors ``vllm/v1/core/kv_cache_coordinator.py`` (the unitary and the hybrid
coordinator in one class: one group is the special case). One token count
speaks for all groups; each group cuts it into blocks of its own size
(``Config.group_block_size``), and a prefix hit ends on a multiple of the
scheduler block size (the LCM of the groups' sizes), as vLLM's hybrid
coordinator aligns hits to it.

This is also where manager changes become observations: every block handed
to a request is an :class:`AllocObs`, every reference a request drops a
:class:`FreeObs` (emitted when the block goes back to the pool, so a
request-level free deferred behind in-flight steps is observed when it
happens), and ``live[rid][g]`` counts the non-NULL slots of the request's
table in group ``g``.
"""

from __future__ import annotations

from model.events import Config
from model.observations import AllocObs, BlockTable, CopyObs, FreeObs, Item

from .block_pool import NULL, BlockPool, request_block_hashes
from .managers import Change, MambaManager, SingleTypeManager, cdiv, make_manager

Held = tuple[int, int, int]  # (group, logical slot, physical block)


class Coordinator:
    def __init__(self, config: Config, pool: BlockPool, sink: list[Item]) -> None:
        self.S = config.hit_alignment  # prefix hits end on its multiples
        # hits inside a block (Config.partial_hits): the hash unit, else 0
        self.unit = config.hash_block_size if config.partial_hits else 0
        # copies queued for the next step: (group, rid, slot or -1, src, dst)
        self.copies: list[tuple[int, str, int, int, int]] = []
        self.pool = pool
        self.sink = sink
        self.managers: list[SingleTypeManager] = [
            make_manager(g, i, pool, config.group_block_size(i), config.spec_tokens)
            for i, g in enumerate(config.groups)
        ]
        self.max_model_len = config.max_model_len
        self.live: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}  # rid -> prompt length, for every group
        # see ``tables``: per request, the tables handed out last and as flat tuples
        self._last_tables: dict[str, tuple[tuple, tuple[tuple[int, ...], ...]]] = {}
        for m in self.managers:
            m.prompt_len = self.prompt_len
            if m.group.spec.sub_block_lookup:
                m.unit = self.unit
        # Admission reserves for the settled basis: every step in flight may
        # hold a full token budget beyond the count a group frees on.
        ahead = config.depth * config.max_num_batched_tokens
        for m in self.managers:
            m.set_admission_cap(ahead, config.max_model_len)

    # ------------------------------------------------------------ observing

    def _alloc(self, rid: str, gid: int, changes: list[Change], cached: bool) -> None:
        if not changes:
            return
        sink = self.sink
        for i, b in changes:
            sink.append(AllocObs(b, gid, rid, i, cached))
        self.live[rid][gid] += len(changes)

    def release(self, rid: str, held: list[Held], reason: str) -> None:
        """Return blocks a request let go of to the pool, ``held`` in eviction order
        (already out of its tables: see :meth:`pop_for_free`, :meth:`truncate`)."""
        if not held:
            return
        sink = self.sink
        for g, i, b in held:
            sink.append(FreeObs(b, g, rid, i, reason))
        self.pool.free_blocks([b for _, _, b in held])

    def _unlink(self, rid: str, groups: list[list[Held]]) -> list[list[Held]]:
        live = self.live.get(rid)
        if live is not None:
            for g, held in enumerate(groups):
                live[g] -= len(held)
        return groups

    # ---------------------------------------------------------- per request

    def tables(self, rid: str) -> tuple[tuple[int, ...] | BlockTable, ...]:
        """The request's block tables, per group; a group's table equal to the
        one handed out last time is that same object (a long decode's steps
        share them: memory per distinct table, not per step), and a long one
        that changed is a :class:`BlockTable` sharing with the one before what
        did not change (memory per change, not per slot: a decode's table
        grows with it)."""
        last = self._last_tables.get(rid)
        out = []
        flat = []
        for gi, m in enumerate(self.managers):
            t = tuple(m.tables.get(rid, ()))
            if last is not None and last[1][gi] == t:
                out.append(last[0][gi])
                flat.append(last[1][gi])
                continue
            out.append(BlockTable.of(t, last[0][gi] if last is not None else None))
            flat.append(t)
        if last is not None and all(a is b for a, b in zip(out, last[0], strict=True)):
            return last[0]
        tables = tuple(out)
        # the tables handed out, and as flat tuples to compare with (one each)
        self._last_tables[rid] = (tables, tuple(flat))
        return tables

    def forget(self, rid: str) -> None:
        """A finished request leaves for good (its blocks are out of its tables)."""
        self.live.pop(rid, None)
        self.prompt_len.pop(rid, None)
        self._last_tables.pop(rid, None)

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()

    def remove_skipped_blocks(self, rid: str, bases: list[int]) -> None:
        """Free, per group, the slots wholly before the window of ``bases[g]``."""
        sink = self.sink
        for m, n in zip(self.managers, bases, strict=True):
            freed = m.remove_skipped_blocks(rid, n)
            if freed:
                for i, b in freed:
                    sink.append(FreeObs(b, m.gid, rid, i, "window"))
                self.live[rid][m.gid] -= len(freed)

    def get_num_blocks_to_allocate(self, rid: str, num_tokens: int) -> int:
        return sum(m.get_num_blocks_to_allocate(rid, num_tokens) for m in self.managers)

    def allocate_new_blocks(self, rid: str, num_tokens: int) -> None:
        for m in self.managers:
            if isinstance(m, MambaManager) and m.producer:
                c = m.copy_out_state(rid)
                if c is not None:
                    self._copy(rid, m.gid, -1, *c)
            self._alloc(rid, m.gid, m.allocate_new_blocks(rid, num_tokens), False)

    def _copy(self, rid: str, gid: int, slot: int, src: int, dst: int) -> None:
        self.sink.append(CopyObs(src, dst, gid, rid, slot))
        self.copies.append((gid, rid, slot, src, dst))

    def take_copies(self) -> list[tuple[int, str, int, int, int]]:
        """The copies the next step runs (before its forward, all at once)."""
        out, self.copies = self.copies, []
        return out

    def hashes(self, prompt_len: int, variant: int = 0) -> list[list[int]]:
        """Per group, the block hashes of a request with ``prompt_len`` prompt
        tokens of ``variant``, at the group's block size (each hash keys the
        whole token prefix up to the end of its block, as vLLM's view of its
        fine hashes at a coarser block size does); with hits inside a block,
        then the hashes per hash unit."""
        out = [request_block_hashes(m.B, prompt_len, self.max_model_len // m.B + 1, variant)
               for m in self.managers]
        if self.unit:
            out.append(request_block_hashes(self.unit, prompt_len,
                                            self.max_model_len // self.unit + 1, variant))
        return out

    def _fine(self, hashes: list[list[int]]) -> None:
        if self.unit:
            for m in self.managers:
                m.fine = hashes[-1]

    def cache_blocks(self, rid: str, num_tokens: int, hashes: list[list[int]]) -> None:
        self._fine(hashes)
        for m in self.managers:
            m.cache_blocks(rid, num_tokens, hashes[m.gid])

    def pop_for_free(self, rid: str) -> list[list[Held]]:
        """Forget the request's tables; per group its held slots in table order,
        to :meth:`release` now or once the steps that read them are processed."""
        return self._unlink(rid, [[(m.gid, i, b) for i, b in m.pop_blocks_for_free(rid)]
                                  for m in self.managers])

    def truncate(self, rid: str, keep: int) -> list[list[Held]]:
        """Cut the request's tables to ``keep`` slots; the dropped held slots as above."""
        return self._unlink(rid, [[(m.gid, i, b) for i, b in m.truncate(rid, keep)]
                                  for m in self.managers])

    def first_null_from(self, rid: str, slot: int) -> int | None:
        """The first slot at or after ``slot`` that is NULL in some group's
        table (None: none is)."""
        found = [i for m in self.managers
                 for i, b in enumerate(m.tables.get(rid, ())) if i >= slot and b == NULL]
        return min(found) if found else None

    def uncache_from(self, rid: str, slot: int) -> None:
        """The request's blocks from ``slot`` on hold bad contents: out of the
        prefix cache, to be cached again once recomputed."""
        for m in self.managers:
            m.uncache_from(rid, slot)

    def window_present(self, rid: str, n: int) -> bool:
        return all(m.window_present(rid, n) for m in self.managers)

    # ------------------------------------------------------ first allocation

    def find_longest_cache_hit(self, max_len: int,
                               hashes: list[list[int]]) -> tuple[list[list[int]], int]:
        """The longest prefix every group can resume from, at most ``max_len``,
        on a multiple of the scheduler block size.

        Fixed point as in vLLM's hybrid coordinator: each group accepts the
        candidate length or lowers it (to the alignment); repeat until no
        group lowers it. A group's hit blocks are those covering the length."""
        S = self.S
        self._fine(hashes)
        hit = max_len - max_len % S
        while True:
            lowest = hit
            for m in self.managers:
                got = m.find_longest_cache_hit(lowest, hashes[m.gid])[1]
                lowest = min(lowest, got - got % S)
            if lowest == hit:
                break
            hit = lowest
        out = []
        for m in self.managers:
            blocks = m.find_longest_cache_hit(hit, hashes[m.gid])[0]
            out.append(blocks[:cdiv(hit, m.B)])
        return out, hit

    def _inside(self, m: SingleTypeManager, hit: list[int], computed: int) -> bool:
        """Whether a hit of ``computed`` tokens ends inside its last block."""
        return bool(self.unit and computed % m.B and len(hit) == cdiv(computed, m.B)
                    and hit[-1] != NULL)

    def admission_cost(self, hits: list[list[int]], computed: int, num_tokens: int,
                       capped: bool = False) -> int:
        return sum(m.admission_cost(h, computed, num_tokens, capped)
                   + self._inside(m, h, computed)  # the private copy
                   for m, h in zip(self.managers, hits, strict=True))

    def admit(self, rid: str, hits: list[list[int]], computed: int, num_tokens: int) -> None:
        """First allocation of a request: every group's hit blocks are taken
        before any group allocates (vLLM's two-phase allocation, issue
        #33775: a new block must not evict another group's hit), then slots
        up to ``num_tokens`` (loaded and computed positions alike)."""
        self.live.setdefault(rid, [0] * len(self.managers))
        for m, h in zip(self.managers, hits, strict=True):
            self._alloc(rid, m.gid, m.add_computed_blocks(rid, h, computed), True)
        for m, h in zip(self.managers, hits, strict=True):
            if self._inside(m, h, computed):
                slot = len(h) - 1
                self._copy(rid, m.gid, slot, *m.cow(rid, slot))
        self.allocate_new_blocks(rid, num_tokens)
