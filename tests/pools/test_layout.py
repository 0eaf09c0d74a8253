from __future__ import annotations

import math

import pytest

from kvferry.errors import ConfigError
from kvferry.pools.layout import ALIGNMENT, CacheLayout, GroupKind, Role, fit
from kvferry.pools.spec import (
    DRAFT_LAYER_SHIFT,
    AttentionSpec,
    KdaSpec,
    LayerKind,
    Mamba2Spec,
    ModelSpec,
    preset,
    preset_names,
)


def _tiny_layout(tp: int = 1, rank: int = 0, **counts: int) -> CacheLayout:
    kw = {"num_pages": 6, "num_slots": 3, "num_draft_pages": 5, "max_replay_tokens": 4, **counts}
    return CacheLayout.build(preset("tiny").shard(tp, rank), **kw)


def test_tiny_tp1_exact_layout() -> None:
    layout = _tiny_layout()
    assert [g.name for g in layout.pool_groups] == ["attention", "draft", "mamba2"]
    att = layout.pool_group("attention")
    assert att.kind == GroupKind.PAGED and att.num_slots == 6
    (pool,) = att.pools
    # 2 attention layers x K,V x [4 heads, 4 tokens, 16 dim] float32 = 1024 bytes each
    assert [(e.layer_id, e.role, e.offset, e.nbytes) for e in pool.entries] == [
        (1, Role.KEY, 0, 1024),
        (1, Role.VALUE, 1024, 1024),
        (5, Role.KEY, 2048, 1024),
        (5, Role.VALUE, 3072, 1024),
    ]
    assert (pool.slot_bytes, pool.slot_stride, pool.layer_stride, pool.nbytes) == (4096, 4096, 0, 6 * 4096)
    draft = layout.pool_group("draft").pools[0]
    assert [(e.layer_id, e.role, e.offset, e.nbytes) for e in draft.entries] == [
        (DRAFT_LAYER_SHIFT, Role.KEY, 0, 2048),
        (DRAFT_LAYER_SHIFT, Role.VALUE, 2048, 2048),
    ]
    assert layout.layer_group("draft").tokens_per_block == 8
    conv, ssm = layout.pool_group("mamba2").pools
    # conv: (128 + 32 + 32) channels x 3 taps x 4 bytes; ssm: 8 heads x 16 x 16 x 4 bytes
    assert (conv.name, conv.slot_stride, [e.offset for e in conv.entries]) == (
        "mamba2.conv",
        6912,
        [0, 2304, 4608],
    )
    assert (ssm.name, ssm.slot_stride, [e.offset for e in ssm.entries]) == (
        "mamba2.ssm",
        24576,
        [0, 8192, 16384],
    )
    assert conv.slot_stride != ssm.slot_stride
    assert conv.layer_ids == ssm.layer_ids == (0, 2, 4)
    group = layout.layer_group("mamba2")
    assert group.conv_section_bytes == (128 * 12, 32 * 12, 32 * 12)
    assert group.ssm_bytes_per_head == 16 * 16 * 4
    # replay: width = conv_dim 192 + 8 heads = 200 float32 x 4 tokens = 3200 bytes -> aligned 3200
    assert [(b.layer_id, b.width, b.offset) for b in layout.replay.buffers] == [
        (0, 200, 0),
        (2, 200, 3200),
        (4, 200, 6400),
    ]
    assert layout.replay.slot_stride == 9600
    assert layout.bytes_per_token("attention") == 1024.0
    assert layout.bytes_per_token("draft") == 512.0
    assert layout.state_bytes_per_slot == 6912 + 24576
    assert layout.bytes_per_slot == 6912 + 24576 + 9600 + 8
    assert layout.nbytes == 6 * 4096 + 5 * 4096 + 3 * (6912 + 24576 + 9600) + 3 * 8


def test_tp8_duplicates_kv_heads_and_mamba_groups() -> None:
    layout = _tiny_layout(tp=8, rank=5)
    att = layout.layer_group("attention")
    assert (att.heads.count, att.heads.first, att.heads.replicas) == (1, 2, 2)
    m = layout.layer_group("mamba2")
    x, b, c = m.conv_sections
    assert (x.total, x.count, x.first, x.replicas) == (128, 16, 80, 1)
    assert (b.total, b.count, b.first, b.replicas) == (32, 16, 16, 4)
    assert b == c
    assert m.heads.count == 1
    assert layout.pool_group("mamba2").pools[0].entries[0].nbytes == (16 + 32) * 3 * 4


def test_equal_sizes_coalesce_into_one_pool() -> None:
    # conv (8 + 4 + 4 channels) x 2 taps = 32 values == ssm 2 heads x 4 x 4 = 32 values: one pool, one stride.
    spec = ModelSpec(
        name="coalesce",
        hidden_size=8,
        vocab_size=16,
        layer_kinds=(LayerKind.MAMBA2, LayerKind.MAMBA2),
        tokens_per_block=4,
        mamba2=Mamba2Spec(num_heads=2, head_dim=4, state_size=4, num_groups=1, conv_kernel=3),
    )
    layout = CacheLayout.build(spec.shard(1, 0), num_pages=0, num_slots=4)
    (group,) = layout.pool_groups
    (pool,) = group.pools
    assert pool.name == "mamba2"
    assert [(e.layer_id, e.role, e.offset) for e in pool.entries] == [
        (0, Role.CONV, 0),
        (0, Role.SSM, 128),
        (1, Role.CONV, 256),
        (1, Role.SSM, 384),
    ]
    assert pool.slot_stride == 512


