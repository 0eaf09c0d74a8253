"""One disaggregated request handed from a context process to a generation process over a real transport,
through the real session protocol, against one contiguous write of the same bytes between the same processes
in the same run (the ceiling).

For one request of ``--preset`` (default nemotron-h-8b, 8K-token prompt, draft KV included) and each TP pair
(``--cases``): the receiver (this process, the generation side) allocates scattered pages, sends a receive
request and waits until every writer reported (and every bounced writer was scattered); the sender (a child
process, the context side) maps, packs (bounce) and writes. Modes (``--modes``):

- ``contiguous`` (always): one write of the same number of bytes from one buffer into one buffer, requested
  and notified the same way: the ceiling;
- ``direct``: the coalesced fragments written straight into the pages (no staging anywhere);
- ``auto``: each side stages only where its own runs look fragmented (``--auto-min-fragments`` /
  ``--auto-max-mean-kib``, a :class:`BouncePolicy`): the sender packs its small runs into its staging and
  writes them into the receiver's runs, or writes its runs into the receiver's staging area, which the
  receiver unpacks chunk by chunk as they land, or both (a bounce), or neither (direct);
- ``bounce``: every writer bounces: the receiver offers staging areas, the sender packs into its staging,
  writes a few large fragments, the receiver unpacks.

The modes run interleaved ``--repeat`` times (default 3) after one checked warm-up each. Per mode:
``<mode>_s`` is the median seconds from sending the request to the last report (``_spread``: ``[min, max]``),
``<mode>_gbps`` the request's bytes over it, ``<mode>_ratio`` the median of each repetition's contiguous
write over its transfer, ``<mode>_ratio_memcpy`` (``_ratio_device_copy`` on CUDA) the same against a copy of
the request's bytes inside the receiver process (:class:`~kvferry.tools.ceiling.CopyCeiling`), timed in each
repetition right before the contiguous write (``copy_s``; ``contiguous_ratio_memcpy`` too). Every mode's receiver bytes are checked against the sender's (a digest of each
writer's bytes in canonical order, computed on each side), after poisoning the receiving pages:
``<mode>_identical``.

    python benchmarks/disagg_2p.py [--device cpu|cuda] [--transport nixl|ucx] [--cases 1-1,2-2,1-2]
        [--modes direct,auto,bounce] [--repeat 3] [--json benchmarks/results/<machine>/disagg_2p.json]
        [--plot FILE.png] [--stages] [--timeline]

``--stages`` records the sender's median time per write stage; ``--timeline`` records both processes' calls
on one clock and prints each mode's median timeline (``_timeline.py``). ``--chunk-mib``, ``--in-flight``,
``--poll-us`` and ``--no-grid-recut`` vary the library's settings.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
import attrs
import numpy as np
import torch
from _provenance import median_spread, write_result
from _timeline import format_rows, summarise, transfer_timeline, write_stages

from kvferry import wire
from kvferry._glibc import reexec_tuned
from kvferry.disagg.mapping import BouncePolicy, MappingStatistics, PeerMap, RequestCache, TokenRange
from kvferry.disagg.protocol import (
    BlockIds,
    PeerInfo,
    PeerRole,
    ReceiveRequest,
    decode_control,
    decode_hello,
    encode_hello,
    reports_of,
)
from kvferry.disagg.session import Receiver, SendSession, send
from kvferry.disagg.staging import StagingPool
from kvferry.disagg.transfer import (
    destinations,
    expected_writers,
    offer_staging,
    plan_transfer,
    prepare_source,
    writer_id,
)
from kvferry.errors import WireFormatError
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.pagetable import PageTable
from kvferry.pools.spec import ModelSpec, preset
from kvferry.tools.ceiling import CopyCeiling
from kvferry.transports import Peer, Transport, get_transport

CASES = [(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 1)]
MODES = ("direct", "auto", "bounce")


def policy_of(mode: str, args: Any) -> BouncePolicy:
    if mode == "direct":
        return BouncePolicy.never()
    if mode == "bounce":
        return BouncePolicy.always()
    return BouncePolicy(args.auto_min_fragments, args.auto_max_mean_kib << 10)


def spec_of(args: Any) -> ModelSpec:
    spec = preset(args.preset)
    if args.dtype:
        spec = spec.with_dtype(getattr(torch, args.dtype))
    return spec


def build_arenas(spec: ModelSpec, tp: int, tokens: int, device: str, seed: int) -> list[CacheArena]:
    """Arenas for one request with 2x the pages it needs (its ids are scattered over them) and 3 slots."""
    assert spec.drafter is not None
    pages = -(-tokens // spec.tokens_per_block) * 2
    draft = -(-tokens // spec.drafter.tokens_per_block) * 2
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for rank in range(tp):
        layout = CacheLayout.build(spec.shard(tp, rank), num_pages=pages, num_slots=3, num_draft_pages=draft)
        arena = CacheArena(layout, device)
        for tensor in arena.pool_tensors().values():
            tensor.random_(0, 256, generator=gen)
        out.append(arena)
    return out


def block_ids(spec: ModelSpec, tokens: int, seed: int) -> dict[str, list[int]]:
    """Odd page ids in shuffled order: never two adjacent pages, never the reserved page 0."""
    assert spec.drafter is not None
    rng = np.random.default_rng(seed)
    n, d = -(-tokens // spec.tokens_per_block), -(-tokens // spec.drafter.tokens_per_block)
    return {
        "attention": (2 * rng.permutation(n) + 1).tolist(),
        "draft": (2 * rng.permutation(d) + 1).tolist(),
    }


def digest(data: torch.Tensor) -> str:
    return hashlib.blake2b(data.cpu().numpy().tobytes(), digest_size=16).hexdigest()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def info(role: PeerRole, transport: Transport, arenas: Sequence[CacheArena]) -> PeerInfo:
    tables = tuple(a.page_table() for a in arenas)
    return PeerInfo(role, "bench", transport.name, transport.address, len(tables), tables)


async def hello(transport: Transport, peer: Peer, local: PeerInfo, inbox: Any = None) -> PeerInfo:
    await transport.send_message(peer, encode_hello(local))
    data = await (transport.receive_message(peer) if inbox is None else inbox.receive())
    return decode_hello(data, wire_version=wire.WIRE_VERSION, compat_hash=local.compat_hash)


def as_json(data: bytes) -> dict[str, Any] | None:
    return json.loads(data) if data[:1] == b"{" else None


# --- the sender (child process) ---------------------------------------------------------------------------


async def sender(args: Any) -> None:
    device = args.device
    async with get_transport(args.transport)() as transport:
        peer = await transport.connect(args.address)
        state: dict[str, Any] = {}
        stages = write_stages(transport) if args.stages else None
        timeline = transfer_timeline(transport) if args.timeline else None
        # every write's own seconds (a write_many counts as one; the rest of ``send`` is the session's
        # bookkeeping and reports)
        writes: list[float] = []

        def timed(call: Any) -> Any:
            async def run(*a: Any, **k: Any) -> Any:
                began = time.perf_counter()
                try:
                    return await call(*a, **k)
                finally:
                    writes.append(time.perf_counter() - began)

            return run

        transport.write = timed(transport.write)  # type: ignore[method-assign]
        transport.write_many = timed(transport.write_many)  # type: ignore[method-assign]
        while True:
            data = await transport.receive_message(peer)
            cmd = as_json(data)
            if cmd is None:
                message = decode_control(data)
                assert isinstance(message, ReceiveRequest), message
                began = time.perf_counter()
                plan = plan_transfer(
                    state["peer_map"],
                    range(state["tp"]),
                    state.pop("source"),
                    1,
                    message,
                    list(state["remote"].page_tables),
                    max_chunk_bytes=(args.chunk_mib << 20) or None,
                    policy=policy_of(message.key, args),  # the receiver names the mode in the request's key
                    src_pools=[a.pool_tensors() for a in state["arenas"]],
                    staging=state["staging"],
                )
                planned = time.perf_counter()
                session = SendSession(message.session_id, plan)
                writes.clear()
                await send(transport, peer, session, max_in_flight=args.in_flight)
                done = time.perf_counter()
                # the next request's side, mapped while its receive request is on its way (as the engine does)
                state["source"] = prepare_source(
                    state["peer_map"], range(state["tp"]), state["blocks"], 1, args.tokens
                )
                stats = session.statistics()
                packed = sum(1 for chunks in plan.values() if chunks and chunks[0].staged is not None)
                await transport.send_message(
                    peer,
                    json.dumps(
                        {
                            "plan_s": planned - began,
                            "send_s": done - planned,
                            "write_s": list(writes),
                            "fragments": stats["fragments"],
                            "packed": packed,
                            "stages": {} if stages is None else stages.durations_us(),
                            "timeline": [] if timeline is None else timeline.take(),
                            "contiguous_timeline": state.pop("contiguous_events", []),
                        }
                    ).encode(),
                )
            elif cmd["op"] == "case":
                # one case per connection: its memory stays registered for the connection's life (NIXL
                # refuses the metadata of regions registered where a deregistered one was, on a live
                # connection); the receiver starts a fresh transport pair and sender process per case
                assert "registrations" not in state, "one case per sender process"
                spec = spec_of(args)
                arenas = build_arenas(spec, cmd["src_tp"], args.tokens, device, seed=1)
                blocks = block_ids(spec, args.tokens, seed=2)
                nbytes = cmd["nbytes"]
                staging = StagingPool.allocate(nbytes + (1 << 20) * cmd["dst_tp"] * cmd["src_tp"], device)
                flat = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
                sync(device)
                registrations = [
                    await transport.register([t for a in arenas for t in a.pool_tensors().values()]),
                    await transport.register([staging.buffer, flat]),
                ]
                remote = await hello(transport, peer, info(PeerRole.CONTEXT, transport, arenas))
                peer_map = PeerMap.build([a.page_table() for a in arenas], list(remote.page_tables))
                # each writer's bytes in canonical order (the receiver digests its side the same way)
                src = RequestCache(blocks, slot=1)
                dst = RequestCache(cmd["dst_blocks"], slot=2)
                span = TokenRange(0, args.tokens)
                digests = {}
                for s in range(cmd["src_tp"]):
                    for d in peer_map.targets(s):
                        p = peer_map.pair(s, d).plan(src, dst, span, policy=BouncePolicy.always())
                        if p.gather is not None:
                            buf = torch.empty(p.nbytes, dtype=torch.uint8, device=device)
                            digests[writer_id(s, d, cmd["dst_tp"])] = digest(
                                p.gather.gather(arenas[s].pool_tensors(), buf)
                            )
                state.update(
                    source=prepare_source(peer_map, range(cmd["src_tp"]), blocks, 1, args.tokens),
                    tp=cmd["src_tp"],
                    arenas=arenas,
                    blocks=blocks,
                    staging=staging,
                    flat=flat,
                    remote=remote,
                    peer_map=peer_map,
                    registrations=registrations,
                )
                await transport.send_message(
                    peer, json.dumps({"digests": digests, "flat": digest(flat)}).encode()
                )
                if timeline is not None:
                    timeline.take()
            elif cmd["op"] == "contiguous":
                one = np.array([[state["flat"].data_ptr(), cmd["nbytes"]]], dtype=np.uint64)
                into = np.array([[cmd["address"], cmd["nbytes"]]], dtype=np.uint64)
                await transport.write(peer, one, into, b"{}")
                if timeline is not None:
                    state["contiguous_events"] = timeline.take()
            elif cmd["op"] == "exit":
                return


# --- the receiver (this process) --------------------------------------------------------------------------


class NoHold:
    def free(self) -> None:
        pass

    def quarantine(self) -> Any:
        return lambda: None


async def run_case(
    transport: Transport, peer: Peer, src_tp: int, dst_tp: int, args: Any, inbox: Any, notes: Any
) -> dict[str, Any]:
    device = args.device
    spec = spec_of(args)
    arenas = build_arenas(spec, dst_tp, args.tokens, device, seed=3)
    blocks = block_ids(spec, args.tokens, seed=4)
    dst = RequestCache(blocks, slot=2)
    span = TokenRange(0, args.tokens)
    # bytes per writer from the receiver's side (the sender's tables arrive with its hello)
    tables = [a.page_table() for a in arenas]
    request_bytes = _request_bytes(spec, src_tp, dst_tp, tables, dst, span)
    staging = StagingPool.allocate(request_bytes + (1 << 20) * src_tp * dst_tp, device)
    flat = torch.zeros(request_bytes, dtype=torch.uint8, device=device)
    ceiling = CopyCeiling(request_bytes, device)
    sync(device)
    # registered for the life of this case's transport (never deregistered on the live connection)
    await transport.register([t for a in arenas for t in a.pool_tensors().values()])
    await transport.register([staging.buffer, flat])
    await transport.send_message(
        peer,
        json.dumps(
            {"op": "case", "src_tp": src_tp, "dst_tp": dst_tp, "nbytes": request_bytes, "dst_blocks": blocks}
        ).encode(),
    )
    remote = await hello(transport, peer, info(PeerRole.GENERATION, transport, arenas), notes.hellos)
    peer_map = PeerMap.build(list(remote.page_tables), tables)
    sums = await inbox.receive()
    # each session grants the sender its request's destinations (as the generation worker does); the
    # contiguous ceiling writes into ``flat``, granted for the case
    receiver = Receiver(
        transport,
        peer,
        expected_writers(peer_map),
        stall_timeout=120,
        destinations=partial(destinations, peer_map),
    )
    await transport.grant(peer, [[flat.data_ptr(), request_bytes]])
    notes.receiver = receiver

    base = ReceiveRequest(
        0,
        "bench",
        0,
        args.tokens,
        tuple(BlockIds(g, tuple(ids)) for g, ids in blocks.items()),
        2,
    )
    pools = [a.pool_tensors() for a in arenas]
    row: dict[str, Any] = {"src_tp": src_tp, "dst_tp": dst_tp, "tokens": args.tokens, "bytes": request_bytes}

    def poison() -> None:
        for tensor in (t for a in arenas for t in a.pool_tensors().values()):
            tensor.random_(0, 256)
        sync(device)

    def check() -> bool:
        ok = True
        for d in range(dst_tp):
            for s in peer_map.expected_writers(d):
                w = str(writer_id(s, d, dst_tp))
                if w not in sums["digests"]:
                    continue
                rx = peer_map.pair(s, d).scatter_plan(dst, span)
                buf = torch.empty(rx.nbytes, dtype=torch.uint8, device=device)
                ok &= digest(rx.gather(pools[d], buf)) == sums["digests"][w]
        return ok

    timeline = transfer_timeline(transport) if args.timeline else None
    # per mode (and "contiguous"): the receiver's events and origin of each timed run (--timeline)
    traced: dict[str, list[tuple[list[Any], float]]] = {}

    def traced_run(mode: str, began: float) -> None:
        if timeline is not None:
            traced.setdefault(mode, []).append((timeline.take(), began))

    async def contiguous() -> float:
        notes.contiguous = anyio.Event()
        if timeline is not None:
            timeline.take()
        began = time.perf_counter()
        await transport.send_message(
            peer,
            json.dumps({"op": "contiguous", "address": flat.data_ptr(), "nbytes": request_bytes}).encode(),
        )
        await notes.contiguous.wait()
        seconds = time.perf_counter() - began
        traced_run("contiguous", began)
        return seconds

    async def transfer(mode: str) -> tuple[float, Any, dict[str, Any]]:
        session_staging = None
        request = attrs.evolve(base, key=mode)
        if timeline is not None:
            timeline.take()
        began = time.perf_counter()
        if mode != "direct":
            request, session_staging = offer_staging(
                peer_map, request, pools, staging, policy=policy_of(mode, args)
            )
        session = receiver.new_session(mode, NoHold(), session_staging)
        request = attrs.evolve(request, session_id=session.session_id)
        stats = await receiver.receive(session, request)
        seconds = time.perf_counter() - began
        traced_run(mode, began)
        assert staging.used == 0, staging
        return seconds, stats, await inbox.receive()

    # correctness first: each mode into poisoned pages, checked against the sender's digests (warms up too)
    await contiguous()
    sync(device)
    row["contiguous_identical"] = digest(flat) == sums["flat"]
    modes = args.modes.split(",")
    for mode in modes:
        poison()
        await transfer(mode)
        row[f"{mode}_identical"] = check()
    # then the timed runs, the modes interleaved so that a noisy neighbour hits all of them alike
    traced.clear()
    times: dict[str, list[float]] = {"copy": [], "contiguous": [], **{m: [] for m in modes}}
    sender: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    last: dict[str, Any] = {}
    for _ in range(args.repeat):
        times["copy"].append(ceiling.seconds())
        times["contiguous"].append(await contiguous())
        for mode in modes:
            seconds, last[mode], note = await transfer(mode)
            times[mode].append(seconds)
            sender[mode].append(note)
    row["copy_s"], row["copy_s_spread"] = median_spread(times["copy"])
    row["copy_gbps"] = request_bytes / row["copy_s"] / 1e9
    for mode in ("contiguous", *modes):
        # per repetition against the copy right before it, then the median
        key = f"{mode}_{ceiling.key}"
        row[key], row[f"{key}_spread"] = median_spread(
            c / t for c, t in zip(times["copy"], times[mode], strict=True)
        )
        seconds, spread = median_spread(times[mode])
        row[f"{mode}_s"] = seconds
        row[f"{mode}_s_spread"] = spread
        row[f"{mode}_gbps"] = request_bytes / seconds / 1e9
        row[f"{mode}_gbps_spread"] = [request_bytes / spread[1] / 1e9, request_bytes / spread[0] / 1e9]
    for mode in modes:
        # per repetition against the contiguous write right before it, then the median
        row[f"{mode}_ratio"], row[f"{mode}_ratio_spread"] = median_spread(
            c / t for c, t in zip(times["contiguous"], times[mode], strict=True)
        )
        # the same without the sender's mapping (done once per request, before any byte moves)
        row[f"{mode}_ratio_without_mapping"] = statistics.median(
            c / (t - note["plan_s"])
            for c, t, note in zip(times["contiguous"], times[mode], sender[mode], strict=True)
        )
        row[f"{mode}_posted_fragments"] = last[mode].fragments
        row[f"{mode}_chunks"] = last[mode].chunks
        row[f"{mode}_bounced_writers"] = last[mode].bounced  # through the receiver's staging
        row[f"{mode}_packed_writers"] = statistics.median(x["packed"] for x in sender[mode])
        row[f"{mode}_sender_plan_ms"] = 1e3 * statistics.median(x["plan_s"] for x in sender[mode])
        row[f"{mode}_sender_send_ms"] = 1e3 * statistics.median(x["send_s"] for x in sender[mode])
        row[f"{mode}_sender_longest_write_ms"] = 1e3 * statistics.median(
            max(x["write_s"], default=0.0) for x in sender[mode]
        )
        row[f"{mode}_sender_writes_ms"] = 1e3 * statistics.median(sum(x["write_s"]) for x in sender[mode])
        if timeline is not None:
            # the contiguous write's sender events come with the note of the transfer after it
            row[f"{mode}_timeline"] = _merged(traced[mode], [x["timeline"] for x in sender[mode]])
            if mode == modes[0]:
                row["contiguous_timeline"] = _merged(
                    traced["contiguous"], [x["contiguous_timeline"] for x in sender[mode]]
                )
                print(f"tp {src_tp}->{dst_tp} contiguous (us from the request; start end took):", flush=True)
                print(format_rows(row["contiguous_timeline"]), flush=True)
            print(f"tp {src_tp}->{dst_tp} {mode} (us from the request; start end took):", flush=True)
            print(format_rows(row[f"{mode}_timeline"]), flush=True)
        if sender[mode][-1]["stages"]:
            # the sender's stages (medians over this case's writes so far, microseconds; --stages)
            row[f"{mode}_sender_stages_us"] = sender[mode][-1]["stages"]
    mapping = MappingStatistics.total(
        peer_map.pair(s, d)
        .plan(RequestCache(block_ids(spec, args.tokens, seed=2), slot=1), dst, span, policy=BouncePolicy())
        .statistics
        for s in range(src_tp)
        for d in peer_map.targets(s)
    )
    row.update(
        units=mapping.units,
        fragments=mapping.fragments,
        auto_bounce_writers=mapping.bounced,
        writers=len(expected_writers(peer_map)),
    )
    row["scatter_fragments"] = sum(
        peer_map.pair(s, d).scatter_plan(dst, span).num_fragments
        for d in range(dst_tp)
        for s in peer_map.expected_writers(d)
        if peer_map.writes(s, d)
    )
    return row


def _merged(receiver: list[tuple[list[Any], float]], sender: list[list[Any]]) -> list[dict[str, Any]]:
    """One timeline per run from both processes' events (one clock), summarised over the runs."""
    runs = [
        [("R " + e[0], e[1], e[2]) for e in r_events] + [("S " + e[0], e[1], e[2]) for e in s_events]
        for (r_events, _), s_events in zip(receiver, sender, strict=True)
    ]
    return summarise(runs, [origin for _, origin in receiver])


