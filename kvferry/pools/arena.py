"""The bytes of one rank's cache: one ``torch.uint8`` arena per pool, typed views into them, block copies.

:class:`CacheArena` allocates what a :class:`~kvferry.pools.layout.CacheLayout` describes on one device and
hands kernels typed, strided views that alias the arenas (no copies): writing through a view writes the bytes
at ``addr(slot, layer, entry)`` of the layout's formula. Page and slot copies, zero-fill, garbage fill (for
poisoned-memory tests) and host offload go through :mod:`kvferry.kernels.copy`; ids are validated before any
byte is written, so a bad id raises :class:`~kvferry.errors.ConfigError` and changes nothing.

Arenas are zero-filled at allocation. Nothing here tracks ownership: that is the manager's job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from attrs import define

from kvferry.errors import ConfigError
from kvferry.kernels.copy import IndexLike, as_index, block_view, copy_blocks, gather_blocks, scatter_blocks
from kvferry.pools.layout import CacheLayout, GroupKind, Pool, PoolEntry, PoolGroup, Role
from kvferry.pools.spec import dtype_from_name

if TYPE_CHECKING:
    from kvferry.pools.pagetable import PageTable

__all__ = ["REPLAY", "CacheArena", "HostPages", "HostSlots"]

#: Name accepted by :meth:`CacheArena.fill_garbage` for the replay buffers and ``num_accepted``.
REPLAY = "replay"


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@define(eq=False)
class HostPages:
    """Pages of one PAGED group copied to host memory: per pool ``[len(ids), slot_bytes]`` uint8."""

    group: str
    count: int
    blocks: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)


@define(eq=False)
class HostSlots:
    """State slots copied to host memory: every STATE pool's rows, and (optionally) replay rows + num_accepted."""

    count: int
    blocks: tuple[torch.Tensor, ...]
    replay: torch.Tensor | None
    num_accepted: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        total = sum(b.numel() for b in self.blocks)
        if self.replay is not None and self.num_accepted is not None:
            total += self.replay.numel() + self.num_accepted.numel() * 8
        return total


