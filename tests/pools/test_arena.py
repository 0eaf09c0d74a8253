from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout, GroupKind, Role
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, LayerKind, Mamba2Spec, ModelSpec, dtype_from_name, preset

DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def _arena(device: str = "cpu", *, tp: int = 1, dtype: str | None = None) -> CacheArena:
    model = preset("tiny") if dtype is None else preset("tiny").with_dtype(dtype)
    layout = CacheLayout.build(
        model.shard(tp, 0), num_pages=5, num_slots=4, num_draft_pages=3, max_replay_tokens=3
    )
    return CacheArena(layout, device)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def _all_views(arena: CacheArena) -> list[tuple[int, Role, torch.Tensor]]:
    views = []
    for group in arena.layout.layer_groups:
        for layer_id in group.layer_ids:
            if group.kind == GroupKind.PAGED:
                k, v = arena.kv(layer_id)
                views += [(layer_id, Role.KEY, k), (layer_id, Role.VALUE, v)]
            else:
                views += [
                    (layer_id, Role.CONV, arena.conv(layer_id)),
                    (layer_id, Role.SSM, arena.ssm(layer_id)),
                ]
    return views


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("tp", "dtype"), [(1, None), (2, "bfloat16"), (8, "float64")])
def test_views_alias_the_formula_address(device: str, tp: int, dtype: str | None) -> None:
    arena = _arena(device, tp=tp, dtype=dtype)
    views = _all_views(arena)
    # Write a distinct pattern through every view, then read every entry back at its formula address:
    # each view must land exactly there, and no view may overwrite another.
    for i, (layer_id, role, view) in enumerate(views):
        group = arena.layout.layer_group_of(layer_id)
        assert view.dtype == dtype_from_name(group.dtype(role))
        assert tuple(view.shape) == (arena.layout.pool_group(group.name).num_slots, *group.role_shape(role))
        assert view.data_ptr() >= arena.pool_tensor(arena.layout.locate(layer_id, role)[0].name).data_ptr()
        pattern = torch.arange(view.numel(), dtype=torch.float64).reshape(view.shape) * 7 + i * 1000
        view.copy_(pattern.to(view.dtype))
    for layer_id, role, view in views:
        pool, entry = arena.layout.locate(layer_id, role)
        raw = arena.pool_tensor(pool.name).cpu()
        for slot in range(pool.num_slots):
            address = pool.address(slot, entry)
            assert torch.equal(raw[address : address + entry.nbytes], _bytes_of(view[slot])), (
                layer_id,
                role,
                slot,
            )


@pytest.mark.parametrize("device", DEVICES)
def test_replay_views_alias_the_replay_arena(device: str) -> None:
    arena = _arena(device)
    r = arena.layout.replay
    for i, buffer in enumerate(r.buffers):
        view = arena.replay(buffer.layer_id)
        assert tuple(view.shape) == (4, 3, 200)
        view.copy_(torch.arange(view.numel(), dtype=torch.float32).reshape(view.shape) + i * 10_000)
    raw = arena.replay_tensor.cpu()
    for buffer in r.buffers:
        view = arena.replay(buffer.layer_id)
        for slot in range(r.num_slots):
            address = slot * r.slot_stride + buffer.offset
            assert torch.equal(raw[address : address + buffer.nbytes], _bytes_of(view[slot]))
    assert arena.num_accepted.dtype == torch.int64 and tuple(arena.num_accepted.shape) == (4,)