def _request_bytes(
    spec: ModelSpec, src_tp: int, dst_tp: int, dst_tables: list[Any], dst: RequestCache, span: TokenRange
) -> int:
    """Bytes of the request over every writer, from page tables of a throwaway sender layout."""
    src_tables = []
    for r in range(src_tp):
        layout = CacheLayout.build(spec.shard(src_tp, r), num_pages=2, num_slots=3, num_draft_pages=2)
        bases = {}
        offset = 1 << 40
        for group in layout.pool_groups:
            for pool in group.pools:
                bases[pool.name] = offset
                offset += 1 << 36
        src_tables.append(PageTable.from_layout(layout, bases))
    peer_map = PeerMap.build(src_tables, dst_tables)
    return sum(peer_map.pair(s, d).nbytes(dst, span) for s in range(src_tp) for d in peer_map.targets(s))


async def receiver_main(args: Any) -> dict[str, Any]:
    results = []
    cases = [tuple(int(x) for x in c.split("-")) for c in args.cases.split(",")]
    for src_tp, dst_tp in cases:
        # a fresh transport pair (and sender process) per case: each case allocates new arenas and staging,
        # and re-registering memory on a live connection is what NIXL refuses
        row = await _one_case(args, src_tp, dst_tp)
        results.append(row)
        modes = args.modes.split(",")
        copy = "ratio_memcpy" if args.device == "cpu" else "ratio_device_copy"
        parts = " | ".join(
            f"{m} {row[f'{m}_s'] * 1e3:.3f} ms, {row[f'{m}_gbps']:.2f} GB/s ({row[f'{m}_ratio']:.2f} of contiguous, "
            f"{row[f'{m}_{copy}']:.2f} of {copy[6:]}, {row[f'{m}_posted_fragments']} "
            f"fragments in {row[f'{m}_chunks']} writes, plan {row[f'{m}_sender_plan_ms']:.2f} ms)"
            for m in modes
        )
        identical = row["contiguous_identical"] and all(row[f"{m}_identical"] for m in modes)
        print(
            f"tp {src_tp}->{dst_tp}: {row['bytes'] / 1e6:.0f} MB, fragments {row['fragments']}, "
            f"{copy[6:]} {row['copy_s'] * 1e3:.3f} ms, contiguous {row['contiguous_s'] * 1e3:.3f} ms "
            f"{row['contiguous_gbps']:.2f} GB/s ({row[f'contiguous_{copy}']:.2f}) | {parts} | identical {identical}",
            flush=True,
        )
    return {"results": results}


