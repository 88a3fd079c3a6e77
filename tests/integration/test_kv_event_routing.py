"""KV-event routing over pools of 2 prefill + 2 decode in-process workers: disaggregated equals colocated token for
token; 4 tenants × 4 shared prefixes go to the worker that holds them (hit rate asserted); a restarted worker (new
epoch) is recovered from without a second request on a stale belief; an injected gap triggers a resync; a worker
that stops publishing counts as empty."""

from __future__ import annotations

import asyncio

from tests.integration.gateway_harness import checkpoint_fixture
from gateway.kv_events import SubscriberConfig
from gateway.mesh_client import MeshClient, PDDecider
from tests.integration.kv_pools import (FAST_STALE, PREFIX_TOKENS, SUFFIX_TOKENS, ask, families, settle, spy_picks,
                                        start_worker, subscribed_client)
from tests.integration.mesh_harness import Mesh, run_bounded

tiny_k3 = checkpoint_fixture("tiny-k3", "tiny-k3", seed=3)


async def _affinity_round(client, fams, servers, router, round_: int) -> list:
    """One request per family, one after another; -> [(family index, pick, run)]."""
    picks = spy_picks(router)
    out = []
    for i, family in enumerate(fams):
        run = await ask(client, family, round_)
        await settle(client, servers)
        out.append((i, picks[-1], run))
    return out


async def _check_affinity(client, fams, servers, router, holders: dict) -> float:
    """Every family's later requests go to the worker that served (and so holds) its first one, predicted and
    served as a whole-prefix hit; -> the hit rate (cached / prompt tokens) of those requests."""
    cached = total = 0
    for round_ in (1, 2):
        for i, pick, run in await _affinity_round(client, fams, servers, router, round_):
            assert pick.address == holders[i], f"family {i} left its worker in round {round_}"
            assert pick.cached_tokens == PREFIX_TOKENS, (i, pick)
            assert run.usage.cached_tokens >= PREFIX_TOKENS, (i, run.usage)
            cached, total = cached + run.usage.cached_tokens, total + run.usage.prompt_tokens
    return cached / total


