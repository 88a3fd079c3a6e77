"""A rank group over two "machines" on one host: node 0 is the engine (`LLM(..., nnodes=2, node_rank=0)`, rank 0),
node 1 is `python -m engine.parallel.node --node-rank 1` (rank 1), meeting over the TCP rendezvous at
`--master-addr/--master-port`. Greedy tokens equal TP=1's; negative control: node 1 serving other weights (same
config, another seed) changes the tokens, so rank 1 really computes half of every layer there."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineArgs
from engine.llm import LLM
from engine.model.checkpoint import make_checkpoint
from engine.parallel.config import ParallelError
from engine.parallel.executor import ExecutorConfig, executor_config
from engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[(31 * i + 7 * k) % 7900 for i in range(20 + k)] for k in range(3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ARGS = dict(kv_cache_memory=8 << 20, max_num_seqs=4, block_size=8, collective_timeout_s=30.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_checkpoint("tiny-k3", tmp_path_factory.mktemp("nodes") / "tiny-k3", seed=5))


def _node(model_dir: str, port: int, node_rank: int = 1) -> subprocess.Popen:
    argv = [sys.executable, "-m", "engine.parallel.node", "--model", model_dir, "--tensor-parallel-size", "2",
            "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _two_nodes(model_dir: str, node_model_dir: str) -> list[list[int]]:
    port = _free_port()
    node = _node(node_model_dir, port)
    try:
        llm = LLM(model_dir, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=port, **ARGS)
        try:
            assert llm.engine.executor.rank_pids == []  # rank 1 is on the other "machine", not a child here
            got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.close()
        assert node.wait(timeout=60) == 0, node.stdout.read().decode()[-2000:]  # shut down by rank 0
    finally:
        if node.poll() is None:
            node.kill()
    return got


def test_two_nodes_over_tcp_rendezvous_equal_tp1(model_dir, tmp_path):
    one = LLM(model_dir, **ARGS)
    expected = [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, GREEDY)]
    one.close()
    assert _two_nodes(model_dir, model_dir) == expected
    other = str(make_checkpoint("tiny-k3", tmp_path / "other", seed=6))
    assert _two_nodes(model_dir, other) != expected


def test_the_layout_is_checked_by_name():
    with pytest.raises(ParallelError, match="master-addr"):
        ExecutorConfig(2, nnodes=2)
    with pytest.raises(ParallelError, match="not divisible by --nnodes"):
        ExecutorConfig(3, nnodes=2, master_addr="h", master_port=1)
    with pytest.raises(ParallelError, match="node_rank"):
        ExecutorConfig(2, nnodes=2, node_rank=2, master_addr="h", master_port=1)
    config = executor_config(EngineArgs(model="m", tensor_parallel_size=8, nnodes=2, node_rank=1,
                                        master_addr="h", master_port=29500))
    assert list(config.node_ranks()) == [4, 5, 6, 7] and config.ranks_per_node == 4


def test_the_local_mesh_refuses_nnodes_by_name():
    from tests.unit.deploy.test_serve_flags import _main

    code, _, err = _main(["up", "--model", "/m", "--nnodes", "2", "--master-addr", "h", "--master-port", "1"])
    assert code == 2 and "--nnodes" in err
