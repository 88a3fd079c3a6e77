"""The llama.cpp bench's pure helpers (bench/llamacpp_tools.py, bench/llamacpp.py): converter patches, output
parsing, per-process peak RSS, medians and ratios. No llama.cpp build needed."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import llamacpp_tools as tools
from bench.llamacpp import summarize

REPO = Path(__file__).resolve().parents[3]
OUR_HASH = "a" * 64
OTHER_HASH = "b" * 64

FAKE_BASE = textwrap.dedent('''
    class TextModel:
        def get_vocab_base_pre(self, chkhsh):
            res = None
            if chkhsh == "0" * 64:
                res = "llama-bpe"
            if res is None:
                raise NotImplementedError("BPE pre-tokenizer was not recognized")
            return res
''')

FAKE_K3 = textwrap.dedent('''
    import re

    class KimiK3Model:
        hparams = {"num_hidden_layers": 2}

        def source(self):
            yield from ["language_model.model.layers.0.mlp.w", "language_model.model.layers.1.mlp.w",
                        "language_model.model.layers.2.enorm.weight", "language_model.model.layers.12.x",
                        "language_model.model.norm.weight", "vision_tower.x"]

        def get_tensors(self):
            for name in self.source():
                if name.startswith(("vision_tower.", "mm_projector.")):
                    continue  # text only
                if name.startswith("language_model."):
                    name = name[len("language_model."):]
                yield name
''')


def _load(source: str, cls: str):
    scope = {}
    exec(compile(source, "<patched>", "exec"), scope)
    return scope[cls]()


def test_unknown_pre_tokenizer_hashes_are_read_from_the_warning_once_each():
    log = (f"WARNING:hf-to-gguf:** chkhsh:  {OUR_HASH}\nsomething else\n"
           f"WARNING:hf-to-gguf:** chkhsh:  {OUR_HASH}\nWARNING:hf-to-gguf:** chkhsh:  {OTHER_HASH}\n")
    assert tools.unknown_pre_tokenizer_hashes(log) == [OUR_HASH, OTHER_HASH]
    assert tools.unknown_pre_tokenizer_hashes("chkhsh: " + OUR_HASH) == []  # not the warning's form


def test_patched_pre_tokenizer_maps_our_hash_to_kimi_k2_and_nothing_else():
    patched = _load(tools.patch_pre_tokenizer(FAKE_BASE, [OUR_HASH]), "TextModel")
    assert patched.get_vocab_base_pre(OUR_HASH) == "kimi-k2"
    assert patched.get_vocab_base_pre("0" * 64) == "llama-bpe"  # the table still works
    with pytest.raises(NotImplementedError):
        patched.get_vocab_base_pre(OTHER_HASH)
    with pytest.raises(NotImplementedError):  # negative control: unpatched, our hash is unknown
        _load(FAKE_BASE, "TextModel").get_vocab_base_pre(OUR_HASH)


def test_patch_anchors_missing_raise_naming_the_file():
    with pytest.raises(ValueError, match="base.py"):
        tools.patch_pre_tokenizer("def get_vocab_base_pre(self):\n    return None\n", [OUR_HASH])
    with pytest.raises(ValueError, match="kimi_k3.py"):
        tools.patch_skip_mtp(FAKE_K3.replace('name[len("language_model."):]', "name[15:]"))


def test_patched_k3_converter_skips_the_mtp_layers_only():
    patched = list(_load(tools.patch_skip_mtp(FAKE_K3), "KimiK3Model").get_tensors())
    assert patched == ["model.layers.0.mlp.w", "model.layers.1.mlp.w", "model.norm.weight"]
    unpatched = list(_load(FAKE_K3, "KimiK3Model").get_tensors())  # negative control
    assert "model.layers.2.enorm.weight" in unpatched and "model.layers.12.x" in unpatched


@pytest.mark.skipif(not (tools.vendor_dir() / "conversion").is_dir(), reason="llama.cpp sdist not downloaded")
def test_the_vendored_converter_has_both_anchors(tmp_path):
    notes = tools.converter_copy(tools.vendor_dir(), tmp_path / "conv", [OUR_HASH])
    assert len(notes) == 2
    assert OUR_HASH in (tmp_path / "conv" / "conversion" / "base.py").read_text()
    assert "MTP layer is not loaded" in (tmp_path / "conv" / "conversion" / "kimi_k3.py").read_text()
    assert "MTP" not in (tools.vendor_dir() / "conversion" / "kimi_k3.py").read_text()  # the original untouched


def test_llama_bench_jsonl_rows_are_parsed_and_noise_ignored():
    row = {"build_commit": "x", "n_prompt": 0, "n_gen": 128, "n_depth": 8192, "n_threads": 1, "avg_ts": 67.5,
           "stddev_ts": 0.1, "samples_ts": [67.5], "avg_ns": 1}
    text = f"load_backend: cpu\n{json.dumps(row)}\n{{not json\n"
    assert tools.parse_llama_bench_jsonl(text) == [{"n_prompt": 0, "n_gen": 128, "n_depth": 8192, "n_threads": 1,
                                                    "avg_ts": 67.5, "samples_ts": [67.5]}]
    assert tools.parse_llama_bench_jsonl("| model | t/s |\n") == []


def test_batched_bench_jsonl_rows_are_parsed():
    line = ('{"n_kv_max": 5136, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
            '"n_gpu_layers": -1, "n_threads": 1, "n_threads_batch": 1, "pp": 128, "tg": 32, "pl": 32, "n_kv": 5120, '
            '"t_pp": 4.0, "speed_pp": 1024.0, "t_tg": 8.0, "speed_tg": 128.0, "t": 12.0, "speed": 426.6}')
    (row,) = tools.parse_batched_bench_jsonl("main: n_kv_max = 5136\n" + line + "\n")
    assert row == {"pp": 128, "tg": 32, "pl": 32, "t_pp": 4.0, "t_tg": 8.0, "speed_pp": 1024.0, "speed_tg": 128.0,
                   "t": 12.0}


def _peak_rss_of(code: str) -> int:
    """`run_measured`'s RSS of `python -c code`, launched from a fresh small process: a child's `ru_maxrss` starts at
    its launcher's RSS (Linux keeps the forked memory's high-water mark across exec), and pytest's is large."""
    launcher = ("import sys; from bench.llamacpp_tools import run_measured; "
                f"print(run_measured([sys.executable, '-c', {code!r}])[2])")
    return int(subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, check=True,
                              cwd=REPO).stdout)