async def _one_case(args: Any, src_tp: int, dst_tp: int) -> dict[str, Any]:
    async with get_transport(args.transport)() as transport:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        child = subprocess.Popen(  # noqa: ASYNC220 (started once per case, before any transfer)
            [
                sys.executable,
                __file__,
                "--role",
                "sender",
                "--address",
                transport.address,
                *[a for a in sys.argv[1:] if a not in ("--role",)],
            ],
            env=env,
        )
        try:
            peer = await transport.accept()
            send_inbox, inbox = anyio.create_memory_object_stream[dict[str, Any]](16)
            send_hellos, hellos = anyio.create_memory_object_stream[bytes](4)

            class Notes:
                contiguous = anyio.Event()
                receiver: Receiver | None = None

            Notes.hellos = hellos  # type: ignore[attr-defined]

            notes = Notes()

            async def messages() -> None:
                while True:
                    data = await transport.receive_message(peer)
                    cmd = as_json(data)
                    if cmd is not None:
                        await send_inbox.send(cmd)
                        continue
                    try:
                        message = decode_control(data)
                    except WireFormatError:  # the sender's hello
                        await send_hellos.send(data)
                        continue
                    if notes.receiver is not None:
                        for report in reports_of(message):
                            notes.receiver.on_result(report)

            async def notifications() -> None:
                while True:
                    data = await transport.receive_notification(peer)
                    if data[:1] == b"{":
                        notes.contiguous.set()
                        continue
                    message = decode_control(data)
                    if notes.receiver is not None:
                        for report in reports_of(message):
                            notes.receiver.on_result(report)

            async with anyio.create_task_group() as tg:
                tg.start_soon(messages)
                tg.start_soon(notifications)
                row = await run_case(transport, peer, src_tp, dst_tp, args, inbox, notes)
                await transport.send_message(peer, json.dumps({"op": "exit"}).encode())
                tg.cancel_scope.cancel()
        finally:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
    return row