def test_pools_disaggregated_equals_colocated_and_prefix_families_stick(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            prefill2, p2 = await start_worker(mesh, "prefill", tiny_k3)
            decode2, d2 = await start_worker(mesh, "decode", tiny_k3)
            servers = {mesh.prefill_address: mesh.prefill_server, p2: prefill2,
                       mesh.decode_address: mesh.decode_server, d2: decode2}
            decoders, prefillers = [mesh.decode_address, d2], [mesh.prefill_address, p2]
            remote, local = subscribed_client(decoders, prefillers), subscribed_client(decoders)
            try:
                fams = families()
                await settle(remote, servers)
                # disaggregated == colocated, token for token (negative control: another suffix changes the output)
                others = families(seed=1)[:4]  # not the affinity workload's families
                for family in others:
                    a, b = await ask(remote, family, 0, max_tokens=8), await ask(local, family, 0, max_tokens=8)
                    assert a.route == "remote" and b.route == "local" and a.ids == b.ids and len(a.ids) == 8
                assert (await ask(local, family, 9, max_tokens=8)).ids != b.ids  # the comparison can fail
                # the first requests of the 16 families at once: load spreads them over both prefill workers
                picks = spy_picks(remote.prefill_router)
                await asyncio.gather(*(ask(remote, f, 0) for f in fams))
                await settle(remote, servers)
                holders = {}
                for i, family in enumerate(fams):  # who holds each family now (the index says it)
                    (holder,) = [a for a in prefillers if remote.prefill_router.index(a).cached_tokens(
                        remote.prompt_key(_request(family))) == PREFIX_TOKENS]
                    holders[i] = holder
                assert len(set(holders.values())) == 2 and {p.address for p in picks} == set(prefillers)
                hit_rate = await _check_affinity(remote, fams, servers, remote.prefill_router, holders)
                assert hit_rate >= PREFIX_TOKENS / (PREFIX_TOKENS + 8) - 1e-9
                assert remote.stats.stale_beliefs == 0
            finally:
                await remote.close()
                await local.close()
                await prefill2.stop(0)
                await decode2.stop(0)
    run_bounded(main(), timeout_s=240)


def _request(family):
    from gateway.mesh_client import MeshRequest
    from tests.integration.mesh_harness import greedy

    return MeshRequest(request_id="k", prompt_token_ids=tuple(family.prompt(0)), sampling=greedy(1),
                       tenant_salt=family.tenant_salt)


def _holder(client, family, addresses):
    key = client.prompt_key(_request(family))
    return [a for a in addresses if client.decode_router.index(a).cached_tokens(key) == PREFIX_TOKENS]


async def _injected_gap_resyncs(client, servers, fams, a) -> None:
    """One batch of `a`'s events is dropped on its way in: the next message shows the gap and `a` resyncs."""
    router, dropped = client.decode_router, []
    original = router.apply_kv_event

    def lossy(address, message):
        if address == a and not dropped and message.WhichOneof("body") == "events" and message.events.events:
            dropped.append(message.sequence)
            return "applied"  # lost: never reaches the index
        return original(address, message)

    router.apply_kv_event = lossy
    resyncs = client.subscribers[a].resyncs
    family = next(f for f in fams if _holder(client, f, [a]))
    await ask(client, family, 5, max_tokens=40)  # new (output) blocks on `a`: a batch, which is dropped
    await settle(client, servers)
    router.apply_kv_event = original
    assert dropped and client.subscribers[a].resyncs == resyncs + 1
    index, publisher = router.index(a), servers[a].kv_events
    assert index.blocks == publisher._blocks and index.snapshots == publisher._snapshots  # rebuilt exactly


async def _restart_recovers(client, servers, fams, mesh, tiny_k3, b) -> None:
    """`b` restarts (empty cache, new epoch) and its families are asked for at once, before the gateway may have
    heard: at most one request goes out on the old belief (promising more cached tokens than were served), and the
    next requests of those families hit again wherever they went."""
    moved = [f for f in fams if _holder(client, f, [b])]
    old_epoch = servers[b].kv_events.epoch
    await servers[b].stop(0)
    servers[b], _ = await start_worker(mesh, "decode", tiny_k3, address=b)
    picks = spy_picks(client.decode_router)
    runs = []
    for round_ in (6, 7):
        for family in moved:
            runs.append(await ask(client, family, round_))
        await settle(client, servers)
    stale = [p for p, run in zip(picks, runs) if p.cached_tokens > run.usage.cached_tokens]
    assert len(stale) <= 1 and client.stats.stale_beliefs <= 1, stale
    assert all(run.usage.cached_tokens >= PREFIX_TOKENS for run in runs[len(moved):]), "routing did not recover"
    assert client.decode_router.index(b).epoch == servers[b].kv_events.epoch != old_epoch


async def _silent_worker_is_empty(client, servers, fams, a) -> None:
    family = next(f for f in fams if _holder(client, f, [a]))
    servers[a].kv_events._task.cancel()  # the worker stops publishing (its stream stays open)
    key = client.prompt_key(_request(family))
    async with asyncio.timeout(FAST_STALE * 4):
        while client.decode_router.index(a).live:
            await asyncio.sleep(0.05)
    assert client.decode_router.index(a).cached_tokens(key) == 0
    assert all(p.cached_tokens == 0 for p in client.decode_router.costs(key) if p.address == a)


def test_event_stream_faults_restart_gap_and_silence(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh:
            second, d2 = await start_worker(mesh, "decode", tiny_k3)
            a, b = mesh.decode_address, d2
            servers = {a: mesh.decode_server, b: second}
            client = subscribed_client([a, b], stale_after_s=FAST_STALE)
            try:
                fams = families(tenants=2, prefixes=4)
                await settle(client, servers)
                await asyncio.gather(*(ask(client, f, 0) for f in fams))
                await settle(client, servers)
                assert all(len(_holder(client, f, [a, b])) == 1 for f in fams)
                assert {_holder(client, f, [a, b])[0] for f in fams} == {a, b}
                await _injected_gap_resyncs(client, servers, fams, a)
                await _restart_recovers(client, servers, fams, mesh, tiny_k3, b)
                await _silent_worker_is_empty(client, servers, fams, a)
            finally:
                await client.close()
                for server in servers.values():
                    if server is not mesh.decode_server:
                        await server.stop(0)
    run_bounded(main(), timeout_s=240)


async def _until_the_cache_service_holds(client, family, reader_address) -> None:
    key = client.prompt_key(_request(family))
    async with asyncio.timeout(10):
        while client.cache_view.index.cached_tokens(key, client.decode_router.index(reader_address)) < PREFIX_TOKENS:
            await asyncio.sleep(0.02)


def test_a_prefix_only_the_cache_service_holds_goes_colocated_and_hits(tiny_k3):
    """After a remote prefill, the decode worker holds the prefix's blocks but no snapshot at its end (it imported a
    handoff), the cache service holds both (prefill published them): with the cache service's events the next
    request of the family is colocated and the decode worker imports the prefix (a whole-prefix hit); without them
    (the negative control) the gateway sees nothing reusable and prefills remotely again."""
    async def main():
        async with Mesh(tiny_k3) as mesh:
            servers = {mesh.prefill_address: mesh.prefill_server, mesh.decode_address: mesh.decode_server}
            decider = PDDecider(min_uncached_tokens=SUFFIX_TOKENS + 1)
            config = SubscriberConfig(stale_after_s=3.0, retry_s=0.05, max_retry_s=0.2)
            with_cache = MeshClient([mesh.decode_address], [mesh.prefill_address], decider,
                                    subscriber_config=config,
                                    cache_address=mesh.cache_address)
            without = MeshClient([mesh.decode_address], [mesh.prefill_address], decider, subscriber_config=config)
            with_cache.start_kv_events()
            without.start_kv_events()
            try:
                first, second = families(tenants=2, prefixes=1)
                await settle(with_cache, servers)
                cold = await ask(with_cache, first, 0)
                assert cold.route == "remote" and cold.usage.cached_tokens == 0
                await _until_the_cache_service_holds(with_cache, first, mesh.decode_address)
                await settle(with_cache, servers)
                pick = with_cache.decode_router.pick(with_cache.prompt_key(_request(first)))
                assert (pick.local_tokens, pick.transfer_tokens) == (0, PREFIX_TOKENS)  # the hit rule: no snapshot
                loads = mesh.decode_server.worker.counters.remote_loads
                warm = await ask(with_cache, first, 1)
                assert warm.route == "local" and warm.usage.cached_tokens >= PREFIX_TOKENS
                assert mesh.decode_server.worker.counters.remote_loads == loads + 1  # imported, not computed
                assert with_cache.stats.stale_beliefs == 0
                # negative control: another family, same path, a gateway that does not follow the cache service
                assert (await ask(without, second, 0)).route == "remote"
                await _until_the_cache_service_holds(with_cache, second, mesh.decode_address)
                await settle(without, servers)
                assert (await ask(without, second, 1)).route == "remote"
            finally:
                await with_cache.close()
                await without.close()
    run_bounded(main(), timeout_s=240)
