"""The draft mirror: reuse of the drafter's KV, clamped to the target's reuse boundary.

The draft group has its own prefix index at the drafter's ``tokens_per_block`` (``d`` below). The rules:

- Draft KV at position ``p`` depends on the token at ``p + 1`` too, so a draft block's chained hash covers its
  ``d`` tokens and the one after it. The chain is one of target tokens alone, rooted in the request's salt: a
  block matches only after the same tokens from the start of the sequence, wherever its KV came from.
- The draft match is clamped to the target's reuse boundary ``reused_tokens``: full draft blocks are shared
  read-only, like attention pages; a block that straddles the boundary is found by the prefix of its tokens
  and *copied* into a private page on the first resume (its back will be written, so never in place).
- What the match cannot cover, ``[draft_hit, reused_tokens)``, is zero-filled on the first resume and reported
  (:attr:`~kvferry.pools.lifecycle.Resumed.draft_zeroed`): the drafter never reads recycled bytes.
- A block enters the index only when its draft KV is *final*, and the token after it is committed. Final
  means that the request will never write it again and that everything before it is final too: positions
  matched from the index, positions the first resume zero-filled (the gap), and positions the engine reports
  the drafter wrote for committed tokens (:meth:`DraftMirror.commit`). Speculative positions are never final.
  The gap counts as final once the drafter committed KV from its end on: then the blocks computed after it
  are indexed, keyed by the chain of their target tokens, and the gap's own blocks with them, as the zeros
  they hold (the chain stays a prefix: a later match never has holes). A request that never drafts offers
  nothing.

So the next turn of a conversation matches past an earlier turn's gap: the gap comes back as zeros already
indexed, not as a new zero-fill, and the blocks after it are shared. Target tokens stay those of a fresh run
(greedy verification or the match rule makes them independent of the proposals). The proposals may differ
from a fresh run's: the drafter reads zeros where a fresh run has the gap's draft KV, and the blocks after the
gap were computed while attending to those zeros (in the drafter's first layer the K and V of a committed
position depend on that position's inputs alone; every later layer's depend on what the one before attended
to, zeros included).
"""

from __future__ import annotations

from kvferry.errors import InvalidTransition
from kvferry.pools.blocks import hash_block
from kvferry.pools.config import DRAFT
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import RequestRecord
from kvferry.pools.statistics import Counters

__all__ = ["DraftMirror"]