def plot(out: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["results"]
    labels = [f"{r['src_tp']}->{r['dst_tp']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    modes = [m for m in MODES if f"{m}_ratio" in rows[0]]
    width = 0.8 / len(modes)
    colors = {"direct": "tab:blue", "auto": "tab:green", "bounce": "tab:orange"}
    for i, mode in enumerate(modes):
        values = [r[f"{mode}_ratio"] for r in rows]
        bars = ax.bar(x + (i - (len(modes) - 1) / 2) * width, values, width, label=mode, color=colors[mode])
        for bar, r in zip(bars, rows, strict=True):
            ax.annotate(
                f"{r[f'{mode}_gbps']:.2f}\n{r[f'{mode}_posted_fragments']}f",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.axhline(0.7, color="green", ls="--", lw=0.8, label="goal same TP")
    ax.axhline(0.6, color="red", ls=":", lw=0.8, label="goal mismatched TP")
    ax.set_xticks(x, labels)
    ax.set_xlabel("TP sender -> receiver")
    ax.set_ylabel("ratio to one contiguous write")
    config = out["config"]
    ax.set_title(
        f"{config['preset']} {config['tokens']}-token request, {config['transport']} two processes, "
        f"{config['device']}"
        f" (labels: GB/s, fragments)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _library_constants(name: str) -> dict[str, Any]:
    """Every loaded kvferry module's own ``name`` (a setting such as ``POLL_SECONDS``), by module: a package
    that re-exports a setting holds a copy, so a change must reach the module that reads it."""
    return {
        module_name: getattr(module, name)
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("kvferry") and name in getattr(module, "__dict__", {})
    }


def _set_library_constant(name: str, value: Any) -> None:
    """Set the library setting ``name`` in every kvferry module that holds it (see :func:`_library_constants`),
    the kernels' and transports' modules loaded first."""
    import importlib
    import pkgutil

    import kvferry.kernels
    import kvferry.transports

    for package in (kvferry.kernels, kvferry.transports):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            with contextlib.suppress(ImportError):
                importlib.import_module(info.name)
    holders = _library_constants(name)
    if not holders:
        raise SystemExit(f"disagg_2p.py: no kvferry module has {name} any more")
    for module_name in holders:
        setattr(sys.modules[module_name], name, value)


def _poll_seconds() -> float | None:
    """The poll budget the run used (read after the run, when the transports' modules are loaded)."""
    return next(iter(_library_constants("POLL_SECONDS").values()), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="nemotron-h-8b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument(
        "--dtype", default="", help="cache dtype override (e.g. float16); default the preset's"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="nixl")
    parser.add_argument("--cases", default=",".join(f"{a}-{b}" for a, b in CASES))
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed repetitions of every mode (median, spread)"
    )
    parser.add_argument(
        "--chunk-mib",
        type=int,
        default=0,
        help="MiB per write (and per report); 0: plan_transfer's default (one write per direct writer, "
        "16 MiB chunks where staged)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    default = BouncePolicy()
    parser.add_argument(
        "--auto-min-fragments",
        type=int,
        default=default.min_fragments,
        help="auto mode's BouncePolicy (default: the library's, what the engine roles use)",
    )
    parser.add_argument(
        "--auto-max-mean-kib", type=int, default=default.max_mean_bytes >> 10, help="auto mode's BouncePolicy"
    )
    parser.add_argument("--in-flight", type=int, default=4, help="writes in flight per writer")
    parser.add_argument(
        "--poll-us",
        type=float,
        default=None,
        help="longest poll of a CUDA copy's end on the event loop before waiting in a worker thread "
        "(default: the library's; 0 always waits in a thread)",
    )
    parser.add_argument(
        "--stages", action="store_true", help="time the sender's write stages (see _timeline.py)"
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="record both processes' calls on one clock and print each mode's median timeline",
    )
    parser.add_argument(
        "--no-grid-recut",
        action="store_true",
        help="indexed tables of mixed row lengths keep the default cut (the span copy's GRID_RECUT off)",
    )
    parser.add_argument("--json", default=None, help="write the stamped result here")
    parser.add_argument("--plot", default=None, help="draw each mode's ratio into this PNG (matplotlib)")
    parser.add_argument("--role", default="receiver", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    reexec_tuned()  # host copies of fragments near a memcpy, as the kvferry command runs (kvferry._glibc)
    torch.set_num_threads(1)
    if args.poll_us is not None:
        _set_library_constant("POLL_SECONDS", args.poll_us * 1e-6)
    if args.no_grid_recut:
        _set_library_constant("GRID_RECUT", False)
    if args.role == "sender":
        anyio.run(sender, args)
        return 0
    results = anyio.run(receiver_main, args)
    config = {
        "preset": args.preset,
        "tokens": args.tokens,
        "device": args.device,
        "transport": args.transport,
        "cases": args.cases,
        "modes": args.modes,
        "repeat": args.repeat,
        "chunk_bytes": args.chunk_mib << 20,  # 0: plan_transfer's default
        "in_flight": args.in_flight,
        "poll_seconds": _poll_seconds(),
        "auto_policy": {
            "min_fragments": args.auto_min_fragments,
            "max_mean_bytes": args.auto_max_mean_kib << 10,
        },
        "grid_recut": not args.no_grid_recut,
        "statistic": "median seconds from sending the request to the last report (+ scatter) over --repeat "
        "repetitions ([min, max] in _spread); ratio: per repetition the contiguous write's seconds over the "
        "mode's, then the median; the sender maps its side of each request before the request comes "
        "(prepare_source, as the engine's context side does)",
        "ceiling": "one contiguous write of the request's bytes between the same processes, requested and "
        "notified the same way, right before each repetition; and a copy of the same bytes inside the receiver "
        "process (memcpy on the host, copy_ on CUDA) right before that (ratio_memcpy / ratio_device_copy)",
    }
    out = {"config": config, **results}
    if args.json:
        write_result(args.json, "disagg_2p", out, args.device)
    if args.plot:
        plot(out, args.plot)
    ok = all(
        r["contiguous_identical"] and all(r[f"{m}_identical"] for m in args.modes.split(","))
        for r in out["results"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
