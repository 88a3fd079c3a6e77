"""bench/long_context.py's table: prefill relative to the first length, the FLOP model's ratio, and kdamesh /
llama.cpp ratios the right way round (higher is better for kdamesh: prefill tok/s ours over theirs, decode
ms/token theirs over ours); a model without llama.cpp gets dashes, not numbers."""

from __future__ import annotations

from bench.long_context import table

MIB = 2 ** 20


def _ours(prefill: float, decode_ms: float, flops: float) -> dict:
    return {"prefill_tok_s": prefill, "decode_ms": decode_ms, "flops_per_prompt_token": flops,
            "peak_rss": 100 * MIB, "pool_bytes": 10 * MIB}


def test_ratios_the_right_way_round():
    rows = [{"model": "m", "length": 1024, "kdamesh": _ours(400.0, 20.0, 1e9),
             "llama.cpp": {"prefill_tok_s": 200.0, "decode_ms": 30.0, "peak_rss": 50 * MIB}},
            {"model": "m", "length": 131072, "kdamesh": _ours(100.0, 50.0, 4e9),
             "llama.cpp": {"prefill_tok_s": 50.0, "decode_ms": 25.0, "peak_rss": 60 * MIB}},
            {"model": "alone", "length": 1024, "kdamesh": _ours(300.0, 10.0, 1e9)}]
    lines = table(rows).splitlines()
    first, long, alone = (line.split(" | ") for line in lines[2:])
    assert first[2:9] == ["400.0 (1.00×)", "1.00×", "200.0", "2.00×", "20.0", "30.0", "1.50×"]
    assert long[2:9] == ["100.0 (0.25×)", "0.25×", "50.0", "2.00×", "50.0", "25.0", "0.50×"]
    assert long[8] != "2.00×"  # negative control: decode is not ours / theirs in ms (that would read 2.00×)
    assert alone[2] == "300.0 (1.00×)" and alone[4:9] == ["—", "—", "10.0", "—", "—"]
    assert long[9] == "100 (10) MiB / 60 MiB |"