def test_kv_of_draft_layer_and_errors() -> None:
    arena = _arena()
    k, v = arena.kv(DRAFT_LAYER_SHIFT)
    assert tuple(k.shape) == (3, 4, 8, 16)
    assert v.data_ptr() - k.data_ptr() == 2048
    with pytest.raises(ConfigError):
        arena.kv(0)  # a Mamba2 layer
    with pytest.raises(ConfigError):
        arena.conv(1)  # an attention layer
    with pytest.raises(ConfigError):
        arena.kv(3)  # MLP
    with pytest.raises(ConfigError):
        arena.replay(1)


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (garbage bytes make NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(_bytes_of(a), _bytes_of(b))


def _snapshot(arena: CacheArena) -> dict[str, torch.Tensor]:
    out = {name: t.clone() for name, t in arena.pool_tensors().items()}
    out["replay"] = arena.replay_tensor.clone()
    out["accepted"] = arena.num_accepted.clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _garbage_everywhere(arena: CacheArena) -> None:
    for group in arena.layout.paged_groups:
        arena.fill_garbage(group.name, range(group.num_slots), seed=1)
    arena.fill_garbage("mamba2", range(4), seed=2)
    arena.fill_garbage("replay", range(4), seed=3)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_and_zero_pages(device: str) -> None:
    arena = _arena(device)
    _garbage_everywhere(arena)
    k1, v1 = arena.kv(1)
    before_k, before_v = k1.clone(), v1.clone()
    before_draft = arena.kv(DRAFT_LAYER_SHIFT)[0].clone()
    state = arena.pool_tensor("mamba2.conv").clone()
    arena.copy_pages("attention", [0, 1, 2], [2, 3, 0])  # reads happen before writes
    assert _eq(k1[2], before_k[0]) and _eq(k1[3], before_k[1]) and _eq(k1[0], before_k[2])
    assert _eq(v1[3], before_v[1]) and _eq(k1[1], before_k[1]) and _eq(k1[4], before_k[4])
    assert _eq(arena.kv(DRAFT_LAYER_SHIFT)[0], before_draft)
    assert _eq(arena.pool_tensor("mamba2.conv"), state)
    arena.zero_pages("draft", [1])
    dk, dv = arena.kv(DRAFT_LAYER_SHIFT)
    assert not dk[1].any() and not dv[1].any() and _eq(dk[0], before_draft[0])


def test_bad_ids_change_nothing() -> None:
    arena = _arena()
    _garbage_everywhere(arena)
    snap = _snapshot(arena)
    bad_calls: list[Callable[[], object]] = [
        lambda: arena.copy_pages("attention", [0, 1], [2, 5]),
        lambda: arena.copy_pages("attention", [0, 1], [2, 2]),
        lambda: arena.copy_pages("attention", [0], [1, 2]),
        lambda: arena.copy_pages("mamba2", [0], [1]),
        lambda: arena.copy_pages("nope", [0], [1]),
        lambda: arena.zero_pages("draft", [-1]),
        lambda: arena.copy_slots([0], [4]),
        lambda: arena.zero_slots([0, 4]),
        lambda: arena.copy_replay([0, 1], [3, 3]),
        lambda: arena.fill_garbage("attention", [0, 9]),
        lambda: arena.zero_pages("attention", torch.tensor([0.5])),
    ]
    for call in bad_calls:
        with pytest.raises(ConfigError):
            call()
        assert _same(_snapshot(arena), snap)


@pytest.mark.parametrize("device", DEVICES)
def test_slots_copy_zero_replay(device: str) -> None:
    arena = _arena(device)
    _garbage_everywhere(arena)
    conv0, ssm0, rep0 = arena.conv(0).clone(), arena.ssm(4).clone(), arena.replay(2).clone()
    accepted = arena.num_accepted.clone()
    arena.copy_slots([1], [3])
    assert _eq(arena.conv(0)[3], conv0[1]) and _eq(arena.ssm(4)[3], ssm0[1])
    assert _eq(arena.replay(2), rep0)  # replay is not part of a slot copy
    arena.copy_replay([0], [2])
    assert _eq(arena.replay(2)[2], rep0[0]) and int(arena.num_accepted[2]) == int(accepted[0])
    arena.zero_slots([0, 2])
    for layer in (0, 2, 4):
        assert not arena.conv(layer)[0].any() and not arena.ssm(layer)[2].any()
        assert arena.conv(layer)[1].any()
    arena.reset_replay([1])
    assert not arena.replay(0)[1].any() and int(arena.num_accepted[1]) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_host_offload_round_trip(device: str) -> None:
    arena = _arena(device)
    _garbage_everywhere(arena)
    k5 = arena.kv(5)[0].clone()
    conv, ssm, rep = arena.conv(2).clone(), arena.ssm(2).clone(), arena.replay(4).clone()
    accepted = arena.num_accepted.clone()
    pages = arena.save_pages("attention", [3, 1])
    assert pages.blocks[0].device.type == "cpu" and pages.nbytes == 2 * 4096
    slots = arena.save_slots([2])
    arena.zero_pages("attention", range(5))
    arena.zero_slots(range(4))
    arena.reset_replay(range(4))
    arena.restore_pages("attention", [0, 4], pages)  # somewhere else than they came from
    assert _eq(arena.kv(5)[0][0], k5[3]) and _eq(arena.kv(5)[0][4], k5[1])
    assert not arena.kv(5)[0][1].any()
    arena.restore_slots([0], slots)
    assert _eq(arena.conv(2)[0], conv[2]) and _eq(arena.ssm(2)[0], ssm[2])
    assert _eq(arena.replay(4)[0], rep[2]) and int(arena.num_accepted[0]) == int(accepted[2])
    fresh = arena.save_slots([0], replay=False)
    arena.fill_garbage("replay", [1])
    arena.restore_slots([1], fresh)
    assert _eq(arena.conv(2)[1], conv[2])
    assert not arena.replay(4)[1].any() and int(arena.num_accepted[1]) == 0
    with pytest.raises(ConfigError):
        arena.restore_pages("draft", [0, 1], pages)
    with pytest.raises(ConfigError):
        arena.restore_slots([0, 1], slots)


def test_no_state_model() -> None:
    spec = ModelSpec(
        name="mamba-only",
        hidden_size=8,
        vocab_size=16,
        layer_kinds=(LayerKind.MAMBA2,),
        tokens_per_block=4,
        mamba2=Mamba2Spec(num_heads=2, head_dim=4, state_size=4, num_groups=1, conv_kernel=3),
    )
    arena = CacheArena(CacheLayout.build(spec.shard(1, 0), num_pages=0, num_slots=2), "cpu")
    assert tuple(arena.replay(0).shape) == (2, 0, 18)
    assert arena.conv(0).data_ptr() == arena.pool_tensor("mamba2").data_ptr()
    assert arena.ssm(0).data_ptr() - arena.conv(0).data_ptr() == 128
    with pytest.raises(ConfigError):
        arena.copy_pages("attention", [0], [1])
    assert "mamba2" in repr(arena) and arena.statistics()["pools"] == {"mamba2": 512}
