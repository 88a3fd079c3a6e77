"""Earlier implementations kept only as same-run baselines for the benchmarks (never used by the engine)."""