@define(eq=False)
class CacheArena:
    """The allocated cache of one rank: byte arenas per pool, replay buffers and ``num_accepted``.

    :param layout: what to allocate.
    :param device: ``"cpu"`` or ``"cuda:N"`` (anything torch accepts).
    """

    layout: CacheLayout
    device: torch.device = attrs.field(converter=torch.device)
    _pools: dict[str, torch.Tensor] = attrs.field(init=False, factory=dict)
    _replay: torch.Tensor = attrs.field(init=False)
    num_accepted: torch.Tensor = attrs.field(init=False)
    """``[num_slots]`` int64: tokens of each slot's last verify step still to replay onto the slot (the verified
    token plus its accepted drafts); 0 means nothing is pending."""
    #: the row views of :meth:`page_rows` and the others, made once (a view costs more than a small copy)
    _row_views: dict[str, tuple[torch.Tensor, ...]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        for _group, pool in self.layout.pools():
            self._pools[pool.name] = torch.zeros(pool.nbytes, dtype=torch.uint8, device=self.device)
        self._replay = torch.zeros(self.layout.replay.nbytes, dtype=torch.uint8, device=self.device)
        self.num_accepted = torch.zeros(self.layout.num_slots, dtype=torch.int64, device=self.device)

    def __repr__(self) -> str:
        spec = self.layout.spec
        groups = ", ".join(f"{g.name}:{g.num_slots}" for g in self.layout.pool_groups)
        return f"<CacheArena {self.device} rank {spec.rank}/{spec.tp_size} [{groups}] {self.nbytes} B>"

    # --- raw memory ----------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return (
            sum(t.numel() for t in self._pools.values())
            + self._replay.numel()
            + self.num_accepted.numel() * 8
        )

    def pool_tensor(self, name: str) -> torch.Tensor:
        """The whole uint8 arena of pool ``name`` (what a transport registers)."""
        try:
            return self._pools[name]
        except KeyError:
            raise ConfigError(f"no pool {name!r}; have {sorted(self._pools)}") from None

    def pool_tensors(self) -> dict[str, torch.Tensor]:
        """Every pool's arena by pool name, in layout order."""
        return dict(self._pools)

    @property
    def replay_tensor(self) -> torch.Tensor:
        """The uint8 arena of every replay buffer (slot-first; ``layout.replay`` describes it)."""
        return self._replay

    def _rows(self, pool: Pool) -> torch.Tensor:
        return block_view(
            self._pools[pool.name], count=pool.num_slots, stride=pool.slot_stride, block_bytes=pool.slot_bytes
        )

    def _replay_rows(self) -> torch.Tensor:
        r = self.layout.replay
        return block_view(self._replay, count=r.num_slots, stride=r.slot_stride, block_bytes=r.slot_stride)

    def _typed(self, pool: Pool, entry: PoolEntry, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        dtype = dtype_from_name(dtype_name)
        itemsize = dtype.itemsize
        typed = self._pools[pool.name].view(dtype)
        return typed.as_strided(
            (pool.num_slots, *shape),
            (pool.slot_stride // itemsize, *_contiguous_strides(shape)),
            entry.offset // itemsize,
        )

    def _role_view(self, layer_id: int, role: Role) -> torch.Tensor:
        group = self.layout.layer_group_of(layer_id)
        if role not in group.roles:
            raise ConfigError(f"layer {layer_id} ({group.name}) has no {role.value} buffer")
        pool, entry = self.layout.locate(layer_id, role)
        return self._typed(pool, entry, group.dtype(role), group.role_shape(role))

    # --- rows ----------------------------------------------------------------------------------------------

    def _cached_rows(self, key: str, make: Any) -> tuple[torch.Tensor, ...]:
        views = self._row_views.get(key)
        if views is None:
            views = self._row_views[key] = tuple(make())
        return views

    def page_rows(self, group: str) -> tuple[torch.Tensor, ...]:
        """Per pool of a PAGED group, its pages as ``[num_pages, slot_bytes]`` uint8 rows (views of the arena)."""
        return self._cached_rows(group, lambda: (self._rows(pool) for pool in self._paged(group).pools))

    def state_rows(self) -> tuple[torch.Tensor, ...]:
        """Per pool of every STATE group, its slots as ``[num_slots, slot_bytes]`` uint8 rows (views)."""
        return self._cached_rows("\0state", lambda: (self._rows(pool) for pool in self._state_pools()))

    def replay_rows(self) -> torch.Tensor:
        """The replay buffers as ``[num_slots, slot_stride]`` uint8 rows (a view)."""
        return self._cached_rows("\0replay", lambda: (self._replay_rows(),))[0]

    def num_accepted_rows(self) -> torch.Tensor:
        """``num_accepted`` as ``[num_slots, 8]`` uint8 rows, one int64 each (a view)."""
        return self._cached_rows("\0accepted", lambda: (self.num_accepted.view(torch.uint8).view(-1, 8),))[0]

    # --- typed views ---------------------------------------------------------------------------------------

    def kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of an attention or draft layer, each ``[num_pages, kv_heads_rank, tokens_per_block, head_dim]``.

        :raises ~kvferry.errors.ConfigError: if ``layer_id`` is not a paged layer of this rank.
        """
        return self._role_view(layer_id, Role.KEY), self._role_view(layer_id, Role.VALUE)

    def latent(self, layer_id: int) -> torch.Tensor:
        """The latent pages of an MLA layer: ``[num_pages, tokens_per_block, latent_dim]``, the same on every
        rank (``[kv_lora_rank | qk_rope_head_dim]`` per token).

        :raises ~kvferry.errors.ConfigError: if ``layer_id`` is not an MLA layer of this rank.
        """
        return self._role_view(layer_id, Role.LATENT).squeeze(1)

    def conv(self, layer_id: int) -> torch.Tensor:
        """Conv window of a recurrent layer: ``[num_slots, conv_dim_rank, conv_kernel - 1]``, sections in order."""
        return self._role_view(layer_id, Role.CONV)

    def ssm(self, layer_id: int) -> torch.Tensor:
        """SSM state of a recurrent layer: ``[num_slots, heads_rank, head_dim, state_size]``."""
        return self._role_view(layer_id, Role.SSM)

    def replay(self, layer_id: int) -> torch.Tensor:
        """Replay buffer of a recurrent layer: ``[num_slots, max_replay_tokens, replay_width]``."""
        r = self.layout.replay
        buffer = r.buffer(layer_id)
        dtype = dtype_from_name(buffer.dtype)
        itemsize = dtype.itemsize
        return self._replay.view(dtype).as_strided(
            (r.num_slots, r.max_tokens, buffer.width),
            (r.slot_stride // itemsize, buffer.width, 1),
            buffer.offset // itemsize,
        )

    # --- pages ---------------------------------------------------------------------------------------------

    def _paged(self, group: str) -> PoolGroup:
        g = self.layout.pool_group(group)
        if g.kind != GroupKind.PAGED:
            raise ConfigError(f"{group!r} is not a paged group")
        return g

    def _ids(self, group: PoolGroup, ids: IndexLike, *, unique: bool = False) -> torch.Tensor:
        return as_index(ids, count=group.num_slots, device=self.device, unique=unique)

    def copy_pages(self, group: str, src_ids: IndexLike, dst_ids: IndexLike) -> None:
        """Copy pages ``src_ids[i] -> dst_ids[i]`` of a PAGED group (every layer, K and V).

        :raises ~kvferry.errors.ConfigError: on an unknown group, an id out of range, repeated destinations or
            lengths that differ; nothing is copied then.
        """
        g = self._paged(group)
        src, dst = self._ids(g, src_ids), self._ids(g, dst_ids, unique=True)
        if src.numel() != dst.numel():
            raise ConfigError(f"{src.numel()} source pages but {dst.numel()} destination pages")
        for pool in g.pools:
            copy_blocks(self._rows(pool), src, dst)

    def zero_pages(self, group: str, ids: IndexLike) -> None:
        """Zero pages ``ids`` of a PAGED group."""
        g = self._paged(group)
        index = self._ids(g, ids)
        for pool in g.pools:
            self._rows(pool).index_fill_(0, index, 0)

    def save_pages(self, group: str, ids: IndexLike) -> HostPages:
        """Copy pages ``ids`` of a PAGED group to host memory (synchronous; the pages are unchanged)."""
        g = self._paged(group)
        index = self._ids(g, ids)
        blocks = tuple(gather_blocks(self._rows(p), index).to("cpu") for p in g.pools)
        return HostPages(group=group, count=index.numel(), blocks=blocks)

    def restore_pages(self, group: str, ids: IndexLike, saved: HostPages) -> None:
        """Write pages saved by :meth:`save_pages` into pages ``ids`` (possibly other ids than they came from).

        :raises ~kvferry.errors.ConfigError: if ``saved`` is of another group, count or shape.
        """
        g = self._paged(group)
        index = self._ids(g, ids, unique=True)
        if saved.group != group or saved.count != index.numel() or len(saved.blocks) != len(g.pools):
            raise ConfigError(
                f"saved pages ({saved.group}, {saved.count}) do not fit {group} x {index.numel()}"
            )
        for pool, block in zip(g.pools, saved.blocks, strict=True):
            if tuple(block.shape) != (index.numel(), pool.slot_bytes):
                raise ConfigError(f"saved block shape {tuple(block.shape)} does not fit pool {pool.name}")
        for pool, block in zip(g.pools, saved.blocks, strict=True):
            scatter_blocks(self._rows(pool), index, block)

    # --- state slots ---------------------------------------------------------------------------------------

    def _slot_ids(self, ids: IndexLike, *, unique: bool = False) -> torch.Tensor:
        if not self.layout.state_groups:
            raise ConfigError("this model has no recurrent state")
        return as_index(ids, count=self.layout.num_slots, device=self.device, unique=unique)

    def _state_pools(self) -> list[Pool]:
        return [p for g in self.layout.state_groups for p in g.pools]

    def copy_slots(self, src_ids: IndexLike, dst_ids: IndexLike) -> None:
        """Copy conv and SSM state of every recurrent layer, slot ``src_ids[i] -> dst_ids[i]``.

        Replay buffers and ``num_accepted`` are not copied (see :meth:`copy_replay`).
        """
        src, dst = self._slot_ids(src_ids), self._slot_ids(dst_ids, unique=True)
        if src.numel() != dst.numel():
            raise ConfigError(f"{src.numel()} source slots but {dst.numel()} destination slots")
        for pool in self._state_pools():
            copy_blocks(self._rows(pool), src, dst)

    def zero_slots(self, ids: IndexLike) -> None:
        """Zero conv and SSM state of every recurrent layer in slots ``ids`` (replay untouched)."""
        index = self._slot_ids(ids)
        for pool in self._state_pools():
            self._rows(pool).index_fill_(0, index, 0)

    def copy_replay(self, src_ids: IndexLike, dst_ids: IndexLike) -> None:
        """Copy replay buffers and ``num_accepted`` of slots ``src_ids[i] -> dst_ids[i]``."""
        src, dst = self._slot_ids(src_ids), self._slot_ids(dst_ids, unique=True)
        if src.numel() != dst.numel():
            raise ConfigError(f"{src.numel()} source slots but {dst.numel()} destination slots")
        copy_blocks(self._replay_rows(), src, dst)
        self.num_accepted.index_copy_(0, dst, self.num_accepted.index_select(0, src))

    def reset_replay(self, ids: IndexLike) -> None:
        """Zero replay buffers and set ``num_accepted = 0`` for slots ``ids`` (a fresh context)."""
        index = self._slot_ids(ids)
        self._replay_rows().index_fill_(0, index, 0)
        self.num_accepted.index_fill_(0, index, 0)

    def save_slots(self, ids: IndexLike, *, replay: bool = True) -> HostSlots:
        """Copy state slots ``ids`` (and with ``replay`` their replay buffers + num_accepted) to host memory."""
        index = self._slot_ids(ids)
        blocks = tuple(gather_blocks(self._rows(p), index).to("cpu") for p in self._state_pools())
        replay_rows = accepted = None
        if replay:
            replay_rows = gather_blocks(self._replay_rows(), index).to("cpu")
            accepted = self.num_accepted.index_select(0, index).to("cpu")
        return HostSlots(count=index.numel(), blocks=blocks, replay=replay_rows, num_accepted=accepted)

    def restore_slots(self, ids: IndexLike, saved: HostSlots) -> None:
        """Write slots saved by :meth:`save_slots` into slots ``ids``.

        Replay buffers and ``num_accepted`` are restored when they were saved, else reset (fresh context).
        :raises ~kvferry.errors.ConfigError: if ``saved`` does not fit; nothing is written then.
        """
        index = self._slot_ids(ids, unique=True)
        pools = self._state_pools()
        if saved.count != index.numel() or len(saved.blocks) != len(pools):
            raise ConfigError(f"saved slots ({saved.count}) do not fit {index.numel()} slots")
        for pool, block in zip(pools, saved.blocks, strict=True):
            if tuple(block.shape) != (index.numel(), pool.slot_bytes):
                raise ConfigError(f"saved block shape {tuple(block.shape)} does not fit pool {pool.name}")
        r = self.layout.replay
        if saved.replay is not None and tuple(saved.replay.shape) != (index.numel(), r.slot_stride):
            raise ConfigError(f"saved replay shape {tuple(saved.replay.shape)} does not fit")
        for pool, block in zip(pools, saved.blocks, strict=True):
            scatter_blocks(self._rows(pool), index, block)
        if saved.replay is None or saved.num_accepted is None:
            self.reset_replay(index)
        else:
            scatter_blocks(self._replay_rows(), index, saved.replay)
            self.num_accepted.index_copy_(0, index, saved.num_accepted.to(self.device))

    # --- tests ---------------------------------------------------------------------------------------------

    def fill_garbage(self, group: str, ids: IndexLike, *, seed: int = 0) -> None:
        """Fill pages (PAGED group), slots (STATE group name) or replay rows (``"replay"``) with random bytes.

        For poisoned-memory tests: a correct engine never reads these bytes. ``num_accepted`` of replay rows is
        set to a large bogus value.
        """
        generator = torch.Generator().manual_seed(seed)
        if group == REPLAY:
            index = self._slot_ids(ids)
            rows = self._replay_rows()
            noise = torch.randint(
                0, 256, (index.numel(), rows.shape[1]), dtype=torch.uint8, generator=generator
            )
            rows.index_copy_(0, index, noise.to(self.device))
            self.num_accepted.index_fill_(0, index, 1 << 40)
            return
        g = self.layout.pool_group(group)
        index = self._ids(g, ids)
        for pool in g.pools:
            rows = self._rows(pool)
            noise = torch.randint(
                0, 256, (index.numel(), rows.shape[1]), dtype=torch.uint8, generator=generator
            )
            rows.index_copy_(0, index, noise.to(self.device))

    # --- wire ----------------------------------------------------------------------------------------------

    def page_table(self) -> PageTable:
        """This rank's page table: the layout with each pool's base set to its arena's device address."""
        from kvferry.pools.pagetable import PageTable

        bases = {name: tensor.data_ptr() for name, tensor in self._pools.items()}
        return PageTable.from_layout(self.layout, bases)

    def statistics(self) -> dict[str, Any]:
        """Device, bytes per pool and in all, counts per group."""
        return {
            "device": str(self.device),
            "nbytes": self.nbytes,
            "pools": {name: t.numel() for name, t in self._pools.items()},
            "replay_bytes": self._replay.numel(),
            "groups": {g.name: g.num_slots for g in self.layout.pool_groups},
        }