def test_run_measured_reports_that_process_peak_rss():
    big = _peak_rss_of("b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])")
    small = _peak_rss_of("pass")
    assert big >= 200 << 20
    assert small < 100 << 20  # negative control: a process that allocates nothing reads far lower
    out, _, _ = tools.run_measured([sys.executable, "-c", "print('ok')"])
    assert out.strip() == "ok"
    with pytest.raises(RuntimeError, match="exited 3"):
        tools.run_measured([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_summary_takes_medians_and_divides_kdamesh_by_llama_cpp():
    samples = {"decode": {"kdamesh": [{"tok_s": 10.0, "ms_per_token": 100.0}, {"tok_s": 30.0, "ms_per_token": 1},
                                      {"tok_s": 20.0, "ms_per_token": 50.0}],
                          "llama.cpp": [{"tok_s": 40.0, "ms_per_token": 25.0}, {"tok_s": 1.0, "ms_per_token": 1},
                                        {"tok_s": 50.0, "ms_per_token": 20.0}]}}
    (row,) = summarize(samples)
    assert (row["kdamesh"], row["llama.cpp"], row["reps"]) == (20.0, 40.0, 3)
    assert row["ratio"] == pytest.approx(0.5)
    assert row["ratio"] != pytest.approx(statistics_mean_ratio(samples))  # negative control: not a mean
    assert row["paired_ratio"] == pytest.approx(0.4)  # median of 10/40, 30/1, 20/50
    assert row["paired_ratio"] != pytest.approx(row["ratio"])  # negative control: not the ratio of medians


def statistics_mean_ratio(samples) -> float:
    ours = [r["tok_s"] for r in samples["decode"]["kdamesh"]]
    theirs = [r["tok_s"] for r in samples["decode"]["llama.cpp"]]
    return (sum(ours) / 3) / (sum(theirs) / 3)
