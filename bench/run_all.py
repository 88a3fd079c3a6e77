"""Runs every benchmark in sequence and prints their markdown tables (what docs/benchmarks.md is built from).

Each benchmark compares against its baseline in the same run; see docs/benchmarks.md for the commands one by one.
"""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = [
    ["bench.bench_kda"],
    ["bench.bench_attention", "--threads", "1"],
    ["bench.bench_gemv_layout", "--threads", "1"],
    ["bench.bench_model", "--preset", "small-linear", "--prompt-len", "1024", "--decode-steps", "8", "--threads", "1"],
    ["bench.bench_model", "--preset", "small-k3", "--prompt-len", "1024", "--decode-steps", "8", "--threads", "1"],
    ["bench.bench_engine"],
    ["bench.bench_cache"],
    ["bench.bench_pd"],
    ["bench.bench_handoff"],
    ["bench.plots"],
]


def main() -> int:
    failed = 0
    for module, *args in BENCHMARKS:
        print(f"\n## python -m {module} {' '.join(args)}\n", flush=True)
        failed += subprocess.call([sys.executable, "-m", module, *args]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
