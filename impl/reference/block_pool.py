"""The block pool: physical blocks, refcounts, the free queue, the prefix cache.

Mirrors ``vllm/v1/core/block_pool.py`` (``BlockPool``) and the free queue of
``kv_cache_utils.py`` (``FreeKVCacheBlockQueue``), with plain ints for blocks.

Block 0 is the NULL block: it stands in a block table for a slot whose KV is
not needed (skipped by a window, or never loaded). It has no refcount and is
never in the free queue.

The free queue, in eviction order (popped from the left)::

    head                                                         tail
    [ unhashed blocks (LIFO reuse) ... | hashed blocks (LRU) ... ]
      ^ prepend_n: freed blocks that       ^ append_n: freed blocks that
        never match a prefix-cache lookup    may still be hit; evicted last

vLLM keeps one doubly linked list; blocks without a hash are prepended and
blocks with a hash appended, so the list is always "unhashed, then hashed"
and two containers give the same order: a deque for the head part and an
insertion-ordered dict (O(1) removal on a cache hit) for the tail part.

Prefix caching: a full block is keyed by ``(group, hash of the request's
tokens up to and including that block)``. Every request's prompt is the same
token stream (:func:`model.tokens.prompt_token`) and every generated token is
:data:`model.tokens.OUTPUT_TOKEN` (what the vLLM target samples), so two requests share
their prompts' common block-aligned prefix, and a block holding generated
tokens is hit by a request with the same prompt length and outputs (a
preempted request resuming, above all).
"""

from __future__ import annotations

from collections import deque

from model.tokens import OUTPUT_TOKEN, prompt_token

NULL = 0


_HASH_CHAINS: dict[tuple[int, int], list[int]] = {}
_REQUEST_CHAINS: dict[tuple[int, int, int], list[int]] = {}


def block_hashes(block_size: int, num_blocks: int, variant: int = 0) -> list[int]:
    """Chained hashes of the first ``num_blocks`` full blocks of a prompt variant.

    ``hash[i]`` covers positions ``[0, (i+1)*B)``, like vLLM's ``hash_block_tokens``
    (parent hash + this block's tokens). Shared by every request (memoized)."""
    chain = _HASH_CHAINS.setdefault((block_size, variant), [])
    parent = chain[-1] if chain else 0
    for i in range(len(chain), num_blocks):
        tokens = tuple(prompt_token(t, variant)
                       for t in range(i * block_size, (i + 1) * block_size))
        parent = hash((parent, tokens))
        chain.append(parent)
    return chain


def request_block_hashes(block_size: int, prompt_len: int, num_blocks: int,
                         variant: int = 0) -> list[int]:
    """Chained hashes of the first ``num_blocks`` full blocks of a request with
    ``prompt_len`` prompt tokens of ``variant`` followed by generated ones
    (memoized)."""
    full = prompt_len // block_size
    key = (block_size, prompt_len, variant)
    chain = _REQUEST_CHAINS.get(key)
    if chain is None:
        chain = _REQUEST_CHAINS[key] = list(block_hashes(block_size, full, variant)[:full])
    parent = chain[-1] if chain else 0
    for i in range(len(chain), num_blocks):
        tokens = tuple(prompt_token(t, variant) if t < prompt_len else OUTPUT_TOKEN
                       for t in range(i * block_size, (i + 1) * block_size))
        parent = hash((parent, tokens))
        chain.append(parent)
    return chain


def partial_key(gid: int, fine_hash: int) -> tuple[int, tuple[str, int]]:
    """The cache key of a block at a hash-unit boundary inside it: the chained
    hash of the prefix up to that unit (vLLM's ``cache_partial_block``)."""
    return (gid, ("unit", fine_hash))


def is_partial(k: tuple) -> bool:
    return isinstance(k[1], tuple)


