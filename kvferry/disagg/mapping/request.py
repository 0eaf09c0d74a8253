"""What one request gives the mapping: each side's page ids and state slot, and the token range to move.

``RequestCache.blocks[group]`` are the page ids of a PAGED group from token 0 (the engine's block table) and
``RequestCache.slot`` the state slot of every STATE group. Ids are validated once per cache and use (a
request's rank pairs all read the same ids), and ids a receive request brought off the wire, already checked
whole by its decoding, are trusted (:meth:`RequestCache.trust`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
from attrs import frozen

from kvferry.disagg.mapping.arrays import EMPTY, Int64Array
from kvferry.errors import ConfigError
from kvferry.wire import PackedInts

__all__ = ["RequestCache", "TokenRange", "non_negative"]


def _ids_array(value: Any) -> Int64Array:
    if type(value) is PackedInts and sys.byteorder == "little":  # ids off the wire: a view of their bytes
        return np.frombuffer(value.packed, dtype=np.int64)
    if type(value) in (list, tuple) and value and set(map(type, value)) == {int}:  # a block table's ints
        try:
            out = np.fromiter(value, dtype=np.int64, count=len(value))
        except OverflowError as exc:
            raise ConfigError(f"page ids must be integers: {exc}") from None
        out.flags.writeable = False
        return out
    try:
        array = np.asarray(value)
        if array.size == 0:
            return EMPTY
        if not np.issubdtype(array.dtype, np.integer):
            raise ConfigError(f"page ids must be integers, got {array.dtype}")
        out = np.ascontiguousarray(array.reshape(-1), dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"page ids must be integers: {exc}") from None
    out.flags.writeable = False
    return out


def _blocks(value: Mapping[str, Any]) -> Mapping[str, Int64Array]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"blocks must map group names to page ids, got {type(value).__name__}")
    return {str(name): _ids_array(ids) for name, ids in value.items()}


def _optional_slot(_instance: object, _attribute: object, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError(f"slot must be a non-negative int or None, got {value!r}")


def non_negative(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    """attrs validator: ``value`` is a non-negative int (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{attribute.name} must be a non-negative int, got {value!r}")


@frozen(eq=False)
class RequestCache:
    """One side's cache of one request.

    ``blocks[group]`` are the page ids of a PAGED group from token 0: page ``blocks[group][i]`` holds tokens
    ``[i * tokens_per_block, (i + 1) * tokens_per_block)`` (the engine's block table). Only pages of the
    transferred token range are read, so earlier entries may be anything (e.g. a reused prefix). ``slot`` is the
    state slot of every STATE group (one id, as the cache manager hands out), None when there is none.
    """

    blocks: Mapping[str, Int64Array] = attrs.field(converter=_blocks)
    slot: int | None = attrs.field(default=None, validator=_optional_slot)
    #: page ids already validated for a (group, page size, pool size, token range, uniqueness): every rank pair
    #: of a request reads the same ids
    _checked: dict[tuple[str, int, int, int, int, bool], Int64Array] = attrs.field(
        factory=dict, init=False, repr=False
    )
    #: groups whose whole id list is known unique, positive and below a bound: group -> bound (the ids of a
    #: receive request off the wire, which its decoding and :func:`~kvferry.disagg.transfer.check_request`
    #: checked)
    _trusted: dict[str, int] = attrs.field(factory=dict, init=False, repr=False)
    #: what a rank map worked out from this side's ids (unit addresses, id vectors), per what it is made of:
    #: worked out once per request, on the sender ahead of its receive request
    #: (:meth:`~kvferry.disagg.mapping.PeerMap.prepare_source`)
    _source: dict[tuple[Any, ...], Int64Array] = attrs.field(factory=dict, init=False, repr=False)

    def trust(self, group: str, bound: int) -> None:
        """Every id of ``group`` is known unique, non-negative and below ``bound``: later checks against a pool
        of at least ``bound`` pages skip the scan."""
        self._trusted[group] = bound

    def kept(self, key: tuple[Any, ...], compute: Callable[[], Int64Array]) -> Int64Array:
        """The array kept under ``key``, computed (and made read-only) on first use."""
        array = self._source.get(key)
        if array is None:
            array = self._source[key] = compute()
            array.flags.writeable = False
        return array

    def pages(
        self, group: str, tokens_per_block: int, num_slots: int, lo: int, hi: int, *, unique: bool
    ) -> Int64Array:
        """The page ids of ``group`` holding tokens ``[lo, hi)`` (validated once per cache and arguments), indexed
        by ``token // tokens_per_block``.

        :raises ~kvferry.errors.ConfigError: a missing group, ids that do not cover ``hi`` tokens or lie outside
            ``[0, num_slots)``, or (``unique``: a receiver's ids) repeated ids.
        """
        key = (group, tokens_per_block, num_slots, lo, hi, unique)
        checked = self._checked.get(key)
        if checked is not None:
            return checked
        try:
            blocks = self.blocks[group]
        except KeyError:
            raise ConfigError(f"no page ids for group {group!r}; have {sorted(self.blocks)}") from None
        first, last = lo // tokens_per_block, (hi - 1) // tokens_per_block
        if len(blocks) <= last:
            raise ConfigError(f"group {group!r}: {len(blocks)} page ids do not cover {hi} tokens")
        bound = self._trusted.get(group)
        if bound is not None and bound <= num_slots:
            self._checked[key] = (
                blocks  # every id unique, positive and below the pool's size: so are those used
            )
            return blocks
        used = blocks[first : last + 1]
        if int(used.min()) < 0 or int(used.max()) >= num_slots:
            raise ConfigError(f"group {group!r}: page ids must lie in [0, {num_slots})")
        if unique:  # ids lie in [0, num_slots): one mark per pool page, no sort
            seen = np.zeros(num_slots, dtype=np.bool_)
            seen[used] = True
            if int(np.count_nonzero(seen)) != len(used):
                raise ConfigError(f"group {group!r}: destination page ids repeat")
        self._checked[key] = blocks
        return blocks

    def state_slot(self, group: str, num_slots: int) -> int:
        """The slot of STATE group ``group``.

        :raises ~kvferry.errors.ConfigError: no slot, or one outside ``[0, num_slots)``.
        """
        if self.slot is None:
            raise ConfigError(f"group {group!r} needs a state slot")
        if self.slot >= num_slots:
            raise ConfigError(f"group {group!r}: slot {self.slot} outside [0, {num_slots})")
        return self.slot


@frozen
class TokenRange:
    """What one transfer moves: target pages' tokens ``[start, end)``, draft pages' ``[draft_start, end)``, and
    the state slots when ``state`` (the state after ``end`` tokens: set it on a request's last chunk)."""

    start: int = attrs.field(validator=non_negative)
    end: int = attrs.field(validator=non_negative)
    draft_start: int = attrs.field(default=0, validator=non_negative)
    state: bool = True

    def __attrs_post_init__(self) -> None:
        if self.start > self.end or self.draft_start > self.end:
            raise ConfigError(f"bad token range [{self.start}, {self.end}) (draft from {self.draft_start})")

    @property
    def key(self) -> tuple[int, int, int, bool]:
        """The range as a plain tuple (what per-range caches are keyed by)."""
        return (self.start, self.end, self.draft_start, self.state)
