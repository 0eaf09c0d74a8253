"""Which bytes of a context (sender) rank go where on a generation (receiver) rank, for one request.

Peers exchange page tables (:class:`~kvferry.pools.pagetable.PageTable`) at the handshake. From a sender's and a
receiver's table, :class:`RankMap` precomputes *pieces*: one per (layer, role, kv head) of a PAGED group and one
per (role, layer, conv section or SSM head run) of a STATE group, each with its address in slot (page) 0 and
the slot stride on both sides. A request then gives, per side, the page ids of every PAGED group (from token
0) and the state slot (:class:`RequestCache`), and a :class:`TokenRange`; :meth:`RankMap.plan` turns pieces into
*units* with numpy broadcasting and merges the units that are contiguous on both sides into fragments
(``(n, 2)`` uint64 ``(address, length)`` arrays, see :mod:`kvferry.transports.base`).

What does not depend on page ids is computed once per pair (pieces of one page or slot that stay contiguous on
both sides whatever the ids, merged into runs) and once per token range (the layout of every run, kept for a
few ranges), so a request costs a few numpy operations per group.

The modules, in the order they build on each other:

- :mod:`.ranks`: the tensor-parallel shard maths (which ranks overlap, which replica writes a duplicated head);
- :mod:`.request`: what a request gives (:class:`RequestCache`, :class:`TokenRange`) and the checks of its ids;
- :mod:`.plans`: what a plan is made of (:class:`BouncePolicy`, :class:`TransferPlan`, :class:`StagingPlan`,
  :class:`MappingStatistics`);
- :mod:`.pieces`: the pieces of a pair of layer groups (paged KV per head, state slots per section and head run);
- :mod:`.layout`: the units of a token range in canonical order, and their addresses per request;
- :mod:`.rank_map`: :class:`RankMap`, one (sender rank, receiver rank) pair;
- :mod:`.peer_map`: :class:`PeerMap`, every rank pair of two engines;
- :mod:`.compat`: why two engines' caches cannot be resharded (one line for a
  :class:`~kvferry.errors.PeerIncompatible`), and the check that a table's shards are its TP size's split.

Rules, all decided from the two tables alone:

- Ranks: rank ``r`` of a TP group of size ``T`` holds the share ``[r/T, (r+1)/T)`` of the model; a sender rank
  and a receiver rank *overlap* when their shares intersect (:func:`overlapping_ranks`). A receiver expects a
  result from every overlapping sender rank, including ranks that hold nothing it needs (an empty write).
- Heads: the bytes of a head (kv head, SSM head, conv channel) that several ranks hold (duplicated when the TP
  size exceeds the head count) are written by exactly one sender rank per receiver rank (:func:`elected`). An
  MLA latent is one head every rank holds: each receiver rank gets it whole from one sender rank.
- Groups: layer groups pair by their global layer ids; paired groups must agree on kind, roles, dtypes and
  whole-model shapes (else :class:`~kvferry.errors.PeerIncompatible`, saying what differs, :mod:`.compat`); the page size (``tokens_per_block``) may
  differ: pages are mapped by token ranges. Draft groups (ids from ``DRAFT_LAYER_SHIFT``) that only one side has
  are skipped (the receiver's drafter then starts cold); a target layer only one side has is PeerIncompatible.
- Tokens: target PAGED groups move ``[start, end)``, draft groups ``[draft_start, end)`` (default 0: the whole
  prompt, never trimmed by the receiver's prefix reuse), STATE groups the whole slot when ``state`` is set.
- Order: units come in a canonical order that depends on the two tables, the receiver's ids and the token range
  only (never on the sender's page ids), so the receiver computes the staging layout of a bounced transfer
  itself (:meth:`RankMap.scatter_plan`).

Nothing here touches memory except :meth:`StagingPlan.gather` / :meth:`StagingPlan.scatter`.
"""

from kvferry.disagg.mapping.peer_map import PeerMap
from kvferry.disagg.mapping.plans import (
    BouncePolicy,
    MappingStatistics,
    StagingPlan,
    StagingSegment,
    TransferPlan,
)
from kvferry.disagg.mapping.rank_map import RankMap
from kvferry.disagg.mapping.ranks import elected, overlapping_ranks
from kvferry.disagg.mapping.request import RequestCache, TokenRange

__all__ = [
    "BouncePolicy",
    "MappingStatistics",
    "PeerMap",
    "RankMap",
    "RequestCache",
    "StagingPlan",
    "StagingSegment",
    "TokenRange",
    "TransferPlan",
    "elected",
    "overlapping_ranks",
]
