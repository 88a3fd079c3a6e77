"""Disaggregated serving with other handoff formats: an FP8 latent cache on both workers, and handoffs bigger than
one cache object (stored as a manifest and parts). Same harness and reference as tests/integration/
test_disaggregated.py: the colocated run is the same decode worker prefilling locally."""

from __future__ import annotations

from cache_service.objects import Status
import pytest

from tests.integration.mesh_harness import Mesh, greedy, prompt_suite, tiny_k3_checkpoint
from tests.integration.test_disaggregated import _suite_with_remote_reuse, run


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


def test_disaggregated_fp8_cache_equals_colocated_fp8(tiny_k3):
    """`--kv-cache-dtype fp8` on both workers: the FP8 latent rows travel as they are (handoffs, blocks, snapshots)."""
    async def main():
        async with Mesh(tiny_k3, engine={"kv_cache_dtype": "fp8"}) as mesh:
            assert mesh.decode_server.engine.core.plan.kv_cache_dtype == "fp8"
            await _suite_with_remote_reuse(mesh)
    run(main())


def test_handoff_bigger_than_the_part_limit_travels_in_parts(tiny_k3):
    """A handoff over --handoff-part-bytes (here 4 KiB, under a 16 KiB object cap) is stored as a manifest and parts,
    none over the cap, and continues exactly like colocated; a missing part makes decode recompute (negative
    control: the parts are really read)."""
    async def main():
        async with Mesh(tiny_k3, handoff_full_kv=True, max_object_bytes=16 << 10, handoff_part_bytes=4 << 10) as mesh:
            for prompt in prompt_suite()[:3]:
                remote = await mesh.run(prompt, greedy(8), "remote")
                local = await mesh.run(prompt, greedy(8), "local")
                assert remote.ids == local.ids
            assert mesh.prefill_worker.counters.handoff_parts >= 3 * 2
            assert mesh.decode_worker.counters.handoff_parts == mesh.prefill_worker.counters.handoff_parts
            assert mesh.decode_worker.counters.handoff_loaded == 3
            mesh.decode_worker.counters.handoff_failures = 0
            real_get = mesh.decode_worker.cache.get_objects

            async def drop_second_part(keys, *args, **kwargs):
                got = await real_get(keys, *args, **kwargs)
                if len(got) > 1 and all(k.kind == keys[0].kind for k in keys):  # the parts' BatchGet
                    got[1] = type(got[1])(keys[1], Status.MISSING, None, "dropped by the test")
                return got

            mesh.decode_worker.cache.get_objects = drop_second_part
            prompt = prompt_suite()[3]
            remote = await mesh.run(prompt, greedy(8), "remote")
            assert remote.ids == (await mesh.run(prompt, greedy(8), "local")).ids  # recomputed, still right
            assert mesh.decode_worker.counters.failure_reasons.get("missing_part") == 1
    run(main())
