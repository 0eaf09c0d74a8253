"""The KDA block against transformers' ``KimiLinearDeltaAttention`` run with its cache, and against itself across
chunking, batching, tensor parallelism and speculative verify + replay."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import attrs
import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.model.batch import plan_groups
from kvferry.model.kda import kda_block, shard_kda_weights
from kvferry.model.nemotron_h import DenseCache
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.spec import ModelSpec, preset, split_heads

pytest.importorskip("transformers")
from transformers import DynamicCache, KimiLinearConfig
from transformers.models.kimi_linear import modeling_kimi_linear as hf

HIDDEN, HEADS, HEAD_DIM, KERNEL, EPS = 64, 4, 16, 4, 1e-5
SLOTS, REPLAY = 6, 5
PREFIX = "model.layers.0.self_attn."
SPEC = preset("tiny-kimi").with_dtype("float64")
# transformers runs the recurrence in float32 whatever the module's dtype; kvferry's float64 runs it in float64


def _hf_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def _self_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # the same float64 arithmetic in another order (chunking, batching, shards)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


def _config() -> KimiLinearConfig:
    return KimiLinearConfig(
        hidden_size=HIDDEN,
        vocab_size=256,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        linear_num_heads=HEADS,
        linear_head_dim=HEAD_DIM,
        linear_conv_kernel_dim=KERNEL,
        rms_norm_eps=EPS,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module")
def module() -> hf.KimiLinearDeltaAttention:
    torch.manual_seed(1234)
    m = hf.KimiLinearDeltaAttention(_config(), 0).double().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name == "forget_gate.A_log":
                p.copy_(torch.randn_like(p) * 0.5)
            elif name == "forget_gate.dt_bias":
                p.copy_(torch.randn_like(p))
            elif name == "o_norm.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
    return m


def _checkpoint(m: hf.KimiLinearDeltaAttention) -> dict[str, torch.Tensor]:
    # KimiLinear checkpoints keep the forget gate's tensors directly under self_attn
    return {PREFIX + name.removeprefix("forget_gate."): t.detach() for name, t in m.state_dict().items()}


def _hf_run(m: hf.KimiLinearDeltaAttention, chunks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, object]:
    """Run ``chunks`` (``[n, hidden]`` each) one after the other with one transformers cache."""
    cache = DynamicCache(config=_config())
    with torch.no_grad():
        outs = [m(chunk[None], cache=cache)[0] for chunk in chunks]
    return torch.cat(outs), cache


@attrs.define
class Row:
    h: torch.Tensor  # [n, hidden]
    start: int
    slot: int
    verify: bool = False


class Harness:
    """The block over ``tp`` ranks' DenseCaches, with the model's slot rules (fresh reset, replay, accept)."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        tp: int = 1,
        spec: ModelSpec = SPEC,
        kind: str = "dense",
        check: bool = True,
    ) -> None:
        self.check = check
        self.caches: list[DenseCache | CacheArena] = [
            CacheArena(
                CacheLayout.build(
                    spec.shard(tp, r),
                    num_pages=4,
                    num_slots=SLOTS,
                    num_draft_pages=2,
                    max_replay_tokens=REPLAY,
                ),
                "cpu",
            )
            if kind == "arena"
            else DenseCache(spec.shard(tp, r), num_pages=1, num_slots=SLOTS, max_replay_tokens=REPLAY)
            for r in range(tp)
        ]
        self.shards = [shard_kda_weights(weights, 0, split_heads(HEADS, tp, r), HEAD_DIM) for r in range(tp)]

    def step(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        groups = plan_groups([(len(r.h), r.start, [], r.slot, r.verify) for r in rows], torch.device("cpu"))
        fresh = torch.tensor([r.slot for r in rows if r.start == 0], dtype=torch.int64)
        resumed = torch.tensor([r.slot for r in rows if r.start > 0], dtype=torch.int64)
        for cache in self.caches:
            cache.conv(0)[fresh] = 0
            cache.ssm(0)[fresh] = 0
            cache.num_accepted[fresh] = 0
        counts = self.caches[0].num_accepted[resumed].clone()
        h = torch.cat([r.h for r in rows])
        parts = [
            kda_block(
                w, PREFIX, h, groups, c.conv(0), c.ssm(0), c.replay(0), resumed, counts,
                head_dim=HEAD_DIM, eps=EPS, check=self.check,
            )
            for w, c in zip(self.shards, self.caches, strict=True)
        ]  # fmt: skip
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        for cache in self.caches:
            cache.num_accepted[resumed] = 0
        return list(torch.split(out, [len(r.h) for r in rows]))

    def accept(self, slot: int, n: int) -> None:
        for cache in self.caches:
            cache.num_accepted[slot] = n


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run_chunks(harness: Harness, h: torch.Tensor, sizes: Sequence[int], slot: int) -> torch.Tensor:
    outs, start = [], 0
    for n in sizes:
        outs += harness.step([Row(h[start : start + n], start, slot)])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("sizes", [[9, 1, 1, 1], [3, 5, 1, 1, 1, 1], [1] * 12, [2, 7, 3]])
def test_prefill_chunks_and_decode_equal_transformers(
    module: hf.KimiLinearDeltaAttention, sizes: list[int]
) -> None:
    h = _tokens(sum(sizes), 0)
    ref, cache = _hf_run(module, [h[:9]] + [h[i : i + 1] for i in range(9, len(h))])
    harness = Harness(_checkpoint(module))
    out = _run_chunks(harness, h, sizes, slot=2)
    _hf_close(out, ref)
    # the slot holds transformers' state: its conv window keeps kernel tokens, the contract kernel - 1
    layer = cache.layers[0]  # type: ignore[attr-defined]
    _hf_close(harness.caches[0].conv(0)[2], layer.conv_states[0][0, :, 1:].double())
    _hf_close(harness.caches[0].ssm(0)[2], layer.recurrent_states[0][0].double())


def test_chunking_does_not_change_the_result(module: hf.KimiLinearDeltaAttention) -> None:
    h = _tokens(12, 1)
    whole = _run_chunks(Harness(_checkpoint(module)), h, [12], slot=0)
    for sizes in ([3, 5, 1, 3], [1] * 12, [11, 1]):
        _self_close(_run_chunks(Harness(_checkpoint(module)), h, sizes, slot=0), whole)


def test_batched_sequences_of_different_lengths(module: hf.KimiLinearDeltaAttention) -> None:
    weights = _checkpoint(module)
    a, b, c, d = _tokens(8, 10), _tokens(4, 11), _tokens(8, 12), _tokens(6, 13)
    harness = Harness(weights)
    harness.step([Row(d[:5], 0, 5)])
    # two 7-token prefills (one group), a 4-token prefill and a decode row, all in one step
    outs = harness.step([Row(a[:7], 0, 1), Row(b, 0, 3), Row(d[5:], 5, 5), Row(c[:7], 0, 0)])
    outs += harness.step([Row(c[7:], 7, 0), Row(a[7:], 7, 1)])
    refs = [_hf_run(module, [x])[0] for x in (a[:7], b)]
    refs.append(_hf_run(module, [d[:5], d[5:]])[0][5:])
    refs.append(_hf_run(module, [c[:7]])[0])
    refs.append(_hf_run(module, [c[:7], c[7:]])[0][7:])
    refs.append(_hf_run(module, [a[:7], a[7:]])[0][7:])
    for out, ref in zip(outs, refs, strict=True):
        _hf_close(out, ref)
    alone = Harness(weights)
    _self_close(alone.step([Row(b, 0, 4)])[0], outs[1])


@pytest.mark.parametrize("accepted", [0, 1, 2, 4])
@pytest.mark.parametrize("tp", [1, 2])
def test_verify_then_accept_and_replay_equals_running_the_accepted(
    module: hf.KimiLinearDeltaAttention, accepted: int, tp: int
) -> None:
    weights = _checkpoint(module)
    h = _tokens(6 + 4 + 2, 20)
    prompt, drafts, after = h[:6], h[6:10], h[10:]
    harness = Harness(weights, tp)
    harness.step([Row(prompt, 0, 3)])
    before = [(c.conv(0).clone(), c.ssm(0).clone()) for c in harness.caches]
    (verify,) = harness.step([Row(drafts, 6, 3, verify=True)])
    # a verify step leaves the state as it was and gives the outputs of running its tokens
    for cache, (conv, ssm) in zip(harness.caches, before, strict=True):
        assert torch.equal(cache.conv(0), conv) and torch.equal(cache.ssm(0), ssm)
    _hf_close(verify, _hf_run(module, [prompt, drafts])[0][6:])
    harness.accept(3, accepted)
    start = 6 + accepted
    (out,) = harness.step([Row(after[:1], start, 3)])
    (out2,) = harness.step([Row(after[1:], start + 1, 3)])
    plain = Harness(weights, tp)
    sizes = [6, accepted, 1, 1] if accepted else [6, 1, 1]
    ref = _run_chunks(plain, torch.cat((prompt, drafts[:accepted], after)), sizes, slot=3)
    _self_close(torch.cat((out, out2)), ref[start:])
    for cache, ref_cache in zip(harness.caches, plain.caches, strict=True):
        _self_close(cache.conv(0)[3], ref_cache.conv(0)[3])
        _self_close(cache.ssm(0)[3], ref_cache.ssm(0)[3])
        assert int(cache.num_accepted[3]) == 0
    hf_ref = _hf_run(module, [torch.cat((prompt, drafts[:accepted])), after[:1]])[0]
    _hf_close(out, hf_ref[-1:])


def test_replay_then_verify_again_and_a_prefill_chunk(module: hf.KimiLinearDeltaAttention) -> None:
    weights = _checkpoint(module)
    h = _tokens(20, 30)
    harness = Harness(weights)
    harness.step([Row(h[:5], 0, 1)])
    harness.step([Row(h[5:9], 5, 1, verify=True)])
    harness.accept(1, 3)  # tokens 5, 6, 7 kept
    (again,) = harness.step([Row(h[8:11], 8, 1, verify=True)])  # replays 3, then verifies 8..10
    harness.accept(1, 2)  # 8, 9 kept
    (chunk,) = harness.step([Row(h[10:15], 10, 1)])  # replays 2, then a prefill chunk
    ref = _run_chunks(Harness(weights), h[:15], [5, 3, 2, 5], slot=1)
    _self_close(again, _run_chunks(Harness(weights), h[:11], [8, 3], slot=1)[8:])
    _self_close(chunk, ref[10:])


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_sum_to_tp1(module: hf.KimiLinearDeltaAttention, tp: int) -> None:
    weights = _checkpoint(module)
    h = _tokens(20, 40)
    script: list[list[Row]] = [
        [Row(h[:6], 0, 1), Row(h[10:13], 0, 2)],
        [Row(h[6:10], 6, 1, verify=True), Row(h[13:14], 3, 2)],
    ]
    one, many = Harness(weights, 1), Harness(weights, tp)
    for rows in script:
        for a, b in zip(one.step(rows), many.step(rows), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    for harness in (one, many):
        harness.accept(1, 2)
    for a, b in zip(one.step([Row(h[8:9], 8, 1)]), many.step([Row(h[8:9], 8, 1)]), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    # each rank's slot holds its heads' share of tp 1's state
    width = HEADS // tp
    for r, cache in enumerate(many.caches):
        heads = slice(r * width, (r + 1) * width)
        torch.testing.assert_close(cache.ssm(0)[1], one.caches[0].ssm(0)[1][heads], rtol=0, atol=1e-12)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN-safe


def test_slots_of_other_sequences_are_untouched(module: hf.KimiLinearDeltaAttention) -> None:
    weights = _checkpoint(module)
    h = _tokens(16, 50)
    for tp in (1, 2):
        harness = Harness(weights, tp)
        for cache in harness.caches:
            assert isinstance(cache, DenseCache)
            cache.fill_garbage(seed=7)
            cache.num_accepted.zero_()
        harness.step([Row(h[:5], 0, 1)])
        harness.step([Row(h[5:8], 5, 1, verify=True)])
        harness.accept(1, 2)
        snapshot = [
            {k: t.clone() for k, t in (("conv", c.conv(0)), ("ssm", c.ssm(0)), ("replay", c.replay(0)))}
            for c in harness.caches
        ]
        outs = harness.step([Row(h[7:8], 7, 1), Row(h[8:12], 0, 4), Row(h[12:15], 0, 0, verify=True)])
        assert all(torch.isfinite(o).all() for o in outs)
        for cache, snap in zip(harness.caches, snapshot, strict=True):
            for other in (2, 3, 5):
                for name, t in (("conv", cache.conv(0)), ("ssm", cache.ssm(0)), ("replay", cache.replay(0))):
                    assert _same_bytes(t[other], snap[name][other]), (name, other)
            # the resumed slot's replay rows are read, not written
            assert _same_bytes(cache.replay(0)[1], snap["replay"][1])


def test_bad_input_is_refused_before_anything_is_written(module: hf.KimiLinearDeltaAttention) -> None:
    harness = Harness(_checkpoint(module))
    harness.step([Row(_tokens(3, 60), 0, 1)])
    cache = harness.caches[0]
    snap = [t.clone() for t in (cache.conv(0), cache.ssm(0), cache.replay(0))]
    w, h = harness.shards[0], _tokens(REPLAY + 1, 61)
    empty = torch.zeros(0, dtype=torch.int64)

    def run(
        rows: list[tuple[int, int, int, bool]], resumed: torch.Tensor = empty, counts: torch.Tensor = empty
    ) -> None:
        groups = plan_groups([(n, s, [], slot, v) for n, s, slot, v in rows], torch.device("cpu"))
        x = h[: sum(r[0] for r in rows)]
        kda_block(w, PREFIX, x, groups, cache.conv(0), cache.ssm(0), cache.replay(0), resumed, counts,
                  head_dim=HEAD_DIM, eps=EPS)  # fmt: skip

    with pytest.raises(ConfigError, match="exceeds"):
        run([(REPLAY + 1, 3, 1, True)])
    with pytest.raises(ConfigError, match="twice"):
        run([(2, 3, 1, False), (1, 3, 1, True)])
    with pytest.raises(ConfigError, match="outside"):
        run([(1, 3, 1, False)], torch.tensor([1]), torch.tensor([REPLAY + 1]))
    with pytest.raises(ConfigError, match="ssm shape"):
        groups = plan_groups([(1, 3, [], 1, False)], torch.device("cpu"))
        kda_block(w, PREFIX, h[:1], groups, cache.conv(0), cache.ssm(0)[:, :1], cache.replay(0), empty, empty,
                  head_dim=HEAD_DIM, eps=EPS)  # fmt: skip
    for t, s in zip((cache.conv(0), cache.ssm(0), cache.replay(0)), snap, strict=True):
        assert torch.equal(t, s)


def test_shard_weights_slices_and_refuses(module: hf.KimiLinearDeltaAttention) -> None:
    weights = _checkpoint(module)
    shard = shard_kda_weights(weights, 0, split_heads(HEADS, 2, 1), HEAD_DIM)
    assert shard[PREFIX + "A_log"].shape == (1, 1, 2, 1)
    assert shard[PREFIX + "conv1d.weight"].shape == (3 * 2 * HEAD_DIM, 1, KERNEL)
    assert torch.equal(shard[PREFIX + "conv1d.weight"][:32], weights[PREFIX + "conv1d.weight"][32:64])
    assert torch.equal(shard[PREFIX + "conv1d.weight"][64:], weights[PREFIX + "conv1d.weight"][160:])
    assert shard[PREFIX + "o_proj.weight"].shape == (HIDDEN, 2 * HEAD_DIM)
    assert shard[PREFIX + "f_a_proj.weight"] is weights[PREFIX + "f_a_proj.weight"]
    assert set(shard) == set(weights)
    with pytest.raises(ConfigError, match="missing"):
        shard_kda_weights(
            {k: v for k, v in weights.items() if "b_proj" not in k}, 0, split_heads(HEADS, 1, 0), 16
        )
    with pytest.raises(ConfigError, match="rows"):
        shard_kda_weights(weights, 0, split_heads(HEADS, 1, 0), 8)


def test_float32_equals_transformers_float32(module: hf.KimiLinearDeltaAttention) -> None:
    m32 = copy.deepcopy(module).float()
    h = _tokens(12, 70).float()
    ref, _ = _hf_run(m32, [h[:7], h[7:8], h[8:9], h[9:]])
    # the cache shapes as the spec read from the same config lays them out
    harness = Harness(_checkpoint(m32), 2, ModelSpec.from_hf_config(_config()))
    out = _run_chunks(harness, h, [7, 1, 1, 3], slot=1)
    assert out.dtype == torch.float32 and harness.caches[0].ssm(0).dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_bfloat16_cache_and_weights_stay_near_float64(module: hf.KimiLinearDeltaAttention) -> None:
    weights = _checkpoint(module)
    h = _tokens(14, 80)
    script = [
        [Row(h[:6], 0, 2)],
        [Row(h[6:10], 6, 2, verify=True)],
        [Row(h[8:9], 8, 2)],  # after accept(2)
        [Row(h[9:14], 9, 2)],
    ]
    ref_harness = Harness(weights)
    low = Harness(
        {k: v.bfloat16() for k, v in weights.items()}, 1, preset("tiny-kimi").with_dtype("bfloat16")
    )
    for i, rows in enumerate(script):
        if i == 2:
            ref_harness.accept(2, 2)
            low.accept(2, 2)
        (ref,) = ref_harness.step(rows)
        (out,) = low.step([attrs.evolve(r, h=r.h.bfloat16()) for r in rows])
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, rtol=5e-2, atol=5e-2)
    assert low.caches[0].ssm(0).dtype == torch.bfloat16 and low.caches[0].replay(0).dtype == torch.bfloat16


@pytest.mark.parametrize("tp", [1, 2])
def test_arena_views_run_as_dense_caches_do(module: hf.KimiLinearDeltaAttention, tp: int) -> None:
    """The CacheArena's KDA views (slot-strided, not contiguous) take the block as plain tensors do."""
    weights = _checkpoint(module)
    h = _tokens(16, 90)
    dense, arena = Harness(weights, tp), Harness(weights, tp, kind="arena")
    script = [
        [Row(h[:6], 0, 2), Row(h[10:13], 0, 4)],
        [Row(h[6:10], 6, 2, verify=True), Row(h[13:14], 3, 4)],
        [Row(h[8:9], 8, 2), Row(h[14:16], 4, 4)],
    ]
    for i, rows in enumerate(script):
        if i == 2:
            dense.accept(2, 2)
            arena.accept(2, 2)
        for a, b in zip(dense.step(rows), arena.step(rows), strict=True):
            assert torch.equal(a, b)
    for plain, views in zip(dense.caches, arena.caches, strict=True):
        for slot in (2, 4):
            assert torch.equal(plain.conv(0)[slot], views.conv(0)[slot])
            assert torch.equal(plain.ssm(0)[slot], views.ssm(0)[slot])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_block_equals_torch_block_on_cuda(dtype: torch.dtype) -> None:
    from kvferry.kernels.kda import fla_available

    if not fla_available(torch.device("cuda")):
        pytest.skip("flash-linear-attention (fla.ops.kda) does not import")
    heads, head_dim = 2, 64  # fla's tiles want head dims of at least 16
    config = _config()
    config.linear_num_heads, config.linear_head_dim = heads, head_dim
    torch.manual_seed(5)
    m = hf.KimiLinearDeltaAttention(config, 0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if name.endswith(("A_log", "dt_bias")) else 0.1))
    w = {k: v.to("cuda", dtype) for k, v in _checkpoint(m).items()}
    conv_dim = 3 * heads * head_dim
    results = []
    for use_fla in (True, False):
        conv = torch.zeros(4, conv_dim, KERNEL - 1, device="cuda", dtype=dtype)
        ssm = torch.zeros(4, heads, head_dim, head_dim, device="cuda", dtype=torch.float32)
        replay = torch.zeros(4, REPLAY, conv_dim + heads * head_dim + heads, device="cuda", dtype=dtype)
        h = _tokens(80, 3).to("cuda", dtype)
        outs = []
        empty = torch.zeros(0, dtype=torch.int64, device="cuda")
        for rows, start, verify, resumed, counts in (
            ((0, 70), 0, False, empty, empty),
            ((70, 74), 70, True, torch.tensor([2], device="cuda"), torch.tensor([0], device="cuda")),
            ((72, 73), 72, False, torch.tensor([2], device="cuda"), torch.tensor([2], device="cuda")),
        ):
            n = rows[1] - rows[0]
            groups = plan_groups([(n, start, [], 2, verify)], torch.device("cuda"))
            out = kda_block(
                w, PREFIX, h[rows[0] : rows[1]], groups, conv, ssm, replay, resumed, counts,
                head_dim=head_dim, eps=EPS, use_fla=use_fla,
            )  # fmt: skip
            outs.append(out)
        results.append((torch.cat(outs).float(), ssm[2].clone()))
    tol = 5e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(results[0][0], results[1][0], rtol=tol, atol=tol)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=tol, atol=tol)


