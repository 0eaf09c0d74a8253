"""Attention page bookkeeping: ref counts, the free queue (= eviction order) and the prefix index.

One :class:`PagePool` per paged group. It hands out page ids and never touches memory. Three structures:

- every page has a ref count: the number of owners (requests whose block table holds it, quarantines);
- the **free queue** holds the pages with no owner, in eviction order: :meth:`PagePool.allocate` pops from the
  head, :meth:`PagePool.free` appends to the tail. A request's pages are appended in *reverse* block-table order,
  so its tail blocks (the least shared, least likely to be asked for again) are evicted first;
- the **prefix index** maps a chained block hash (:func:`hash_block`) to the page holding that full block. A free
  page keeps its hash (it stays reusable) until it is handed out again: eviction is lazy. A page registered
  with its parent hash and tokens can also be found by a *prefix* of its tokens (:meth:`PagePool.match_partial`):
  the draft mirror reuses the front of a block that way.

::

    free queue:  head -> [ 5 ][ 9 ][ 3 ][ 8 ] <- tail        allocate(2) -> [5, 9]
                             cached              free([7, 8, 9]) appends 9, 8, 7 in that order
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, NewType

import numpy as np
from attrs import define, field

from kvferry.errors import ConfigError, InvalidTransition, PoolExhausted

__all__ = [
    "NULL_PAGE",
    "FreePageQueue",
    "Page",
    "PageHash",
    "PagePool",
    "PagePoolStatistics",
    "hash_block",
    "hash_blocks",
    "root_hash",
]

#: A chained block hash: blake2b-128 of the parent hash and the block's token ids.
PageHash = NewType("PageHash", bytes)

#: Page id 0 of every paged group is reserved: it pads block tables and backs attention-DP dummy requests.
NULL_PAGE = 0

_DIGEST_SIZE = 16


def root_hash(salt: bytes = b"") -> PageHash:
    """The parent hash of a sequence's first block; ``salt`` separates reuse scopes (adapters, tenants)."""
    return PageHash(hashlib.blake2b(b"kvferry-root\0" + salt, digest_size=_DIGEST_SIZE).digest())


def hash_block(parent: PageHash, token_ids: Sequence[int] | np.ndarray) -> PageHash:
    """Chained hash of one block: stable across processes (never Python's ``hash()``).

    :param parent: the previous block's hash, or :func:`root_hash` for the first block.
    :param token_ids: the block's token ids, packed as little-endian int64.
    """
    packed = b""
    if type(token_ids) is list or type(token_ids) is tuple:  # the per-block fast path, same bytes
        try:
            packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
        except struct.error:
            packed = b""
    if not packed:
        packed = np.ascontiguousarray(np.asarray(token_ids, dtype="<i8")).tobytes()
    digest = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    digest.update(packed)
    return PageHash(digest.digest())


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    tokens_per_block: int,
    *,
    parent: PageHash | None = None,
    salt: bytes = b"",
) -> list[PageHash]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block gets none)."""
    if tokens_per_block <= 0:
        raise ConfigError(f"tokens_per_block must be positive, got {tokens_per_block}")
    tokens = np.asarray(token_ids, dtype="<i8")
    previous = root_hash(salt) if parent is None else parent
    hashes: list[PageHash] = []
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        previous = hash_block(previous, tokens[start : start + tokens_per_block])
        hashes.append(previous)
    return hashes


@define(eq=False, slots=True)
class Page:
    """One page id's bookkeeping. ``prev_free``/``next_free`` belong to :class:`FreePageQueue` alone."""

    page_id: int
    ref_cnt: int = 0
    block_hash: PageHash | None = None
    #: parent hash and hashed tokens, kept only for pages registered with them (see PagePool.match_partial)
    parent: PageHash | None = field(default=None, repr=False)
    tokens: tuple[int, ...] | None = field(default=None, repr=False)
    prev_free: Page | None = field(default=None, repr=False)
    next_free: Page | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        prev_id = None if self.prev_free is None else self.prev_free.page_id
        next_id = None if self.next_free is None else self.next_free.page_id
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"Page({self.page_id}, ref={self.ref_cnt}{cached}, prev={prev_id}, next={next_id})"