def test_mixed_dtypes_and_alignment_for_every_preset() -> None:
    for name in preset_names():
        # tiny-kimi's 4 KDA heads split over at most 4 ranks
        for tp in (1, 2, 4) if name == "tiny-kimi" else (1, 2, 4, 8):
            for dtype in (None, "float16", "float64"):
                model = preset(name) if dtype is None else preset(name).with_dtype(dtype)
                layout = CacheLayout.build(
                    model.shard(tp, tp - 1), num_pages=2, num_slots=2, num_draft_pages=2, max_replay_tokens=3
                )
                for group, pool in layout.pools():
                    assert pool.slot_stride % ALIGNMENT == 0
                    layer_group = layout.layer_group(group.name)
                    ends = 0
                    for entry in pool.entries:
                        assert entry.offset % ALIGNMENT == 0 and entry.offset >= ends
                        assert entry.nbytes == layer_group.role_bytes(entry.role)
                        ends = entry.offset + entry.nbytes
                    assert ends == pool.slot_bytes <= pool.slot_stride
                for buffer in layout.replay.buffers:
                    assert buffer.offset % ALIGNMENT == 0


def test_nemotron_conv_bf16_ssm_fp32() -> None:
    layout = CacheLayout.build(
        preset("nemotron-h-8b").shard(4, 1), num_pages=1, num_slots=1, num_draft_pages=1
    )
    group = layout.layer_group("mamba2")
    assert group.dtypes == ("bfloat16", "float32")
    # x: 32 heads x 64; B, C: 2 groups x 128 -> 2048 + 256 + 256 channels x 3 taps x 2 bytes
    assert group.conv_section_bytes == (2048 * 6, 256 * 6, 256 * 6)
    assert group.role_bytes(Role.SSM) == 32 * 64 * 128 * 4
    assert len(group.layer_ids) == 24
    assert layout.layer_group("attention").layer_ids == (7, 18, 29, 40)


def test_kda_group() -> None:
    spec = ModelSpec(
        name="kda",
        hidden_size=32,
        vocab_size=16,
        layer_kinds=(LayerKind.KDA, LayerKind.ATTENTION, LayerKind.KDA),
        tokens_per_block=4,
        attention=AttentionSpec(num_query_heads=4, num_kv_heads=2, head_dim=8),
        kda=KdaSpec(num_heads=4, head_dim=8, conv_kernel=4),
    )
    layout = CacheLayout.build(spec.shard(2, 1), num_pages=3, num_slots=2, max_replay_tokens=2)
    group = layout.layer_group("kda")
    assert group.kind == GroupKind.STATE and group.layer_ids == (0, 2)
    assert group.role_shape(Role.CONV) == (48, 3)
    assert group.role_shape(Role.SSM) == (2, 8, 8)
    assert [s.first for s in group.conv_sections] == [16, 16, 16]
    # replay width: qkv 48 + gate 2 x 8 + beta 2
    assert layout.replay.buffer(0).width == 66


def test_counts_are_checked() -> None:
    spec = preset("tiny").shard(1, 0)
    with pytest.raises(ConfigError, match="num_draft_pages"):
        CacheLayout.build(spec, num_pages=4, num_slots=2)
    with pytest.raises(ConfigError, match="num_pages"):
        CacheLayout.build(spec, num_pages=0, num_slots=2, num_draft_pages=1)
    with pytest.raises(ConfigError, match="num_slots"):
        CacheLayout.build(spec, num_pages=1, num_slots=-1, num_draft_pages=1)
    with pytest.raises(ConfigError):
        CacheLayout.build(spec, num_pages=True, num_slots=1, num_draft_pages=1)
    layout = CacheLayout.build(preset("tiny").without_drafter().shard(1, 0), num_pages=4, num_slots=2)
    assert not layout.has_group("draft")


def test_locate_and_address() -> None:
    layout = _tiny_layout()
    pool, entry = layout.locate(5, Role.VALUE)
    assert pool.address(3, entry) == 3 * 4096 + 3072
    with pytest.raises(ConfigError):
        layout.locate(3, Role.KEY)  # an MLP layer
    with pytest.raises(ConfigError):
        layout.locate(1, Role.CONV)


def test_fit_tiny() -> None:
    spec = preset("tiny").shard(1, 0)
    result = fit(spec, 1_000_000, 64)
    # 16 pages x 4096 + 8 draft pages x 4096 + one slot (6912 + 24576 + num_accepted 8)
    per_request = 16 * 4096 + 8 * 4096 + 6912 + 24576 + 8
    assert result.bytes_per_request == per_request
    assert result.requests == 1_000_000 // per_request == 7
    assert (result.num_pages, result.num_slots, result.num_draft_pages) == (7 * 16, 7, 7 * 8)
    assert result.bytes_used <= 1_000_000
    layout = CacheLayout.build(
        spec, num_pages=result.num_pages, num_slots=result.num_slots, num_draft_pages=result.num_draft_pages
    )
    assert layout.nbytes == result.bytes_used
    with_replay = fit(spec, 1_000_000, 64, max_replay_tokens=4)
    assert with_replay.bytes_per_request == per_request + 9600
    assert fit(spec, 10, 64).requests == 0
    with pytest.raises(ConfigError):
        fit(spec, 10, 0)


def test_fit_nemotron_80gib() -> None:
    spec = preset("nemotron-h-8b").shard(1, 0)
    result = fit(spec, 80 << 30, 8192)
    attention = 4 * 2 * 8 * 32 * 128 * 2  # 4 layers, K+V, 8 kv heads, 32 tokens, bf16
    draft = 2 * 8 * 64 * 128 * 2
    conv = 24 * (8192 + 2 * 1024) * 3 * 2
    ssm = 24 * 128 * 64 * 128 * 4
    per_request = 256 * attention + 128 * draft + conv + ssm + 8
    assert result.bytes_per_request == per_request
    assert result.requests == (80 << 30) // per_request
    assert result.pages_per_request == math.ceil(8192 / 32)