class DraftMirror:
    """The draft prefix index of one rank's pools, as requests match and fill it. Without a drafter group every
    operation leaves the record's draft fields alone."""

    def __init__(self, pools: RankPools, counters: Counters) -> None:
        self._pools = pools
        self._counters = counters

    def match(self, record: RequestRecord) -> None:
        """Match after the target's match: full draft blocks up to ``reused_tokens`` (references taken), then the
        block that straddles it by the prefix of its tokens (a reference on the cached page, copied on the first
        resume). Each block's hash covers the token after it, which the prompt always has here."""
        draft, reused = self._pools.draft, record.reused_tokens
        if draft is None or not reused or not self._pools.config.enable_draft_reuse:
            return  # without draft reuse the first resume zero-fills the whole reused prefix
        d, prompt = self._pools.config.draft_tokens_per_block, record.prompt
        full = reused // d
        parent = record.parent
        for b in range(full):
            key = hash_block(parent, prompt[b * d : (b + 1) * d + 1])
            page = draft.lookup(key)
            if page is None:
                break
            record.draft_pages.append(page)
            record.draft_hashes.append(key)
            parent = key
        record.draft_hit = len(record.draft_pages) * d
        if len(record.draft_pages) == full and reused % d:
            record.draft_source = draft.match_partial(parent, prompt[full * d : reused + 1])
            if record.draft_source is not None:
                record.draft_hit = reused
        draft.touch(
            record.draft_pages if record.draft_source is None else [*record.draft_pages, record.draft_source]
        )
        self._counters.draft_hit_tokens += record.draft_hit

    def drop_source(self, record: RequestRecord) -> None:
        """Release the reference on the straddling block's cached page, if the record still holds one."""
        if record.draft_source is not None:
            assert self._pools.draft is not None
            self._pools.draft.free([record.draft_source])
            record.draft_source = None

    def forget(self, record: RequestRecord) -> None:
        """Drop a never-resumed record's draft match: its draft page references and its straddling source."""
        if self._pools.draft is not None:
            self._pools.draft.free(record.draft_pages)
        self.drop_source(record)
        record.draft_pages, record.draft_hashes = [], []
        record.draft_hit = record.draft_valid = 0
        record.draft_zeroed = (0, 0)

    def initialise(self, record: RequestRecord) -> tuple[int, int]:
        """First resume: copy the straddling block's front into its private page and zero-fill the gap.

        The gap is remembered in the record (``draft_zeroed``): it becomes part of the final prefix once the
        drafter commits KV from its end on (:meth:`commit`).

        :return: the zero-filled token range ``[draft_hit, reused_tokens)``, or (0, 0) without a gap.
        """
        pools = self._pools
        if pools.draft is None or not record.reused_tokens:
            return (0, 0)
        d, reused, hit = pools.config.draft_tokens_per_block, record.reused_tokens, record.draft_hit
        if record.draft_source is not None:
            if pools.arena is not None:
                pools.arena.copy_pages(DRAFT, [record.draft_source], [record.draft_pages[reused // d]])
            self.drop_source(record)
        record.draft_valid = hit
        if hit >= reused:
            return (0, 0)
        # no straddling block was matched, so the gap starts at a block edge and its pages are private
        gap = record.draft_pages[hit // d : pools.draft_blocks(reused)]
        if pools.arena is not None and gap:
            pools.arena.zero_pages(DRAFT, gap)
        self._counters.draft_zeroed_tokens += reused - hit
        record.draft_zeroed = (hit, reused)
        return record.draft_zeroed

    def commit(self, record: RequestRecord, start: int, end: int) -> None:
        """Record final draft KV for the committed positions ``[start, end)`` and index the blocks it completes.

        The range extends the final prefix when it starts within it, or within or right after the zero-filled
        gap (whose zeros are final from then on); a range that starts past both extends nothing.

        :raises ~kvferry.errors.InvalidTransition: if the record's draft pages are not on the device (never
            resumed, or on the host) or the range is not within its committed tokens; nothing changed.
        """
        if not record.resumed or record.host is not None:
            where = "on the host" if record.host is not None else "never resumed"
            raise InvalidTransition(
                f"commit_draft of {record.request_id!r}: its pages are not on the device ({where})"
            )
        if not 0 <= start <= end <= len(record.tokens):
            raise InvalidTransition(
                f"commit_draft of {record.request_id!r}: [{start}, {end}) is not within its "
                f"{len(record.tokens)} committed tokens"
            )
        if self._pools.draft is None:
            return
        # the gap's zeros stay as they are for good: KV written right after them extends the final prefix
        valid = max(record.draft_valid, record.draft_zeroed[1])
        if start <= valid < end:
            record.draft_valid = end
        self.hash_blocks(record)

    def hash_blocks(self, record: RequestRecord) -> None:
        """Hash (and offer for reuse) draft blocks whose KV is final and whose following token is committed."""
        draft = self._pools.draft
        assert draft is not None
        config = self._pools.config
        d, tokens, hashes = config.draft_tokens_per_block, record.tokens, record.draft_hashes
        reusable = config.enable_reuse and config.enable_draft_reuse
        for b in range(len(hashes), min(record.draft_valid, len(tokens) - 1) // d):
            parent = hashes[-1] if hashes else record.parent
            block = tokens[b * d : (b + 1) * d + 1]
            key = hash_block(parent, block)
            hashes.append(key)
            if reusable:
                draft.register(record.draft_pages[b], key, parent=parent, tokens=block)

    def reoffer(self, record: RequestRecord) -> None:
        """Offer a restored record's hashed draft blocks for reuse again, in their new pages."""
        draft, config = self._pools.draft, self._pools.config
        if draft is None or not config.enable_reuse or not config.enable_draft_reuse:
            return
        d = config.draft_tokens_per_block
        for b, (page, key) in enumerate(zip(record.draft_pages, record.draft_hashes, strict=False)):
            parent = record.draft_hashes[b - 1] if b else record.parent
            block = record.tokens[b * d : (b + 1) * d + 1]
            draft.register(page, key, parent=parent, tokens=block)

    def __repr__(self) -> str:
        c = self._counters
        return f"<DraftMirror {c.draft_hit_tokens} tokens reused, {c.draft_zeroed_tokens} zero-filled>"
