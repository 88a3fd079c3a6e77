"""Vision encode time per image: ours (`engine.vision`) vs the official Kimi K3 code, same checkpoint, same run.

Usage: `python -m bench.bench_vision [--preset small-k3] [--sizes 448x448,1024x768] [--threads 1] [--repeats 3]
[--skip-reference] [--out FILE]`

One generated checkpoint; ours loads its tower with `load_vision`, the reference is the official
`KimiK3ForConditionalGeneration` (tests/reference, eager attention — flash-attn does not run on CPU — and the
position-grid interpolation run eagerly instead of under torch.compile). Per image size: preprocessing (ours vs the
official `KimiK3VisionProcessor`, from PNG bytes) and encoding (vision tower + projector, best of `--repeats`),
with the max relative difference of the two encoders' outputs as a check that both computed the same thing. fp32.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from engine.model.checkpoint import make_checkpoint
from engine.vision.loader import load_vision
from engine.vision.processor import ProcessorConfig, decode_image, preprocess, to_tensors
from tests.unit.vision.images import encode, make_image


def _best(fn, repeats: int):
    best, value = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def _ours_preprocess(data: bytes):
    config = ProcessorConfig()
    return to_tensors([preprocess(decode_image(data, config), config)])


def _official_preprocess(data: bytes):
    from tests.unit.vision.official import official_preprocess

    pixel_values, grid_thws, _, _ = official_preprocess(data, ProcessorConfig().media_proc_cfg())
    return pixel_values, grid_thws


def bench_size(size: tuple[int, int], encoder, reference, repeats: int) -> dict:
    data = encode(make_image("RGB", size[0], size[1], seed=size[0]))
    prep_s, (pixel_values, grid_thws) = _best(lambda: _ours_preprocess(data), repeats)
    encode_s, ours = _best(lambda: encoder(pixel_values, grid_thws), repeats)
    row = {"size": f"{size[0]}x{size[1]}", "patches": int(pixel_values.shape[0]), "rows": int(ours.shape[0]),
           "ours": {"preprocess_ms": prep_s * 1e3, "encode_ms": encode_s * 1e3}}
    if reference is not None:
        ref_prep_s, _ = _best(lambda: _official_preprocess(data), repeats)

        def official():
            with torch.no_grad():
                return torch.cat(list(reference.mm_projector(reference.vision_tower(pixel_values, grid_thws))))

        ref_encode_s, theirs = _best(official, repeats)
        row["reference"] = {"preprocess_ms": ref_prep_s * 1e3, "encode_ms": ref_encode_s * 1e3}
        row["max_rel_diff"] = float((ours - theirs).abs().max() / theirs.abs().max())
        row["encode_speedup"] = ref_encode_s / encode_s
        row["preprocess_speedup"] = ref_prep_s / prep_s
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-k3")
    parser.add_argument("--sizes", default="448x448,1024x768")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(args.preset, Path(tmp) / args.preset, seed=0)
        encoder = load_vision(model_dir)
        reference = None
        if not args.skip_reference:
            from tests.reference.k3_reference import load_reference_k3

            reference = load_reference_k3(model_dir)
        rows = [bench_size(size, encoder, reference, args.repeats) for size in sizes]
    params = sum(p.numel() for p in encoder.parameters())
    result = {"preset": args.preset, "threads": args.threads, "vision_params": params, "rows": rows}
    print(_markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def _markdown(r: dict) -> str:
    lines = [f"### {r['preset']} vision tower ({r['vision_params'] / 1e6:.1f}M parameters), {r['threads']} threads",
             "| image | patches → rows | impl | preprocess (ms) | encode (ms) | encode speedup | max rel diff |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for row in r["rows"]:
        o = row["ours"]
        speedup = f"**{row['encode_speedup']:.1f}×**" if "encode_speedup" in row else ""
        diff = f"{row['max_rel_diff']:.1e}" if "max_rel_diff" in row else ""
        lines.append(f"| {row['size']} | {row['patches']:,} → {row['rows']:,} | ours | {o['preprocess_ms']:.1f} | "
                     f"{o['encode_ms']:.1f} | {speedup} | {diff} |")
        if "reference" in row:
            ref = row["reference"]
            lines.append(f"| | | official K3 code | {ref['preprocess_ms']:.1f} | {ref['encode_ms']:.1f} | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