class FreePageQueue:
    """Intrusive doubly linked list of pages: O(1) append, pop from the head and removal from the middle.

    Manipulating the list allocates no Python objects; the order is the eviction order (head first).
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, pages: Iterable[Page] = ()) -> None:
        self._head = Page(-1)
        self._tail = Page(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for page in pages:
            self.append(page)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Page]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def __contains__(self, page: object) -> bool:
        return isinstance(page, Page) and page.prev_free is not None

    def page_ids(self) -> list[int]:
        """Page ids in eviction order (head first)."""
        return [page.page_id for page in self]

    def append(self, page: Page) -> None:
        if page.prev_free is not None or page.next_free is not None:
            raise InvalidTransition(f"page {page.page_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = page
        page.prev_free = last
        page.next_free = self._tail
        self._tail.prev_free = page
        self._len += 1

    def remove(self, page: Page) -> None:
        prev, nxt = page.prev_free, page.next_free
        if prev is None or nxt is None:
            raise InvalidTransition(f"page {page.page_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        page.prev_free = page.next_free = None
        self._len -= 1

    def popleft(self) -> Page:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise PoolExhausted("the free page queue is empty")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[Page]:
        if n > self._len:
            raise PoolExhausted(f"cannot take {n} pages from a free queue of {self._len}")
        return [self.popleft() for _ in range(n)]


class PagePoolStatistics(NamedTuple):
    """Counts of one paged group (the reserved null page excluded)."""

    #: usable pages (all pages minus the reserved null page)
    num_pages: int
    #: pages with at least one owner
    used: int
    #: pages in the free queue (cached ones included: they are evictable)
    free: int
    #: pages in the prefix index, owned or free
    cached: int
    #: free pages that still hold a hash (reusable until handed out again)
    cached_free: int


class PagePool:
    """Page ids of one paged group: ref counts, free queue, prefix index. No memory is touched here.

    Page :data:`NULL_PAGE` is reserved and never allocated. Initially the free queue is ``1 .. num_pages-1`` in
    order. Every method checks its whole input before it changes anything: a failure changes nothing.
    """

    __slots__ = ("_children", "_free", "_index", "_pages", "name")

    def __init__(self, num_pages: int, *, name: str = "attention") -> None:
        if num_pages < 1:
            raise ConfigError(
                f"{name}: a paged group needs at least the null page, got num_pages={num_pages}"
            )
        self.name = name
        self._pages = [Page(i) for i in range(num_pages)]
        self._free = FreePageQueue(self._pages[1:])
        self._index: dict[PageHash, Page] = {}
        #: parent hash -> {page id: page} of pages registered with their parent and tokens
        self._children: dict[PageHash, dict[int, Page]] = {}

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<PagePool {self.name} [{s.used} used, {s.free} free, {s.cached} cached]>"

    # --- queries ---------------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """All page ids, the null page included."""
        return len(self._pages)

    @property
    def num_free_pages(self) -> int:
        """Pages that :meth:`allocate` can hand out now (free cached pages included)."""
        return len(self._free)

    def free_page_ids(self) -> list[int]:
        """The free queue in eviction order (head first)."""
        return self._free.page_ids()

    def ref_cnt(self, page_id: int) -> int:
        return self._page(page_id).ref_cnt

    def block_hash(self, page_id: int) -> PageHash | None:
        return self._page(page_id).block_hash

    def lookup(self, block_hash: PageHash) -> int | None:
        """The page that holds ``block_hash``, or None."""
        page = self._index.get(block_hash)
        return None if page is None else page.page_id

    def match(self, block_hashes: Sequence[PageHash]) -> list[int]:
        """Pages of the longest prefix of ``block_hashes`` present in the index (nothing is taken)."""
        matched: list[int] = []
        for block_hash in block_hashes:
            page = self._index.get(block_hash)
            if page is None:
                break
            matched.append(page.page_id)
        return matched

    def match_partial(self, parent: PageHash, prefix: Sequence[int]) -> int | None:
        """A cached page whose block follows ``parent`` and whose tokens start with ``prefix`` (nothing is taken).

        Only pages registered with ``parent=`` and ``tokens=`` are found. Among several, the one registered first.
        """
        children = self._children.get(parent)
        if not children:
            return None
        want = tuple(prefix)
        for page in children.values():
            assert page.tokens is not None
            if page.tokens[: len(want)] == want:
                return page.page_id
        return None

    def statistics(self) -> PagePoolStatistics:
        free = len(self._free)
        cached_free = sum(1 for page in self._free if page.block_hash is not None)
        usable = len(self._pages) - 1
        return PagePoolStatistics(usable, usable - free, free, len(self._index), cached_free)

    def debug_state(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[bytes, int], ...]]:
        """(ref counts, free queue order, sorted prefix index): compare before/after to prove nothing changed."""
        return (
            tuple(page.ref_cnt for page in self._pages),
            tuple(self._free.page_ids()),
            tuple(sorted((h, page.page_id) for h, page in self._index.items())),
        )

    # --- mutations ---------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages from the head of the free queue, each with ref count 1.

        A cached page handed out loses its hash here (lazy eviction).

        :raises ~kvferry.errors.PoolExhausted: if fewer than ``n`` pages are free; nothing changed.
        """
        if n < 0:
            raise ConfigError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PoolExhausted(f"{self.name}: need {n} pages, {len(self._free)} free")
        pages = self._free.popleft_n(n)
        for page in pages:
            self._evict_hash(page)
            page.ref_cnt = 1
        return [page.page_id for page in pages]

    def touch(self, page_ids: Sequence[int]) -> None:
        """Add one owner to each page (a prefix hit); a free page leaves the free queue."""
        pages = [self._page(page_id) for page_id in page_ids]
        for page in pages:
            if page.ref_cnt == 0:
                self._free.remove(page)
            page.ref_cnt += 1

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one owner from each page of a block table; pages left without owner join the free queue.

        They are appended in reverse order, so the table's tail blocks are evicted first. Pages keep their hash.

        :raises ~kvferry.errors.InvalidTransition: if a page would drop below zero owners; nothing changed.
        """
        pages = [self._page(page_id) for page_id in page_ids]
        drops: dict[int, int] = {}
        for page in pages:
            drops[page.page_id] = drops.get(page.page_id, 0) + 1
            if page.page_id == NULL_PAGE or drops[page.page_id] > page.ref_cnt:
                raise InvalidTransition(f"{self.name}: page {page.page_id} freed more often than it is owned")
        for page in reversed(pages):
            page.ref_cnt -= 1
            if page.ref_cnt == 0:
                self._free.append(page)

    def register(
        self,
        page_id: int,
        block_hash: PageHash,
        *,
        parent: PageHash | None = None,
        tokens: Sequence[int] | None = None,
    ) -> bool:
        """Put a full, committed block into the prefix index.

        With ``parent`` (the hash ``block_hash`` chains from) and ``tokens`` (what was hashed) the page can
        also be found by :meth:`match_partial`.

        Returns False (and changes nothing) when another page already holds the same hash: block tables stay
        append-only, so we do not de-duplicate; or when the page already holds a hash.
        """
        page = self._page(page_id)
        if page.ref_cnt == 0:
            raise InvalidTransition(f"{self.name}: cannot register free page {page_id}")
        if (parent is None) != (tokens is None):
            raise ConfigError(f"{self.name}: register takes parent and tokens together")
        if block_hash in self._index or page.block_hash is not None:
            return False
        page.block_hash = block_hash
        self._index[block_hash] = page
        if parent is not None and tokens is not None:
            page.parent, page.tokens = parent, tuple(tokens)
            self._children.setdefault(parent, {})[page.page_id] = page
        return True

    def clear_cache(self) -> int:
        """Drop every hash from the prefix index (owned pages keep their data but stop being reusable)."""
        count = len(self._index)
        for page in self._index.values():
            page.block_hash = page.parent = page.tokens = None
        self._index.clear()
        self._children.clear()
        return count

    def _evict_hash(self, page: Page) -> None:
        if page.block_hash is not None:
            del self._index[page.block_hash]
            page.block_hash = None
        if page.parent is not None:
            children = self._children[page.parent]
            del children[page.page_id]
            if not children:
                del self._children[page.parent]
            page.parent = page.tokens = None

    def _page(self, page_id: int) -> Page:
        if not isinstance(page_id, int) or not 0 <= page_id < len(self._pages):
            raise InvalidTransition(f"{self.name}: no page {page_id!r}")
        return self._pages[page_id]
