"""The KimiLinear cache: MLA latent pages (one tensor per token, on every rank) beside KDA state slots."""

from __future__ import annotations

import pytest

from kvferry.errors import ConfigError
from kvferry.model.nemotron_h import DenseCache
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout, GroupKind, Role
from kvferry.pools.pagetable import PageTable
from kvferry.pools.spec import AttentionSpec, LayerKind, MlaSpec, ModelSpec, preset


def _layout(tp: int, rank: int) -> CacheLayout:
    return CacheLayout.build(
        preset("tiny-kimi").shard(tp, rank), num_pages=6, num_slots=3, num_draft_pages=5, max_replay_tokens=4
    )


def test_tiny_kimi_latent_pages_are_one_buffer_per_layer() -> None:
    layout = _layout(1, 0)
    assert [g.name for g in layout.pool_groups] == ["attention", "draft", "kda"]
    attention = layout.layer_group("attention")
    assert attention.roles == (Role.LATENT,) and attention.head_dim == 32 + 8
    (pool,) = layout.pool_group("attention").pools
    # 2 MLA layers x [4 tokens x 40 values] float32 = 640 bytes each, nothing else in the page
    assert [(e.layer_id, e.role, e.offset, e.nbytes) for e in pool.entries] == [
        (2, Role.LATENT, 0, 640),
        (5, Role.LATENT, 640, 640),
    ]
    assert layout.bytes_per_token("attention") == 2 * 40 * 4


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_latent_is_whole_on_every_rank_and_kda_splits_by_heads(tp: int) -> None:
    for rank in range(tp):
        layout = _layout(tp, rank)
        latent = layout.layer_group("attention")
        assert (latent.heads.count, latent.heads.replicas) == (1, tp)
        assert latent.heads.is_writer(rank) == (rank == 0)
        kda = layout.layer_group("kda")
        assert kda.kind == GroupKind.STATE and kda.layer_kind == LayerKind.KDA
        assert kda.heads.count == 4 // tp and kda.heads.first == rank * (4 // tp)
        assert [s.count for s in kda.conv_sections] == [4 // tp * 16] * 3
        arena = CacheArena(layout, "cpu")
        assert arena.latent(2).shape == (6, 4, 40)
        assert arena.conv(0).shape == (3, 3 * (4 // tp) * 16, 3)
        assert arena.ssm(0).shape == (3, 4 // tp, 16, 16)
        # replay: raw q|k|v, the forget gate per channel and beta per head
        assert arena.replay(0).shape == (3, 4, 3 * (4 // tp) * 16 + (4 // tp) * 16 + 4 // tp)
        dense = DenseCache(layout.spec, 6, 3, 5, 4)
        for layer in (0, 1, 3, 4):
            assert dense.conv(layer).shape == arena.conv(layer).shape
            assert dense.ssm(layer).shape == arena.ssm(layer).shape
            assert dense.replay(layer).shape == arena.replay(layer).shape
        assert dense.latent(5).shape == arena.latent(5).shape


def test_latent_views_address_their_own_bytes() -> None:
    arena = CacheArena(_layout(1, 0), "cpu")
    arena.latent(5)[3, 1] = 7.0
    assert arena.latent(2).count_nonzero() == 0
    assert int(arena.latent(5).count_nonzero()) == 40
    saved = arena.save_pages("attention", [3])
    arena.zero_pages("attention", [3])
    assert arena.latent(5).count_nonzero() == 0
    arena.restore_pages("attention", [3], saved)
    assert bool((arena.latent(5)[3, 1] == 7.0).all())
    with pytest.raises(ConfigError, match="no key buffer"):
        arena.kv(2)
    with pytest.raises(ConfigError, match="no latent buffer"):
        gqa = CacheLayout.build(preset("tiny").shard(1, 0), num_pages=2, num_slots=2, num_draft_pages=2)
        CacheArena(gqa, "cpu").latent(1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_page_table_of_a_kimi_rank_round_trips(tp: int) -> None:
    arena = CacheArena(_layout(tp, tp - 1), "cpu")
    table = arena.page_table()
    assert PageTable.decode(table.encode()) == table
    assert table.layer_group("attention").roles == (Role.LATENT,)


def test_spec_takes_gqa_or_mla_not_both() -> None:
    mla = MlaSpec(num_heads=4, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    with pytest.raises(ConfigError, match="GQA or MLA"):
        ModelSpec(
            name="x",
            hidden_size=8,
            vocab_size=16,
            layer_kinds=(LayerKind.ATTENTION,),
            tokens_per_block=4,
            attention=AttentionSpec(4, 4, 8),
            mla=mla,
        )
    with pytest.raises(ConfigError, match="attention is used but its spec is missing"):
        ModelSpec(
            name="x", hidden_size=8, vocab_size=16, layer_kinds=(LayerKind.ATTENTION,), tokens_per_block=4
        )
    assert mla.latent_dim == 12 and mla.qk_head_dim == 12 and mla.latent_bytes_per_token() == 48
    assert preset("tiny-kimi").with_dtype("bfloat16").mla == MlaSpec(4, 32, 8, 16, 16, "bfloat16")


def test_from_hf_config_reads_a_kimi_linear_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.KimiLinearConfig(
        hidden_size=64,
        vocab_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config={
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 4, 5],
            "full_attn_layers": [3, 6],
        },
    )
    tiny = preset("tiny-kimi")
    spec = ModelSpec.from_hf_config(config, name="tiny-kimi", tokens_per_block=4, drafter=tiny.drafter)
    assert spec == tiny
    # the same layer type names mean Mamba2 in a NemotronH config
    config.layer_types[0] = "mamba"
    with pytest.raises(ConfigError, match="unknown layer type 'mamba'"):
        ModelSpec.from_hf_config(config)
