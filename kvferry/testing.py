"""A pytest plugin: running engines as fixtures, for pytest-asyncio and for anyio's pytest plugin alike.

Installed as the ``pytest11`` entry point ``kvferry.testing`` (or load it with ``-p kvferry.testing``). It
gives two async fixtures:

``kvferry_engine``
    a running :class:`~kvferry.engine.engine.Engine` of :func:`~kvferry.engine.runner.build_engine`;
    options by marker or by indirect parameter (both take ``model`` and any
    :class:`~kvferry.engine.runner.EngineOptions` field)::

        @pytest.mark.asyncio  # or @pytest.mark.anyio
        @pytest.mark.kvferry_engine(tp=2, max_spec_k=2)
        async def test_it(kvferry_engine):
            tokens = await kvferry_engine.generate([1, 2, 3], max_tokens=4, spec_k=2).collect()

``kvferry_pair``
    a context and a generation engine connected over a transport, as :class:`Pair` (``pair.generate(...)``
    routes a request: prefill on the context engine, its cache moved, decode on the generation engine);
    options: ``transport`` (default ``"local"``), ``ctx_tp``, ``gen_tp``, ``spec_k``, ``seed``, ``dtype``
    (default ``"float64"``), ``separate_process`` (the context engine in another OS process; default
    False) and what else :func:`~kvferry.disagg.serve.disaggregated` takes::

        @pytest.mark.parametrize("kvferry_pair", [{"ctx_tp": 1, "gen_tp": 2}], indirect=True)
        async def test_pair(kvferry_pair): ...

An async fixture's setup and teardown run in different tasks (pytest-asyncio runs each in a task of its own):
engines are safe to enter and leave in different tasks, and the pair is entered and left by a task the
fixture owns.

Under pytest-asyncio in strict mode the fixtures are asyncio fixtures; a test that requests ``anyio_backend``
(marked ``@pytest.mark.anyio``) gets them from anyio's plugin instead, on that test's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from attrs import define

if TYPE_CHECKING:
    from kvferry.disagg.roles import GenerationWorker
    from kvferry.disagg.router import RoutedGeneration, Router
    from kvferry.engine.engine import Engine
    from kvferry.engine.runner import BuiltEngine

__all__ = ["Pair", "held", "kvferry_engine", "kvferry_pair"]

#: defaults of kvferry_pair's options
PAIR_DEFAULTS: dict[str, Any] = {
    "transport": "local",
    "ctx_tp": 1,
    "gen_tp": 1,
    "spec_k": 0,
    "seed": 0,
    "dtype": "float64",
    "separate_process": False,
}


@define(eq=False)
class Pair:
    """A context engine and a generation engine, connected; :meth:`generate` routes a request through both."""

    router: Router
    #: the generation side: its engine and the worker that receives caches
    gen: BuiltEngine
    worker: GenerationWorker
    #: the context side: a ContextWorker in this process, or a ContextProcess
    context: Any
    #: the context side's engine when it runs in this process (else None)
    ctx: BuiltEngine | None
    transport: str
    ctx_tp: int
    gen_tp: int
    spec_k: int

    def generate(self, prompt_ids: Any, **kwargs: Any) -> RoutedGeneration:
        """:meth:`Router.generate <kvferry.disagg.router.Router.generate>`."""
        return self.router.generate(prompt_ids, **kwargs)


class _Held:
    """An async context manager entered and left by a task of its own (see :func:`held`)."""

    def __init__(self, manager: AbstractAsyncContextManager[Any]) -> None:
        self.manager = manager
        self.value: Any = None
        self.error: BaseException | None = None
        self.entered = anyio.Event()
        self.stop = anyio.Event()
        self.done = anyio.Event()
        self.task: object = None

    async def run(self) -> None:
        from kvferry.engine.engine import unwrap_group

        try:
            async with self.manager as value:
                self.value = value
                self.entered.set()
                await self.stop.wait()
        except Exception as exc:
            self.error = unwrap_group(exc)
        finally:
            self.entered.set()
            self.done.set()

    async def close(self) -> None:
        self.stop.set()
        with anyio.CancelScope(shield=True):
            await self.done.wait()


async def held(manager: AbstractAsyncContextManager[Any]) -> AsyncIterator[Any]:
    """Yield what ``manager`` gives, having entered it in a task this generator owns, and leave it there: the
    caller may resume this generator from another task (as async fixtures are torn down). Errors of entering
    or leaving are raised to the caller."""
    from kvferry.engine.engine import start_owned_task

    holder = _Held(manager)
    holder.task = start_owned_task(holder.run)
    try:
        await holder.entered.wait()
    except BaseException:
        await holder.close()
        raise
    if holder.error is not None:
        await holder.close()
        raise holder.error
    try:
        yield holder.value
    finally:
        await holder.close()
    if holder.error is not None:
        raise holder.error


def _options(request: pytest.FixtureRequest, name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """Defaults, then the closest ``@pytest.mark.<name>(...)``, then an indirect parameter (a dict)."""
    options = dict(defaults)
    marker = request.node.get_closest_marker(name)
    if marker is not None:
        if marker.args:
            raise pytest.UsageError(f"@pytest.mark.{name} takes keyword arguments only, got {marker.args!r}")
        options.update(marker.kwargs)
    param = getattr(request, "param", None)
    if param is not None:
        if not isinstance(param, dict):
            raise pytest.UsageError(f"{name}: an indirect parameter is a dict of options, got {param!r}")
        options.update(param)
    return options


async def _engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    import attrs

    from kvferry.engine.runner import EngineOptions, build_engine

    options = _options(request, "kvferry_engine", {"model": "tiny"})
    model = options.pop("model")
    fields = {f.name for f in attrs.fields(EngineOptions)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise pytest.UsageError(
            f"kvferry_engine: unknown options {unknown}; EngineOptions has {sorted(fields)}"
        )
    built = build_engine(model, EngineOptions(**options))
    async with built.engine as engine:
        yield engine


async def _pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    from contextlib import asynccontextmanager

    from kvferry.disagg.serve import disaggregated

    options = _options(request, "kvferry_pair", PAIR_DEFAULTS)

    @asynccontextmanager
    async def pair() -> AsyncIterator[Pair]:
        async with disaggregated(**options) as (router, parts):
            yield Pair(
                router=router,
                gen=parts["gen"],
                worker=parts["worker"],
                context=parts["context"],
                ctx=parts.get("ctx"),
                transport=parts["transport"].name,
                ctx_tp=options["ctx_tp"],
                gen_tp=options["gen_tp"],
                spec_k=options["spec_k"],
            )

    async for value in held(pair()):
        yield value


def _asyncio_fixture(function: Any) -> Any:
    # what @pytest_asyncio.fixture marks, without importing pytest-asyncio (it may not be installed)
    function._force_asyncio_fixture = True
    function._loop_scope = None
    function._kvferry_fixture = True
    return function


# the fixtures (their names are what tests request)
kvferry_engine = pytest.fixture(_asyncio_fixture(_engine), name="kvferry_engine")
kvferry_pair = pytest.fixture(_asyncio_fixture(_pair), name="kvferry_pair")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kvferry_engine(model='tiny', **EngineOptions fields): options of the kvferry_engine fixture",
    )
    config.addinivalue_line(
        "markers",
        "kvferry_pair(transport='local', ctx_tp=1, gen_tp=1, spec_k=0, ...): options of the kvferry_pair fixture",
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, Any, Any]:
    """For a test that runs under anyio's plugin (it requests ``anyio_backend``), hide our fixtures' asyncio mark
    while they are set up, so that pytest-asyncio leaves them to anyio (on the test's own event loop)."""
    function = fixturedef.func
    if getattr(function, "_kvferry_fixture", False) and "anyio_backend" in request.fixturenames:
        function._force_asyncio_fixture = False
        try:
            return (yield)
        finally:
            function._force_asyncio_fixture = True
    return (yield)