class BlockPool:
    """Physical blocks ``0 .. num_blocks-1`` (0 is NULL), refcounts, free queue.

    ``ref[b]``: how many block-table slots (over all requests and groups) hold
    ``b``, plus request-level frees deferred behind in-flight steps.
    A block is *free* iff it is in the free queue iff ``ref[b] == 0``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 reserved: list[int] | tuple[int, ...] = ()) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        # blocks a kind keeps for itself (the static sink's): never free, never handed out
        self.reserved = tuple(reserved)
        # block -> its prefix-cache key (group, hash), or None
        self.key: list[tuple[int, int] | None] = [None] * num_blocks
        # key -> blocks cached under it (vLLM does not de-duplicate: two requests
        # that computed the same block both cache it), first one is returned
        self.cached: dict[tuple[int, int], dict[int, None]] = {}
        self._head: deque[int] = deque(b for b in range(1, num_blocks)
                                       if b not in self.reserved)  # unhashed, LIFO
        self._lru: dict[int, None] = {}  # hashed, least recently used first

    @property
    def num_free(self) -> int:
        return len(self._head) + len(self._lru)

    # ------------------------------------------------------------ allocation

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue (evicting cached ones)."""
        if n > self.num_free:
            raise ValueError(f"cannot get {n} free blocks from the pool ({self.num_free} free)")
        out = []
        head, lru, ref = self._head, self._lru, self.ref
        for _ in range(n):
            if head:
                b = head.popleft()
            else:
                b = next(iter(lru))
                del lru[b]
                self._evict(b)
            ref[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """A prefix-cache hit: take a reference (and out of the free queue if free)."""
        ref = self.ref
        for b in blocks:
            if b == NULL:
                continue
            if ref[b] == 0:
                del self._lru[b]  # a hit block has a hash, so it sits in the LRU part
            ref[b] += 1

    def free_blocks(self, ordered: list[int]) -> None:
        """Drop one reference of each block; ``ordered`` is in eviction priority
        (first = evicted first). Blocks reaching 0 go back to the free queue."""
        first, last = [], []
        ref, key = self.ref, self.key
        for b in ordered:
            if b == NULL:
                continue
            ref[b] -= 1
            if ref[b] < 0:
                raise AssertionError(f"block {b} freed more often than taken")
            if ref[b] == 0:
                if key[b] is None or not self.enable_caching:
                    first.append(b)
                else:
                    last.append(b)
        if first:
            self._head.extendleft(reversed(first))
        for b in last:
            self._lru[b] = None

    # ---------------------------------------------------------- prefix cache

    def get_cached_block(self, k: tuple[int, int]) -> int:
        blocks = self.cached.get(k)
        return next(iter(blocks)) if blocks else NULL

    def cache_block(self, b: int, k: tuple[int, int]) -> None:
        """Key ``b`` by ``k``; a block keyed at a hash unit inside it (a
        partial entry, :func:`partial_key`) is keyed again once full."""
        old = self.key[b]
        if old is not None:
            if old == k or not is_partial(old) or is_partial(k):
                return
            self._evict(b)
        self.key[b] = k
        self.cached.setdefault(k, {})[b] = None

    def move_key(self, src: int, dst: int) -> None:
        """``dst`` (a private copy of ``src``) takes ``src``'s cache entry."""
        k = self.key[src]
        if k is None:
            return
        self._evict(src)
        self.cache_block(dst, k)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``BlockPool.reset_prefix_cache``: with every block free (the
        kind-reserved ones count as used), forget every key; the free queue
        keeps its order. False (nothing changed) otherwise."""
        if self.reserved or self.num_free != self.num_blocks - 1:
            return False
        for b in self._lru:
            self.key[b] = None
        self._head.extend(self._lru)
        self._lru.clear()
        self.cached.clear()
        return True

    def uncache(self, blocks: list[int]) -> None:
        """Forget the prefix-cache keys of ``blocks`` (their contents are bad)."""
        for b in blocks:
            self._evict(b)

    def _evict(self, b: int) -> None:
        k = self.key[b]
        if k is None:
            return
        self.key[b] = None
        blocks = self.cached[k]
        del blocks[b]
        if not blocks:
            del self.cached[k]
