"""Persistent decode rows (DecodeBatch, PagedRunner.forward_decodes) and steps launched from the event loop
(EngineConfig.launch_on_loop): the tokens of the general step, whatever enters, leaves, grows or moves.

On the CPU the decode path runs eagerly in float64, so the rows' logits are compared with the general step's and
the engine's tokens with the reference engine's; launching from the loop is forced on there (its read-back is
immediate). On CUDA (skipped here) launching from the loop is the default, its read-back polls an event, and the
tokens equal the CPU float64 oracle's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

from kvferry.engine import model_step
from kvferry.engine.overlap import OverlapWindow, run_launched
from kvferry.engine.runner import BuiltEngine, EngineOptions, build_engine
from kvferry.engine.sampling import GreedyReadback
from kvferry.errors import ConfigError
from kvferry.model.decode_batch import DecodeBatch
from kvferry.model.nemotron_h import Model, SequenceInput
from tests.engine.test_engine import MAX_TOKENS, PROMPTS, run_all
from tests.support.triton_modes import INTERPRETED

CUDA = torch.cuda.is_available() and not INTERPRETED

# --- the rows against the general step -----------------------------------------------------------------------


def _models(max_running: int = 8) -> tuple[Model, Model]:
    # the same seeded weights: one model with the decode path (eager on the CPU), one without
    options = EngineOptions(dtype="float64", max_running=max_running, num_pages=64)
    fast = build_engine("tiny", options).runner.model
    slow = build_engine("tiny", options).runner.model
    assert isinstance(fast, Model) and isinstance(slow, Model)
    fast.enable_decode_graphs(max_running)
    return fast, slow


#: per sequence: prompt, slot, first page of its pages (4 tokens a page in tiny)
SEQUENCES = {
    10: ([5, 9, 13], 1, 1),
    11: ([3, 1, 4, 1, 5, 9, 2], 2, 11),
    12: ([7], 3, 21),
    13: ([2, 7, 1, 8, 2, 8, 1, 8, 2, 8], 4, 31),
}


#: every sequence's block table: one object each, as a cache manager keeps it while the pages stay
TABLES = {key: tuple(range(first, first + 10)) for key, (_, _, first) in SEQUENCES.items()}


def _table(key: int) -> tuple[int, ...]:
    return TABLES[key]


def _tables(keys: list[int]) -> list[tuple[int, ...]]:
    return [TABLES[key] for key in keys]


def _prefill(model: Model) -> dict[int, int]:
    # every sequence's prompt; the first token chosen after each
    out = model.step([SequenceInput(p, 0, _table(k), slot) for k, (p, slot, _) in SEQUENCES.items()])
    return {k: int(logits[-1].argmax()) for k, logits in zip(SEQUENCES, out.logits, strict=True)}


def test_decode_rows_give_the_general_steps_logits_as_rows_enter_leave_and_grow() -> None:
    fast, reference = _models()
    tokens, same = _prefill(fast), _prefill(reference)
    assert tokens == same
    positions = {k: len(p) for k, (p, _, _) in SEQUENCES.items()}
    rows = DecodeBatch(fast)
    tables: dict[int, tuple[int, ...]] = {k: _table(k) for k in SEQUENCES}
    # which sequences decode at each step, in which order: leaving, coming back (its row read anew), reordered
    plan = [
        [10, 11, 12, 13],
        [10, 11, 12, 13],
        [10, 12, 13],
        [13, 10, 12],
        [11, 13, 10, 12],
        [11, 13, 10, 12],
    ]
    plan += [[12, 11]] + [[10, 11, 12, 13]] * 6
    entered_before = 0
    for step, keys in enumerate(plan):
        if step == 9:
            tables[10] = tables[10][:1] + tables[10][1:]  # the same pages in another object: read anew
        logits = fast.step_decode(
            rows,
            keys,
            [tokens[k] for k in keys],
            [positions[k] for k in keys],
            [tables[k] for k in keys],
            lambda k: SEQUENCES[k][1],
        )
        expected = reference.step(
            [SequenceInput([tokens[k]], positions[k], tables[k], SEQUENCES[k][1]) for k in keys]
        )
        torch.testing.assert_close(logits, torch.cat(list(expected.logits)), rtol=1e-9, atol=1e-9)
        for k, row in zip(keys, logits, strict=True):
            tokens[k] = int(row.argmax())
            positions[k] += 1
        stats = rows.statistics()
        assert stats["rows"] == len(keys)
        if step == 1:
            assert stats["entered"] == 4  # the same rows again: nothing read anew
        if step == 4:
            assert stats["entered"] == 5  # 11 came back
        if step == 9:
            assert stats["entered"] == entered_before + 1  # 10's table changed object
        entered_before = stats["entered"]
    # each page id was read once per entry of its row, not once per step
    assert rows.statistics()["pages_read"] < sum(len(keys) for keys in plan)


@pytest.mark.parametrize(
    ("case", "change"),
    [
        ("token outside the vocabulary", {"token": 10**6}),
        ("negative token", {"token": -1}),
        ("position 0", {"position": 0}),
        ("slot outside the pool", {"slot": 10**6}),
        ("slot named twice", {"slot": 1}),
        ("table too short", {"table": ()}),
        ("page outside the pool", {"table": (10**6, 2, 3)}),
        ("sequence named twice", {"key": 11}),
        ("a table short of the rows", {"short": True}),
    ],
)
def test_bad_decode_rows_raise_a_typed_error_and_are_forgotten(case: str, change: dict[str, Any]) -> None:
    fast, reference = _models()
    tokens = _prefill(fast)
    _prefill(reference)
    rows = DecodeBatch(fast)
    keys = [10, 11]
    positions = [len(SEQUENCES[k][0]) for k in keys]
    # first a good step, so that the rows exist
    fast.step_decode(
        rows, keys, [tokens[k] for k in keys], positions, _tables(keys), lambda k: SEQUENCES[k][1]
    )
    reference.step(
        [
            SequenceInput([tokens[k]], p, _table(k), SEQUENCES[k][1])
            for k, p in zip(keys, positions, strict=True)
        ]
    )
    positions = [p + 1 for p in positions]
    bad_keys = [10, change.get("key", 12)]
    bad_tokens = [1, change.get("token", 1)]
    bad_positions = [positions[0], change.get("position", len(SEQUENCES[12][0]))]
    tables = {10: _table(10), 11: _table(11), 12: change.get("table", _table(12))}
    slots = {10: 1, 11: 2, 12: change.get("slot", 3)}
    if "key" in change:
        bad_keys, bad_tokens, bad_positions = (
            [10, 11, 11],
            [1, 1, 1],
            [positions[0], positions[1], positions[1]],
        )
    with pytest.raises(ConfigError):
        bad_tables = [tables[k] for k in bad_keys][: 1 if change.get("short") else None]
        fast.step_decode(rows, bad_keys, bad_tokens, bad_positions, bad_tables, slots.__getitem__)
    assert rows.statistics()["rows"] == 0, case  # forgotten: the next step reads every row anew
    # nothing ran: the next good step gives the general step's logits
    logits = fast.step_decode(rows, keys, [1, 1], positions, _tables(keys), lambda k: SEQUENCES[k][1])
    expected = reference.step(
        [SequenceInput([1], p, _table(k), SEQUENCES[k][1]) for k, p in zip(keys, positions, strict=True)]
    )
    torch.testing.assert_close(logits, torch.cat(list(expected.logits)), rtol=1e-9, atol=1e-9)


def test_decode_rows_need_the_decode_path() -> None:
    _, reference = _models()
    with pytest.raises(ConfigError):
        DecodeBatch(reference)


def test_rows_widen_with_the_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.model import decode_graph

    monkeypatch.setattr(decode_graph, "INITIAL_TABLE_BLOCKS", 2)  # 8 tokens of tiny's 4-token pages
    fast, reference = _models()
    tokens, _ = _prefill(fast), _prefill(reference)
    rows = DecodeBatch(fast)
    keys = [11, 13]
    positions = {k: len(SEQUENCES[k][0]) for k in keys}
    for _ in range(8):
        logits = fast.step_decode(
            rows,
            keys,
            [tokens[k] for k in keys],
            [positions[k] for k in keys],
            _tables(keys),
            lambda k: SEQUENCES[k][1],
        )
        expected = reference.step(
            [SequenceInput([tokens[k]], positions[k], _table(k), SEQUENCES[k][1]) for k in keys]
        )
        torch.testing.assert_close(logits, torch.cat(list(expected.logits)), rtol=1e-9, atol=1e-9)
        for k, row in zip(keys, logits, strict=True):
            tokens[k], positions[k] = int(row.argmax()), positions[k] + 1
    assert fast.decode_graphs is not None and fast.decode_graphs.statistics()["widened"] >= 2


# --- the engine ------------------------------------------------------------------------------------------------


def _options(**kwargs: object) -> EngineOptions:
    base: dict[str, object] = {"dtype": "float64", "num_pages": 128, "max_running": 8}
    base.update(kwargs)
    return EngineOptions(**base)  # type: ignore[arg-type]


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    launches: list[int] = []
    launch = model_step.launch_model

    def counted(*args: Any) -> Any:
        launches.append(1)
        return launch(*args)

    monkeypatch.setattr(model_step, "launch_model", counted)
    from kvferry.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "launch_model", counted)
    return launches


def _decode_rows(built: BuiltEngine) -> dict[str, int]:
    rows = built.runner.decode_rows
    assert rows is not None
    return rows.statistics()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("case", "kwargs", "run_kwargs"),
    [
        ("greedy", {}, {}),
        ("seeded", {}, {"seed": 5}),
        ("speculative", {"max_spec_k": 2, "max_prefill_chunk": 5}, {"spec_k": 2}),
        ("tensor parallel", {"tp": 2}, {}),
        ("preemption", {"num_pages": 13, "max_prefill_chunk": 4, "enable_reuse": False}, {}),
    ],
)
@pytest.mark.parametrize("launch_on_loop", [False, True], ids=["thread", "launched"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_decode_rows_in_the_engine_give_the_reference_tokens(
    case: str,
    kwargs: dict[str, Any],
    run_kwargs: dict[str, Any],
    launch_on_loop: bool,
    overlap: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = await run_all(build_engine("tiny", _options(step_in_thread=False, **kwargs)), **run_kwargs)
    launches = _count_launches(monkeypatch)
    built = build_engine(
        "tiny",
        _options(decode_graphs=True, overlap=overlap, launch_on_loop=launch_on_loop, **kwargs),
    )
    assert built.engine.config.launch_on_loop is launch_on_loop
    assert await run_all(built, **run_kwargs) == reference, case
    if not run_kwargs.get("spec_k"):  # speculating requests decode as verify windows: never plain
        assert _decode_rows(built)["entered"] > 0, case
        assert bool(launches) is launch_on_loop, case
    if case == "preemption":
        stats = built.cache.statistics()
        assert stats.restores == stats.offloads


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kwargs", "spec_k"),
    [({}, 0), ({"max_spec_k": 2}, 2), ({"tp": 2}, 0)],
    ids=["plain", "speculative", "tp2"],
)
async def test_mixed_steps_run_their_plain_decodes_apart_with_the_same_tokens(
    kwargs: dict[str, Any], spec_k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prompts in chunks of 3: short prompts decode while long ones still prefill, in the same steps
    extra: dict[str, Any] = {"max_prefill_chunk": 3, **kwargs}
    reference = await run_all(build_engine("tiny", _options(step_in_thread=False, **extra)), spec_k=spec_k)
    split: list[int] = []
    forward_split = model_step._forward_split

    def counted(runner: Any, forward: Any, plain: list[int]) -> torch.Tensor:
        split.append(len(forward) - len(plain))
        return forward_split(runner, forward, plain)

    monkeypatch.setattr(model_step, "_forward_split", counted)
    built = build_engine("tiny", _options(decode_graphs=True, **extra))
    assert await run_all(built, spec_k=spec_k) == reference
    if spec_k:
        assert not split  # speculating requests decode as verify windows: no plain decodes
        return
    assert split and all(rest > 0 for rest in split)  # mixed steps, their plain decodes apart
    assert _decode_rows(built)["entered"] > 0


@pytest.mark.anyio
@pytest.mark.parametrize("launch_on_loop", [False, True], ids=["thread", "launched"])
async def test_suspend_resume_and_rebalance_mid_decode_keep_the_tokens(launch_on_loop: bool) -> None:
    # a request suspended and resumed at one step boundary, then moved to the host and back by rebalances: its
    # decode row is read anew every time its cache may have moved
    reference = await run_all(build_engine("tiny", _options(step_in_thread=False, enable_reuse=False)))
    built = build_engine("tiny", _options(decode_graphs=True, launch_on_loop=launch_on_loop, num_pages=40))
    results: list[list[int]] = [[] for _ in PROMPTS]
    sizes = [{"num_pages": 128}, {"num_pages": 60, "num_slots": 12}]
    done: list[int] = []
    with anyio.fail_after(120):
        async with built.engine:

            async def one(i: int) -> None:
                generation = built.engine.generate(PROMPTS[i], max_tokens=MAX_TOKENS[i])
                async for token in generation:
                    results[i].append(token)
                    if i == 0 and len(results[i]) == 3:
                        await generation.suspend()
                        generation.resume()
                    if i == 2 and len(done) < len(sizes) and len(results[i]) >= 4 + 3 * len(done):
                        await built.engine.rebalance(**sizes[len(done)])
                        done.append(len(results[i]))

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(one, i)
    assert len(done) == len(sizes)
    assert results == reference
    assert built.engine.statistics().num_failed == 0
    assert _decode_rows(built)["entered"] > len(PROMPTS)  # rows read anew after the moves


@pytest.mark.anyio
async def test_steps_that_would_not_launch_at_once_keep_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # without the decode path a plain decode step reads values back from the device: not launched on the loop
    reference = await run_all(build_engine("tiny", _options(step_in_thread=False)))
    launches = _count_launches(monkeypatch)
    built = build_engine("tiny", _options(launch_on_loop=True))
    assert await run_all(built) == reference
    assert not launches and not built.runner.decode_path_ready(1)
    graphs = build_engine("tiny", _options(decode_graphs=True)).runner.model.decode_graphs
    assert graphs is not None  # eager on the CPU: nothing to capture first
    assert graphs.ready(1) and graphs.ready(8) and not graphs.ready(9)


def test_launch_on_loop_follows_the_device_unless_asked() -> None:
    assert build_engine("tiny", _options()).engine.config.launch_on_loop is False
    assert build_engine("tiny", _options(launch_on_loop=True)).engine.config.launch_on_loop is True


# --- the read-back and the launched step -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_greedy_readback_on_the_cpu_is_immediate() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, -1.0, 0.5]])
    readback = GreedyReadback(logits)
    assert readback.ready()
    assert await readback.wait(0.001) == [1, 0] == readback.result()
    assert GreedyReadback(torch.empty(0, 3)).result() == []


@pytest.mark.anyio
async def test_run_launched_keeps_the_works_error_and_raises_the_launchs() -> None:
    async def tokens() -> list[int]:
        return [7]

    def failing_work() -> None:
        raise KeyError("work")

    window = OverlapWindow()
    assert await run_launched(lambda: ("launched", tokens), failing_work, window) == ("launched", [7])
    assert isinstance(window.error, KeyError)

    def failing_launch() -> tuple[str, Any]:
        raise ValueError("launch")

    window = OverlapWindow()
    with pytest.raises(ValueError, match="launch"):
        await run_launched(failing_launch, None, window)
    assert window.error is None


# --- CUDA (the lead's machine) ---------------------------------------------------------------------------------


def _cuda_prompts(count: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 199 + 1 for j in range(4 + 5 * i % 23)] for i in range(count)]


async def _serve(
    options: EngineOptions, prompts: Sequence[Sequence[int]]
) -> tuple[list[list[int]], BuiltEngine]:
    built = build_engine("tiny", options)
    out = await run_all(built, prompts, [10 + i % 7 for i in range(len(prompts))])
    return out, built


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.anyio
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_cuda_launches_decode_steps_from_the_loop_with_the_oracle_tokens(
    overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _cuda_prompts(20)
    oracle, _ = await _serve(EngineOptions(dtype="float64", max_running=16, num_pages=256), prompts)
    launches = _count_launches(monkeypatch)
    options = EngineOptions(device="cuda", dtype="float32", max_running=16, num_pages=256, overlap=overlap)
    tokens, built = await _serve(options, prompts)
    assert built.engine.config.launch_on_loop is True  # the default on CUDA
    assert tokens == oracle
    assert launches and _decode_rows(built)["entered"] > 0
    # each bucket's first step (its capture) ran in the worker thread, the later ones were launched
    graphs = built.runner.model.decode_graphs
    assert graphs is not None and graphs.statistics()["captured"]
    assert all(graphs.ready(bucket) for bucket in graphs.statistics()["captured"])
    stats = built.runner.model.statistics()["decode_graphs"]
    assert stats["replays"] > 0 and stats["eager_steps"] == 0


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.anyio
async def test_cuda_steps_in_the_thread_give_the_same_tokens() -> None:
    prompts = _cuda_prompts(12)
    launched, _ = await _serve(EngineOptions(device="cuda", dtype="float32"), prompts)
    threaded, built = await _serve(
        EngineOptions(device="cuda", dtype="float32", launch_on_loop=False), prompts
    )
    assert built.engine.config.launch_on_loop is False
    assert launched == threaded


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.anyio
async def test_cuda_greedy_readback_polls_an_event() -> None:
    logits = torch.randn(96, 5000, device="cuda")
    readback = GreedyReadback(logits)
    assert await readback.wait(0.5) == logits.argmax(dim=-1).tolist()
    assert readback.ready()
    slow = GreedyReadback(torch.randn(64, 4096, device="cuda") @ torch.randn(4096, 4096, device="cuda"))
    assert len(await slow.wait(0.0)) == 64  # past the spin bound: waited for in a worker thread
