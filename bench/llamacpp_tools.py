"""llama.cpp as a measuring stick: its build (cached outside the repository), its converter (patched in a copy) and
the parsing of its benchmark tools' output. Used by bench/llamacpp.py.

Contract:
- `build_llama_cpp(version, targets)`: the llama.cpp tree vendored in the PyPI sdist `llama-cpp-python==version`
  (`pip download --no-binary :all:`), built CPU-only in Release with cmake under
  `$KDAMESH_HOME/llama.cpp/<version>/` (default ~/.cache/kdamesh). Nothing is rebuilt when every target binary is
  there; returns the folder of the binaries. Nothing of llama.cpp is ever copied into this repository.
- `converter_copy(vendor, dest, hashes)`: a copy of the vendored `convert_hf_to_gguf.py` (with its `conversion/`
  package, `gguf-py` and chat templates) in `dest`, with two patches, each described by the returned notes:
  `patch_pre_tokenizer` maps our tokenizer's pre-tokenizer hashes (the converter prints them when it does not know
  them: `unknown_pre_tokenizer_hashes`) to `kimi-k2`, whose regex ours uses; `patch_skip_mtp` makes the `kimi-k3`
  converter skip K3's MTP layers (`model.layers.{n}` for n ≥ `num_hidden_layers`), which llama.cpp does not load.
  A patch whose anchor text is missing raises `ValueError` naming it (the vendored tree changed).
- `parse_llama_bench_jsonl` / `parse_batched_bench_jsonl`: the rows of `llama-bench -o jsonl` and
  `llama-batched-bench --output-format jsonl` (other lines are ignored).
- `LlamaCpp(bin_dir, gguf)`: the built tools on one GGUF — `decode`, `prefill`, `batch` (llama-bench /
  llama-batched-bench rows as tok/s) and `greedy` (llama-tokenize ids + llama-simple's printed continuation), each
  one process, its peak RSS kept per kind of run in `peak_rss`.
- `run_measured(cmd)`: runs a command, returns its stdout, stderr and peak RSS in bytes (`os.wait4`'s
  `ru_maxrss`, this child only); a non-zero exit raises `RuntimeError` with the tail of stderr. Linux starts a
  child's `ru_maxrss` at its launcher's RSS when it forked (kept across exec), so launch from a small process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BENCH_TARGETS = ("llama-bench", "llama-batched-bench", "llama-simple", "llama-tokenize")
PRE_TOKENIZER = "kimi-k2"  # llama.cpp's pre-tokenizer with Kimi's split regex (ours, engine/tokenizer.py)
PRE_TOKENIZER_ANCHOR = "        if res is None:\n"
MTP_ANCHOR = ('            if name.startswith("language_model."):\n'
              '                name = name[len("language_model."):]\n')
MTP_SKIP = ('            if (m := re.match(r"model\\.layers\\.(\\d+)\\.", name)) and '
            'int(m.group(1)) >= self.hparams["num_hidden_layers"]:\n'
            '                continue  # patched by kdamesh bench/llamacpp.py: the MTP layer is not loaded\n')
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "models/templates")


def cache_root(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    from deploy.checkpoints import kdamesh_home

    return kdamesh_home() / "llama.cpp" / version


def vendor_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root(version) / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def cmake_configure_command(source: Path, build: Path) -> list[str]:
    """CPU only, Release, tuned to this CPU, no network, OpenMP threads, static libraries, no tests or server."""
    return ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DGGML_OPENMP=ON", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"]


def build_llama_cpp(version: str = LLAMA_CPP_PYTHON_VERSION, targets: tuple[str, ...] = BENCH_TARGETS,
                    jobs: int = 2) -> Path:
    """The folder of the built `targets` (built first when any is missing: ~25 min on two cores)."""
    root = cache_root(version)
    bin_dir = root / "build" / "bin"
    if all((bin_dir / t).is_file() for t in targets):
        return bin_dir
    source = vendor_dir(version)
    if not (source / "CMakeLists.txt").is_file():
        _download_sdist(version, root)
    if not (root / "build" / "build.ninja").is_file():
        subprocess.run(cmake_configure_command(source, root / "build"), check=True)
    print(f"building llama.cpp ({', '.join(targets)}) in {root / 'build'}; this takes a while", flush=True)
    subprocess.run(["nice", "-n", "15", "cmake", "--build", str(root / "build"), "-j", str(jobs),
                    "--target", *targets], check=True)
    return bin_dir


def _download_sdist(version: str, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(root)], check=True)
    with tarfile.open(root / f"llama_cpp_python-{version}.tar.gz") as tar:
        tar.extractall(root, filter="data")


# -- the converter, patched in a copy --------------------------------------------------------------------------


def unknown_pre_tokenizer_hashes(converter_log: str) -> list[str]:
    """The `chkhsh` values the converter printed for a pre-tokenizer it does not know, in order, without repeats."""
    found = re.findall(r"\*\* chkhsh:\s+([0-9a-f]{64})", converter_log)
    return list(dict.fromkeys(found))


def patch_pre_tokenizer(base_source: str, hashes: list[str], pre: str = PRE_TOKENIZER) -> str:
    """`conversion/base.py` with `hashes` recognised as `pre` in `get_vocab_base_pre`."""
    start = base_source.find("def get_vocab_base_pre(")
    anchor = base_source.find(PRE_TOKENIZER_ANCHOR, start)
    if start < 0 or anchor < 0:
        raise ValueError(f"conversion/base.py: get_vocab_base_pre's {PRE_TOKENIZER_ANCHOR.strip()!r} not found")
    branch = (f"        if chkhsh in {sorted(hashes)!r}:  # patched by kdamesh bench/llamacpp.py: our tokenizer\n"
              f"            res = {pre!r}\n")
    return base_source[:anchor] + branch + base_source[anchor:]


def patch_skip_mtp(k3_source: str) -> str:
    """`conversion/kimi_k3.py` whose `get_tensors` drops the layers past `num_hidden_layers` (K3's MTP layers)."""
    if MTP_ANCHOR not in k3_source or "import re\n" not in k3_source:
        raise ValueError("conversion/kimi_k3.py: get_tensors' language_model. prefix strip (or `import re`) not found")
    return k3_source.replace(MTP_ANCHOR, MTP_ANCHOR + MTP_SKIP, 1)


def converter_copy(vendor: Path, dest: Path, hashes: list[str]) -> list[str]:
    """Copies the converter into `dest` and patches it; -> one note per patch applied."""
    if dest.exists():
        shutil.rmtree(dest)
    for rel in CONVERTER_FILES:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if (vendor / rel).is_dir():
            shutil.copytree(vendor / rel, target)
        else:
            shutil.copyfile(vendor / rel, target)
    notes = []
    if hashes:
        base = dest / "conversion" / "base.py"
        base.write_text(patch_pre_tokenizer(base.read_text(), hashes))
        notes.append(f"conversion/base.py: pre-tokenizer hash(es) {', '.join(h[:12] for h in hashes)} -> "
                     f"{PRE_TOKENIZER!r} (our tokenizer splits with Kimi's regex)")
    k3 = dest / "conversion" / "kimi_k3.py"
    k3.write_text(patch_skip_mtp(k3.read_text()))
    notes.append("conversion/kimi_k3.py: tensors of layers >= num_hidden_layers (K3's MTP layer) skipped")
    return notes


def convert_to_gguf(model_dir: Path, out_file: Path, work: Path, vendor: Path | None = None) -> list[str]:
    """Converts `model_dir` to a GGUF f32 file with a patched copy of the vendored converter; -> the patch notes.
    A first `--vocab-only` run of an unpatched copy reports the pre-tokenizer hashes it does not know."""
    vendor = vendor or vendor_dir()
    converter = work / "converter"
    converter_copy(vendor, converter, [])
    probe = _run_converter(converter, model_dir, work / "vocab-probe.gguf", ["--vocab-only"], check=False)
    notes = converter_copy(vendor, converter, unknown_pre_tokenizer_hashes(probe))
    _run_converter(converter, model_dir, out_file, ["--outtype", "f32"], check=True)
    return notes


def _run_converter(converter: Path, model_dir: Path, out_file: Path, extra: list[str], check: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # it loads the copy's own gguf-py
    done = subprocess.run([sys.executable, str(converter / "convert_hf_to_gguf.py"), str(model_dir),
                           "--outfile", str(out_file), *extra], capture_output=True, text=True, env=env)
    if check and done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


# -- llama.cpp's benchmark output ------------------------------------------------------------------------------


def _json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            rows.append(json.loads(line))
    return rows


def parse_llama_bench_jsonl(text: str) -> list[dict]:
    """One dict per test of `llama-bench -o jsonl`: n_prompt, n_gen, n_depth, n_threads, avg_ts, samples_ts."""
    keys = ("n_prompt", "n_gen", "n_depth", "n_threads", "avg_ts", "samples_ts")
    return [{k: row[k] for k in keys} for row in _json_lines(text) if "avg_ts" in row]


def parse_batched_bench_jsonl(text: str) -> list[dict]:
    """One dict per (pp, tg, pl) of `llama-batched-bench --output-format jsonl`: pp, tg, pl, t_pp, t_tg, speed_pp,
    speed_tg (generated tok/s of the decode phase) and t (seconds, both phases)."""
    keys = ("pp", "tg", "pl", "t_pp", "t_tg", "speed_pp", "speed_tg", "t")
    return [{k: row[k] for k in keys} for row in _json_lines(text) if "speed_tg" in row]


def run_measured(cmd: list[str], timeout_s: float = 900) -> tuple[str, str, int]:
    """Runs `cmd`; -> (stdout, stderr, peak RSS bytes of that process). Killed after `timeout_s`."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        killer = threading.Timer(timeout_s, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # reaped here, so this child's own rusage
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr[-3000:]}")
    return stdout, stderr, usage.ru_maxrss * 1024  # Linux reports KiB


class LlamaCpp:
    """The built tools and one model's GGUF; each call runs one process and records its peak RSS."""

    def __init__(self, bin_dir: Path, gguf: Path):
        self.bin, self.gguf = bin_dir, gguf
        self.peak_rss = {"single": 0, "depth": 0, "batch": 0}

    def _bench(self, kind: str, threads: int, *flags: str) -> dict:
        out, _, rss = run_measured([str(self.bin / "llama-bench"), "-m", str(self.gguf), "-t", str(threads),
                                          "-r", "1", "-o", "jsonl", *flags])
        self.peak_rss[kind] = max(self.peak_rss[kind], rss)
        (row,) = parse_llama_bench_jsonl(out)
        return row

    def decode(self, threads: int, tokens: int, depth: int = 0) -> dict:
        row = self._bench("depth" if depth else "single", threads, "-p", "0", "-n", str(tokens), "-d", str(depth))
        return {"tok_s": row["avg_ts"], "ms_per_token": 1e3 / row["avg_ts"]}

    def prefill(self, threads: int, prompt_len: int) -> dict:
        return {"tok_s": self._bench("single", threads, "-p", str(prompt_len), "-n", "0")["avg_ts"]}

    def batch(self, threads: int, n: int, prompt_len: int, tokens: int) -> dict:
        ctx = n * (prompt_len + tokens + 1)  # divisible by n: each sequence gets its share
        out, err, rss = run_measured([str(self.bin / "llama-batched-bench"), "-m", str(self.gguf),
                                            "-t", str(threads), "-c", str(ctx), "-npp", str(prompt_len),
                                            "-ntg", str(tokens), "-npl", str(n), "--output-format", "jsonl"])
        self.peak_rss["batch"] = max(self.peak_rss["batch"], rss)
        rows = parse_batched_bench_jsonl(out + "\n" + err)  # the JSON line may be on either stream
        if len(rows) != 1:
            raise RuntimeError(f"llama-batched-bench printed {len(rows)} result rows:\n{out[-1500:]}\n{err[-1500:]}")
        (row,) = rows
        return {"gen_tok_s": n * tokens / row["t"], "decode_tok_s": row["speed_tg"]}

    def greedy(self, prompt: str, tokens: int) -> tuple[list[int], bytes]:
        """llama.cpp's prompt ids and its greedy continuation's printed bytes (prompt pieces first)."""
        ids = subprocess.run([str(self.bin / "llama-tokenize"), "-m", str(self.gguf), "-p", prompt, "--ids",
                              "--log-disable"], capture_output=True, text=True, check=True).stdout
        printed = subprocess.run([str(self.bin / "llama-simple"), "-m", str(self.gguf), "-n", str(tokens), prompt],
                                 capture_output=True, check=True).stdout
        return json.loads(ids.strip().splitlines()[-1]), printed.removesuffix(b"\n")
