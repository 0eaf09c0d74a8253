"""What a user writes with the kvferry.testing plugin (run by tests/test_testing_plugin.py in a pytest of its
own: the file name keeps this suite from collecting it)."""

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvferry import Engine, build_engine
from kvferry.engine.runner import LockstepCache
from kvferry.testing import Pair


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[Engine]:
    # the pattern a user writes first
    async with build_engine("tiny").engine as e:
        yield e


@pytest.mark.asyncio
async def test_user_fixture(engine: Engine) -> None:
    assert len(await engine.generate([1, 2, 3], max_tokens=3).collect()) == 3


@pytest.mark.asyncio
async def test_engine_asyncio(kvferry_engine: Engine) -> None:
    assert len(await kvferry_engine.generate([1, 2, 3], max_tokens=3).collect()) == 3


@pytest.mark.anyio
@pytest.mark.kvferry_engine(tp=2, max_spec_k=2)
async def test_engine_anyio(kvferry_engine: Engine) -> None:
    tokens = await kvferry_engine.generate([1, 2, 3], max_tokens=4, spec_k=2).collect()
    cache = kvferry_engine.cache
    assert len(tokens) == 4 and isinstance(cache, LockstepCache) and len(cache.managers) == 2


@pytest.mark.asyncio
@pytest.mark.kvferry_pair(ctx_tp=1, gen_tp=2, spec_k=2)
async def test_pair_asyncio_marker(kvferry_pair: Pair) -> None:
    assert (kvferry_pair.ctx_tp, kvferry_pair.gen_tp, kvferry_pair.transport) == (1, 2, "local")
    g = kvferry_pair.generate([5, 6, 7, 8, 9], max_tokens=4, spec_k=2)
    assert len(await g.collect()) == 4 and g.transfer is not None


@pytest.mark.anyio
@pytest.mark.parametrize("kvferry_pair", [{"ctx_tp": 2, "gen_tp": 1}], indirect=True)
async def test_pair_anyio_indirect(kvferry_pair: Pair) -> None:
    assert (kvferry_pair.ctx_tp, kvferry_pair.gen_tp) == (2, 1)
    assert len(await kvferry_pair.generate([1, 2, 3], max_tokens=3).collect()) == 3
