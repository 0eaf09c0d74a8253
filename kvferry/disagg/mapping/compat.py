"""Why two engines' caches cannot be resharded into each other, in one line, from their page tables alone.

The compatibility hash (:func:`~kvferry.pools.pagetable.compat_hash`) says *that* two models differ; a peer that
fails it gets a hash in the message, which says nothing of the cause. :func:`explain` compares what the page
tables carry of the model (layer ids and kinds, GQA or MLA attention, head counts, head and latent widths, state
shapes, dtypes, TP size) and names the first difference, with the TP size that cannot split the other side's
heads where that is the cause. :func:`check_shards` refuses a table whose head shards are not the split its own
TP size gives (a peer built from another spec, or a corrupt one): resharding trusts those shards to elect one
writer per byte.

:func:`check_peer` is what the handshake and the mapping call: the explanation first, then
:func:`~kvferry.pools.pagetable.check_compatible` (wire version and hash), then both tables' shards.
"""

from __future__ import annotations

from kvferry.errors import PeerIncompatible
from kvferry.pools.layout import LATENT_ROLES, GroupKind, LayerGroup
from kvferry.pools.pagetable import PageTable, check_compatible
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, HeadShard, LayerKind, split_heads

__all__ = ["check_peer", "check_shards", "explain"]


def _kind(group: LayerGroup) -> str:
    """What a group's layers are, as a message names them."""
    if group.kind is GroupKind.PAGED:
        return "MLA attention (latent pages)" if group.roles == LATENT_ROLES else "GQA attention (K/V pages)"
    return {LayerKind.MAMBA2: "Mamba2", LayerKind.KDA: "KDA"}.get(group.layer_kind, str(group.layer_kind))


def _short(group: LayerGroup) -> str:
    return _kind(group).split(" ")[0]


def _shape(group: LayerGroup) -> dict[str, object]:
    """The whole-model shape of a group (what no TP size changes), by the name a message gives it."""
    dtypes = "/".join(group.dtypes)  # per role: K/V, latent, conv/SSM
    if group.kind is GroupKind.PAGED:
        if group.roles == LATENT_ROLES:
            return {"latent width": group.head_dim, "dtype": dtypes}
        return {"kv heads": group.heads.total, "head dim": group.head_dim, "dtypes": dtypes}
    return {
        "heads": group.heads.total,
        "head dim": group.head_dim,
        "state size": group.state_size,
        "conv kernel": group.conv_kernel,
        "conv channels": "|".join(str(s.total) for s in group.conv_sections),
        "dtypes": dtypes,
    }


def _splits(heads: int, tp: int, *, duplicable: bool) -> bool:
    """Whether ``tp`` ranks can hold ``heads`` heads (split evenly, or duplicated where the kind allows it)."""
    if heads >= tp:
        return heads % tp == 0
    return duplicable and tp % heads == 0


def _duplicable(group: LayerGroup) -> bool:
    # recurrent heads are never duplicated (the spec refuses it); kv heads and the latent may be
    return group.kind is GroupKind.PAGED


def _by_layer(table: PageTable) -> dict[int, LayerGroup]:
    return {layer: g for g in table.layer_groups for layer in g.layer_ids if layer < DRAFT_LAYER_SHIFT}


def explain(
    local: PageTable, remote: PageTable, *, here: str = "here", there: str = "on the peer"
) -> str | None:
    """The first difference between the models of two page tables that forbids resharding, in one line, or
    None when the tables show none. ``here`` / ``there`` name the two sides in the message. Draft groups are
    not compared here: a drafter only one side has is skipped, two drafters are compared by the mapping."""
    ours, theirs = _by_layer(local), _by_layer(remote)
    for layer in sorted(set(ours) | set(theirs)):
        a, b = ours.get(layer), theirs.get(layer)
        if a is None or b is None:
            mine = "no cache" if a is None else _kind(a)
            yours = "no cache" if b is None else _kind(b)
            return f"layer {layer} has {mine} {here}, {yours} {there}"
        if _kind(a) != _kind(b):
            return f"layer {layer} is {_kind(a)} {here}, {_kind(b)} {there}"
        mine_shape, yours_shape = _shape(a), _shape(b)
        for field, value in mine_shape.items():
            other = yours_shape[field]
            if other == value:
                continue
            message = f"{_short(a)} {field}: {value} {here}, {other} {there} (layer {layer})"
            if field in ("heads", "kv heads"):
                for heads, tp, side in (
                    (b.heads.total, local.tp_size, here),
                    (a.heads.total, remote.tp_size, there),
                ):
                    if not _splits(heads, tp, duplicable=_duplicable(a)):
                        message += f"; tp {tp} {side} cannot split {heads} {_short(a)} heads"
                        break
            return message
    if local.num_layers != remote.num_layers:  # the same cached layers, other layers (MLP) around them
        return f"the model has {local.num_layers} layers {here}, {remote.num_layers} {there}"
    return None


