from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvferry.errors import ConfigError, InvalidTransition, PoolExhausted
from kvferry.pools.blocks import NULL_PAGE, PagePool, hash_block, hash_blocks, root_hash


def test_hash_is_stable_chained_and_blake2b() -> None:
    parent = root_hash()
    expected = hashlib.blake2b(parent, digest_size=16)
    expected.update(np.array([1, 2, 3, 4], dtype="<i8").tobytes())
    assert hash_block(parent, [1, 2, 3, 4]) == expected.digest()
    hashes = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(hashes) == 2  # the partial block [9] has no hash
    assert hashes[1] == hash_block(hashes[0], [5, 6, 7, 8])
    # same block after a different prefix -> different hash
    assert hash_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != hashes[1]
    assert hash_blocks([1, 2, 3, 4], 4, salt=b"lora-1") != hash_blocks([1, 2, 3, 4], 4)


def test_initial_queue_and_exact_allocation_order() -> None:
    pool = PagePool(8)
    assert pool.free_page_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [4, 5]
    assert pool.free_page_ids() == [6, 7]
    assert pool.statistics() == (7, 5, 2, 0, 0)


def test_free_appends_in_reverse_block_table_order() -> None:
    pool = PagePool(8)
    a = pool.allocate(3)  # [1, 2, 3]
    b = pool.allocate(2)  # [4, 5]
    pool.free(a)
    assert pool.free_page_ids() == [6, 7, 3, 2, 1]
    pool.free(b)
    assert pool.free_page_ids() == [6, 7, 3, 2, 1, 5, 4]
    # eviction order: the oldest free first, and a request's tail block before its head
    assert pool.allocate(4) == [6, 7, 3, 2]


def test_prefix_index_lazy_eviction_and_touch() -> None:
    pool = PagePool(6)
    pages = pool.allocate(3)  # [1, 2, 3]
    hashes = hash_blocks(list(range(12)), 4)
    for page, block_hash in zip(pages, hashes, strict=True):
        assert pool.register(page, block_hash)
    pool.free(pages)
    assert pool.free_page_ids() == [4, 5, 3, 2, 1]
    assert pool.statistics().cached_free == 3
    # a free cached page is still reusable
    assert pool.match(hashes) == [1, 2, 3]
    pool.touch([1, 2])
    assert pool.free_page_ids() == [4, 5, 3]
    assert (pool.ref_cnt(1), pool.ref_cnt(2), pool.ref_cnt(3)) == (1, 1, 0)
    # handing out page 3 evicts its hash; the prefix now stops after two blocks
    assert pool.allocate(3) == [4, 5, 3]
    assert pool.block_hash(3) is None
    assert pool.match(hashes) == [1, 2]
    assert pool.lookup(hashes[2]) is None


def test_shared_page_freed_only_by_last_owner() -> None:
    pool = PagePool(4)
    [page] = pool.allocate(1)
    pool.touch([page])
    pool.free([page])
    assert pool.ref_cnt(page) == 1
    assert page not in pool.free_page_ids()
    pool.free([page])
    assert pool.free_page_ids() == [2, 3, 1]


def test_register_does_not_deduplicate() -> None:
    pool = PagePool(4)
    a, b = pool.allocate(2)
    [h] = hash_blocks([7, 7, 7, 7], 4)
    assert pool.register(a, h)
    assert not pool.register(b, h)
    assert pool.lookup(h) == a
    assert pool.block_hash(b) is None


def test_failures_change_nothing() -> None:
    pool = PagePool(5)
    pages = pool.allocate(2)
    before = pool.debug_state()
    with pytest.raises(PoolExhausted):
        pool.allocate(3)
    with pytest.raises(InvalidTransition):
        pool.free([pages[0], pages[0]])  # owned once, freed twice
    with pytest.raises(InvalidTransition):
        pool.free([pages[1], 99])
    with pytest.raises(InvalidTransition):
        pool.free([NULL_PAGE])
    assert pool.debug_state() == before


def test_clear_cache() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2)
    for page, h in zip(pages, hash_blocks(list(range(8)), 4), strict=True):
        pool.register(page, h)
    pool.free(pages)
    assert pool.clear_cache() == 2
    assert pool.statistics() == (3, 0, 3, 0, 0)


def test_match_partial_finds_a_cached_block_by_a_prefix_of_its_tokens_until_it_is_evicted() -> None:
    pool = PagePool(4, name="draft")
    parent = root_hash()
    [a, b] = pool.allocate(2)
    assert pool.register(a, hash_block(parent, [1, 2, 3]), parent=parent, tokens=[1, 2, 3])
    assert pool.register(b, hash_block(parent, [1, 5, 6]), parent=parent, tokens=[1, 5, 6])
    assert pool.match_partial(parent, [1]) == a  # the first registered
    assert pool.match_partial(parent, [1, 5]) == b
    assert pool.match_partial(parent, [2]) is None
    assert pool.match_partial(hash_block(parent, [0]), [1]) is None
    pool.free([a, b])  # free pages stay findable until handed out again
    assert pool.match_partial(parent, [1, 2]) == a
    assert pool.allocate(2) == [3, b]  # b (freed before a: tail blocks first) is handed out and evicted
    assert pool.match_partial(parent, [1, 5]) is None and pool.match_partial(parent, [1]) == a
    pool.allocate(1)
    assert pool.match_partial(parent, [1]) is None
    with pytest.raises(ConfigError):
        pool.register(a, hash_block(parent, [9]), parent=parent)  # parent without tokens