def test_unchecked_block_gives_the_same_results(module: hf.KimiLinearDeltaAttention) -> None:
    """``check=False`` (no host reads: slots unchecked, replay masked over every replay token) changes nothing,
    garbage (NaN, inf) in the replay rows past the accepted ones included."""
    weights = _checkpoint(module)
    h = _tokens(20, 100)
    harnesses = [Harness(weights, 2), Harness(weights, 2, check=False)]
    for harness in harnesses:
        for cache in harness.caches:
            assert isinstance(cache, DenseCache)
            cache.fill_garbage(seed=3)
            cache.num_accepted.zero_()
    script = [
        [Row(h[:6], 0, 1), Row(h[10:13], 0, 4)],
        [Row(h[6:10], 6, 1, verify=True), Row(h[13:15], 0, 2, verify=True)],
        [Row(h[7:8], 7, 1), Row(h[15:16], 1, 2), Row(h[16:17], 3, 4)],
    ]
    for i, rows in enumerate(script):
        if i == 2:
            for harness in harnesses:
                harness.accept(1, 1)
                harness.accept(2, 1)
        outs = [harness.step(rows) for harness in harnesses]
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)
    for checked, unchecked in zip(harnesses[0].caches, harnesses[1].caches, strict=True):
        for name in ("conv", "ssm", "replay"):
            assert _same_bytes(getattr(checked, name)(0), getattr(unchecked, name)(0)), name