def _in_channels(heads: HeadShard, width: int) -> HeadShard:
    return HeadShard(heads.total * width, heads.count * width, heads.first * width, heads.replicas)


def _unsplittable(group: LayerGroup, tp: int) -> str | None:
    """Why no rank of ``tp`` can hold a share of ``group``'s heads, or None."""
    total = group.heads.total
    if group.kind is GroupKind.STATE and total < tp:
        return f"tp {tp} cannot split {total} {_short(group)} heads (recurrent heads are not duplicated)"
    if group.roles == LATENT_ROLES and total != 1:
        return f"a latent is one head on every rank, not {total}"
    if not _splits(total, tp, duplicable=_duplicable(group)):
        return f"tp {tp} cannot split {total} {_short(group)} heads"
    return None


def _check_group(group: LayerGroup, tp: int, rank: int) -> str | None:
    """Why rank ``rank`` of ``tp`` cannot hold ``group``'s shards as they are, or None (its heads split)."""
    total = group.heads.total
    heads = split_heads(total, tp, rank)
    if group.heads != heads:
        return f"holds heads {_span(group.heads)}, tp {tp} gives {_span(heads)}"
    for i, section in enumerate(group.conv_sections):
        # a rank holds 1/units of a section's units (heads, or Mamba2's groups), each unit held by `replicas`
        # ranks: units * replicas == tp, and replica groups take the units in order
        units = section.total // section.count
        if section.total % section.count or units * section.replicas != tp:
            return f"conv section {i} {_span(section)} is no split over tp {tp}"
        if section.first != rank // section.replicas * section.count:
            return f"conv section {i} {_span(section)} is not rank {rank}'s share"
    # the sections that follow the heads: KDA's q, k, v and Mamba2's x
    aligned = {LayerKind.KDA: 3, LayerKind.MAMBA2: 1}.get(group.layer_kind, 0)
    for i, section in enumerate(group.conv_sections[:aligned]):
        if section != _in_channels(heads, section.total // total):
            return f"conv section {i} {_span(section)} does not follow heads {_span(heads)}"
    return None


def check_shards(table: PageTable, side: str = "on the peer") -> None:
    """Refuse a table whose head shards (heads, conv sections) are not the split of its model over its own TP
    size.

    :raises ~kvferry.errors.PeerIncompatible: naming the side, the rank, the group and what is wrong.
    """
    tp, rank = table.tp_size, table.rank
    groups = table.layer_groups
    # first whether the TP size splits each group at all (the cause, when it does not), then each shard
    found = next(((g, why) for g in groups if (why := _unsplittable(g, tp)) is not None), None)
    if found is None:
        found = next(((g, why) for g in groups if (why := _check_group(g, tp, rank)) is not None), None)
    if found is not None:
        group, reason = found
        raise PeerIncompatible(f"cannot reshard: rank {rank} of tp {tp} {side}, group {group.name}: {reason}")


def _span(shard: HeadShard) -> str:
    replicas = f" x{shard.replicas}" if shard.replicas > 1 else ""
    return f"[{shard.first}, {shard.first + shard.count}) of {shard.total}{replicas}"


def check_peer(
    local: PageTable, remote: PageTable, *, here: str = "here", there: str = "on the peer"
) -> None:
    """Refuse a peer whose cache cannot be resharded into ours (or ours into it): :func:`explain`'s reason
    first, then another wire version or model hash (:func:`~kvferry.pools.pagetable.check_compatible`), then
    head shards either table's TP size does not give (:func:`check_shards`). ``here`` / ``there`` name the
    sides in the message.

    :raises ~kvferry.errors.PeerIncompatible: with a one-line reason.
    """
    if local.wire_version == remote.wire_version:
        reason = explain(local, remote, here=here, there=there)
        if reason is not None:
            raise PeerIncompatible(f"cannot reshard: {reason}")
    check_compatible(local, remote)
    check_shards(local, here)
    check_shards(remote, there)
