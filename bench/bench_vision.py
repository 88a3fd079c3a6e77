"""Vision encode time per image: ours (`engine.vision`) vs the official Kimi K3 code, same checkpoint, same run.

Usage: `python -m bench.bench_vision [--preset small-k3] [--sizes 448x448,1024x768] [--threads 1] [--repeats 3]
[--skip-reference] [--ttft] [--out FILE]`

One generated checkpoint; ours loads its tower with `load_vision`, the reference is the official
`KimiK3ForConditionalGeneration` (tests/reference, eager attention — flash-attn does not run on CPU — and the
position-grid interpolation run eagerly instead of under torch.compile). Per image size: preprocessing (ours vs the
official `KimiK3VisionProcessor`, from PNG bytes) and encoding (vision tower + projector, best of `--repeats`),
with the max relative difference of the two encoders' outputs as a check that both computed the same thing. fp32.

`--ttft` adds, per size, the engine's time to first token of one image prompt (`EngineCore`, the image followed by
a sentence), best of `--repeats`: cold (prefix and encoder caches emptied), with the image's features in the encoder
cache but no KV (prefix cache emptied: the prompt is recomputed, the image is neither preprocessed nor encoded), and
with the prompt's blocks in the prefix cache.
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


def _image_request(engine, data: bytes):
    """(expanded prompt ids, ImageInputs) of the image followed by a sentence."""
    import hashlib

    from engine.vision.feed import ImageInput
    from engine.vision.processor import expand_media_pads, image_prompt, media_spans, plan_resize

    config, pad = ProcessorConfig(), engine.config.media_placeholder_token_id
    image = decode_image(data, config)
    text = image_prompt(*image.size) + " Describe this picture in detail, with every colour you can see."
    ids = expand_media_pads(engine.tokenizer.encode(text, allow_special=True),
                            [plan_resize(*image.size, config).feature_rows], pad)
    digest = hashlib.sha256(data).digest()
    return ids, tuple(ImageInput(o, n, digest, data) for o, n in media_spans(ids, pad))


def _ttft_ms(engine, request_id: str, ids: list[int], media) -> float:
    from engine.sampling import SamplingParams

    start = time.perf_counter()
    engine.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0), media=media)
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def bench_ttft(model_dir: Path, sizes: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Best of `repeats` per state: cold (prefix and encoder caches emptied first), features cached (prefix cache
    emptied), prefix cached."""
    from engine.config import EngineArgs
    from engine.core import EngineCore

    engine = EngineCore(EngineArgs(model=str(model_dir), dtype="float32", max_num_batched_tokens=8192,
                                   max_forward_tokens=8192))
    rows = []
    for size in sizes:
        data = encode(make_image("RGB", size[0], size[1], seed=size[0] + 1))
        ids, media = _image_request(engine, data)

        def timed(state: str, n: int) -> float:
            if state != "prefix":
                engine.reset_prefix_cache()
            if state == "cold":
                engine.media.feeder.cache.clear()
            return _ttft_ms(engine, f"{state}-{size}-{n}", ids, media)

        best = {state: min(timed(state, n) for n in range(repeats)) for state in ("cold", "features", "prefix")}
        rows.append({"size": f"{size[0]}x{size[1]}", "prompt_tokens": len(ids), "cold_ms": best["cold"],
                     "features_cached_ms": best["features"], "prefix_cached_ms": best["prefix"]})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-k3")
    parser.add_argument("--sizes", default="448x448,1024x768")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(args.preset, Path(tmp) / args.preset, seed=0)
        encoder = load_vision(model_dir)
        reference = None
        if not args.skip_reference:
            from tests.reference.k3_reference import load_reference_k3

            reference = load_reference_k3(model_dir)
        rows = [bench_size(size, encoder, reference, args.repeats) for size in sizes]
        ttft = bench_ttft(model_dir, sizes, args.repeats) if args.ttft else []
    params = sum(p.numel() for p in encoder.parameters())
    result = {"preset": args.preset, "threads": args.threads, "vision_params": params, "rows": rows, "ttft": ttft}
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
    if r["ttft"]:
        lines += ["", "| image | prompt tokens | TTFT cold (ms) | features cached (ms) | prefix cached (ms) |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {t['size']} | {t['prompt_tokens']:,} | {t['cold_ms']:.0f} | {t['features_cached_ms']:.0f} | "
                  f"{t['prefix_cached_ms']:.0f} |" for t in r["ttft"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
