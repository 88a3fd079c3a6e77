"""Engine arguments and the cache plan derived from them.

Contract (importing this module loads no torch: the command lines parse `EngineArgs` flags before any model code):
- `EngineArgs` is the one frozen dataclass of engine options (flags follow `vllm serve` where one exists).
  `__post_init__` checks each field alone and raises `EngineConfigError` naming it. A field a user sets carries its
  flag (`telemetry.options.option`: name, help, choices, parser; `json_option` for a JSON-valued one such as
  `--speculative-config`): the worker roles and `kdamesh up` generate their parsers from them (docs/architecture.md,
  "Options and flags"). Byte sizes stay as typed (`byte_text`: "2GiB", or an int of plain digits).
- The pools' memory budget is `kv_cache_memory` (`--kv-cache-memory`, default 1 GiB), or, with
  `gpu_memory_utilization` (`--gpu-memory-utilization`, vLLM's meaning), what a profile run of the loaded model
  leaves of that fraction of the device's memory (engine/memory_profile.py; on CPU a fraction of `cpu_memory`,
  `--cpu-memory`, default the machine's RAM). Refused by name: both set, `cpu_memory` without the fraction or off
  CPU.
- `plan_cache(args, model_config, dtype_bytes, budget)` turns the memory budget into pool sizes, `CachePlan`:
  the KDA state pool holds `max_num_seqs * (1 + num_speculative_tokens)` running slots, then (with prefix caching)
  the snapshot slots: `snapshot_budget` bytes of them when set, else `snapshot_memory_fraction` of the remaining
  bytes; the MLA block pool takes the rest. The two pools are sized independently (a block is `block_size` tokens of
  MLA latents, never inflated to a state's size). `num_kv_blocks` / `num_snapshot_slots` override the computed sizes
  (tests pin exact pools with them). The snapshot slots are the snapshot byte budget: retention within it follows
  the priorities of engine/memory/policy.py, and `snapshot_policy` ("hybrid" | "periodic") chooses which snapshot
  points exist.
  Under tensor parallelism the budget is per rank and a state slot costs one rank's heads (`tensor_parallel_size`).
  Under decode-context parallelism (`decode_context_parallel_size` N) a rank holds block_size / N tokens of each
  block (engine/parallel/context.py): a block costs 1/N of its replicated bytes, so the same budget holds N times
  the blocks (`CachePlan.rank_block_size`; `bytes_per_token` stays the replicated figure).
- `speculative_config` (`--speculative-config`, engine/spec/config.py: a JSON string, a dict or a
  `SpeculativeConfig`) is parsed into a `SpeculativeConfig`; it sets `num_speculative_tokens` (which must then be
  unset or equal), so the state pool reserves 1 + k slots per running request. `num_speculative_tokens` alone
  only reserves the slots. A verification is never split across forwards: `max_forward_tokens` must hold 1 + k.
- `compilation_config` (`--compilation-config`, engine/compilation.py: JSON string, dict or `CompilationConfig`)
  is parsed into a `CompilationConfig` (None stays None and means its defaults: `CompilationConfig.parse(None)`);
  `enforce_eager` turns compiled and captured decode steps off whatever it says.
- `snapshot_interval="auto"` is the state's bytes expressed in tokens of KV, rounded to whole blocks (so periodic
  snapshots at most double the memory of the prefix they cover), clamped to [1, MAX_AUTO_INTERVAL_BLOCKS] blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.compilation import CompilationConfig
from engine.errors import EngineConfigError
from engine.memory.policy import SNAPSHOT_POLICIES
from engine.model.config import ModelConfig
from engine.spec.config import SpeculativeConfig
from telemetry import units
from telemetry.options import json_option, option

MAX_AUTO_INTERVAL_BLOCKS = 4096
DEFAULT_KV_CACHE_MEMORY = 1 << 30
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMAT_CHOICES = ("safetensors", "fastsafetensors", "dummy")


def byte_text(text: str) -> int | str:
    """A byte-size flag's text: plain digits as an int, anything else ("2GiB") as given (`parse_bytes` reads it)."""
    return int(text) if text.isdigit() else text


def interval_text(text: str) -> int | str:
    """`--snapshot-interval`: "auto" or a token count."""
    return text if text == "auto" else int(text)


def parse_bytes(value: int | str, name: str = "kv_cache_memory") -> int:
    """`4096`, `"512MiB"`, `"2GB"`, `"1.5g"` -> bytes, by the one unit rule (`telemetry.units.parse_bytes`); an
    unusable value raises EngineConfigError naming `name`, the engine option it sizes."""
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        return units.parse_bytes(value)
    except ValueError:
        raise EngineConfigError(f"{name} {value!r} is not a byte count (e.g. 4096, 512MiB, 2GB)") from None


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is fp8_e4m3 (kernels/attention/fp8_latent.py)


def is_fp8_kv(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class EngineArgs:
    model: str = option("--model", help="checkpoint folder (config.json, *.safetensors, tokenizer)")
    tokenizer: str | None = option("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    dtype: str = option("--dtype", default="auto", choices=DTYPE_CHOICES)
    load_format: str = option("--load-format", default="safetensors", choices=LOAD_FORMAT_CHOICES)
    device: str = option("--device", default="cpu")
    seed: int = option("--seed", default=0, parse=int)
    block_size: int = option("--block-size", default=16, parse=int, help="tokens per KV block")
    kv_cache_memory: int | str | None = option(  # bytes for both pools together; None: DEFAULT_KV_CACHE_MEMORY
        "--kv-cache-memory", default=None, parse=byte_text,
        help="bytes for the KV block and KDA state pools together, per worker, e.g. 1GiB (default 1GiB; "
             "--gpu-memory-utilization sizes them by a profile run instead)")
    kv_cache_dtype: str = option(  # the MLA latents' storage; KDA states keep their own dtypes
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
        help="MLA latent cache: auto (the model dtype) or fp8 / fp8_e4m3 (e4m3 values with a per-token fp32 scale)")
    max_num_seqs: int = option("--max-num-seqs", default=64, parse=int)
    max_num_batched_tokens: int = option("--max-num-batched-tokens", default=2048, parse=int)
    max_forward_tokens: int | None = option(  # tokens per model forward within a step; None: 2048 on CPU (runner.py)
        "--max-forward-tokens", default=None, parse=int,
        help="tokens per model forward within a step (default: 2048 on CPU, unlimited on GPU)")
    max_model_len: int | None = option(  # default: the model's limit, capped by what the block pool holds
        "--max-model-len", default=None, parse=int,
        help="context length (default: the model's, capped by what the KV block pool holds)")
    enable_prefix_caching: bool = option("--enable-prefix-caching", default=True, kind="toggle")
    snapshot_interval: int | str = option(  # tokens, a multiple of block_size
        "--snapshot-interval", default="auto", parse=interval_text,
        help="tokens between KDA state snapshots, or 'auto'")
    snapshot_memory_fraction: float = 1 / 3  # of the memory left after the running slots
    num_kv_blocks: int | None = None  # override the computed block pool size
    num_snapshot_slots: int | None = None  # override the computed snapshot slot count
    num_speculative_tokens: int = 0
    model_fingerprint: str | None = None  # default: derived from config and weight headers
    tensor_parallel_size: int = option(  # rank processes the model is split over (engine/parallel/executor.py)
        "--tensor-parallel-size", "-tp", default=1, parse=int,
        help="rank processes each worker splits its model over (engine/parallel/executor.py)")
    decode_context_parallel_size: int = option(  # MLA latents split by token over groups of N TP ranks
        "--decode-context-parallel-size", "-dcp", default=1, parse=int,
        help="split the MLA latent cache by token over groups of N tensor-parallel ranks (N divides "
             "--tensor-parallel-size and --block-size; engine/parallel/context.py); KDA state is unaffected")
    enable_expert_parallel: bool = option(  # split the routed experts by expert across those ranks
        "--enable-expert-parallel", default=False, kind="switch", help="split the routed experts by expert")
    pipeline_parallel_size: int = option(  # stages the layers are split over; ranks = TP x PP (engine/parallel/)
        "--pipeline-parallel-size", "-pp", default=1, parse=int,
        help="pipeline stages the model's layers are split over (contiguous layer ranges; ranks = TP x PP)")
    collective_timeout_s: float = 60.0  # a rank collective waiting longer fails the engine (a hung or lost rank)
    nnodes: int = option(  # machines the tensor-parallel group spans (engine/parallel/node.py)
        "--nnodes", default=1, parse=int, help="machines the rank group spans; node 0 runs the engine")
    node_rank: int = option(  # this machine's index: 0 runs the engine, others `python -m engine.parallel.node`
        "--node-rank", default=0, parse=int, help="this machine's index in the rank group (0: the engine's)")
    master_addr: str | None = option(  # the TCP rendezvous (rank 0's machine) when nnodes > 1
        "--master-addr", default=None, help="rank 0's machine, for a rank group over several machines")
    master_port: int | None = option("--master-port", default=None, parse=int,
                                     help="the TCP rendezvous port on --master-addr")
    # a request whose grammar takes longer to compile gets a 400 naming its schema (engine/async_engine.py)
    grammar_compile_timeout_s: float = 30.0
    snapshot_policy: str = option(  # "hybrid": hints, junctions, turn ends too; "periodic": prompt ends + interval
        "--snapshot-policy", default="hybrid", choices=SNAPSHOT_POLICIES,
        help="where KDA state snapshots are taken (engine/memory/policy.py)")
    snapshot_budget: int | str | None = option(  # bytes of KDA snapshots, e.g. "2GiB"; None: snapshot_memory_fraction
        "--snapshot-budget", default=None, parse=byte_text,
        help="bytes for KDA state snapshots per worker, e.g. 2GiB (default: a third of the memory left after the "
             "running states)")
    speculative_config: SpeculativeConfig | dict | str | None = json_option(  # engine/spec/config.py; None: off
        "--speculative-config", help='speculative decoding, vLLM\'s JSON: {"method": "ngram", '
                                     '"num_speculative_tokens": 3, "prompt_lookup_max": 4} (engine/spec/config.py)')
    enforce_eager: bool = option(  # no compiled or captured decode step (engine/compilation.py)
        "--enforce-eager", default=False, kind="switch",
        help="run every step eagerly: no torch.compile, no CUDA graphs (vLLM's flag)")
    compilation_config: CompilationConfig | dict | str | None = json_option(  # engine/compilation.py; None: defaults
        "--compilation-config", help='the decode step\'s compilation, vLLM\'s JSON: {"level": 3, '
                                     '"cudagraph_capture_sizes": [1, 2, 4, 8]} (engine/compilation.py)')
    # the step thread turns ids into text and matches stop strings (engine/request.py `OutputState`); False: ids
    # only (outputs carry no text, stop strings are not matched: the caller, e.g. the mesh gateway, does both once)
    detokenize: bool = True
    gpu_memory_utilization: float | None = option(  # engine/memory_profile.py; None: kv_cache_memory sizes the pools
        "--gpu-memory-utilization", default=None, parse=float,
        help="fraction of the device's memory (on CPU: of --cpu-memory or the machine's RAM) this worker may use; "
             "the KV and state pools get what a profile run of the largest step leaves of it (vLLM's meaning)")
    cpu_memory: int | str | None = option(  # CPU only: the bytes gpu_memory_utilization is a fraction of
        "--cpu-memory", default=None, parse=byte_text,
        help="CPU: the host memory --gpu-memory-utilization is a fraction of, e.g. 16GiB (default: physical RAM)")

    def __post_init__(self):
        positive = {"block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                    "max_num_batched_tokens": self.max_num_batched_tokens}
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_forward_tokens is not None and (not isinstance(self.max_forward_tokens, int)
                                                    or self.max_forward_tokens <= 0):
            raise EngineConfigError(f"max_forward_tokens must be a positive integer, got {self.max_forward_tokens!r}")
        if self.kv_cache_memory is not None and parse_bytes(self.kv_cache_memory) <= 0:
            raise EngineConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        self._check_memory_fraction()
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise EngineConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.snapshot_interval != "auto":
            si = self.snapshot_interval
            if not isinstance(si, int) or si <= 0 or si % self.block_size:
                raise EngineConfigError(f"snapshot_interval must be 'auto' or a positive multiple of block_size "
                                        f"{self.block_size}, got {si!r}")
        if not 0.0 <= self.snapshot_memory_fraction < 1.0:
            raise EngineConfigError(f"snapshot_memory_fraction must be in [0, 1), got {self.snapshot_memory_fraction}")
        for name in ("num_kv_blocks", "num_snapshot_slots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise EngineConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if self.num_kv_blocks == 0:
            raise EngineConfigError("num_kv_blocks must be positive")
        if not isinstance(self.detokenize, bool):
            raise EngineConfigError(f"detokenize must be a bool, got {self.detokenize!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise EngineConfigError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens!r}")
        self._resolve_speculative()
        self._resolve_compilation()
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise EngineConfigError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        self._check_pipeline()
        self._check_timeouts()
        self._check_choices()
        self._check_context_parallel()
        if self.snapshot_budget is not None and parse_bytes(self.snapshot_budget, "snapshot_budget") < 0:
            raise EngineConfigError(f"snapshot_budget must be >= 0, got {self.snapshot_budget!r}")

    def _check_pipeline(self) -> None:
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or pp < 1:
            raise EngineConfigError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
        if pp == 1:
            return
        spec = self.speculative_config
        method = getattr(spec, "method", None)
        if spec is not None and method != "ngram":
            raise EngineConfigError(f"--speculative-config method {method!r} with --pipeline-parallel-size {pp}: a "
                                    "model drafter reads the target's embedding and LM head on rank 0, which under "
                                    "pipeline parallelism live on different stages; use ngram or "
                                    "--pipeline-parallel-size 1")
        if self.gpu_memory_utilization is not None:
            raise EngineConfigError(f"--gpu-memory-utilization with --pipeline-parallel-size {pp}: the profile "
                                    "sizes one rank holding every layer; set --kv-cache-memory")
        if self.load_format == "fastsafetensors":
            raise EngineConfigError("--load-format fastsafetensors with --pipeline-parallel-size > 1: its file "
                                    "rounds read every tensor; use --load-format safetensors")

    def _check_timeouts(self) -> None:
        for name in ("collective_timeout_s", "grammar_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be positive, got {getattr(self, name)!r}")

    def _check_context_parallel(self) -> None:
        dcp = self.decode_context_parallel_size
        if isinstance(dcp, bool) or not isinstance(dcp, int) or dcp < 1 or self.tensor_parallel_size % dcp:
            raise EngineConfigError(f"--decode-context-parallel-size (decode_context_parallel_size) must be a positive "
                                    f"integer dividing --tensor-parallel-size {self.tensor_parallel_size}, got {dcp!r}")
        if dcp > 1 and self.block_size % dcp:
            raise EngineConfigError(f"--decode-context-parallel-size {dcp} must divide --block-size {self.block_size} "
                                    "(each rank's block holds block_size / N tokens)")
        if dcp > 1 and self.compilation_config is not None:
            raise EngineConfigError(f"--decode-context-parallel-size {dcp} runs eager steps only; drop "
                                    "--compilation-config (compiled / captured decode steps are not built for it)")

    def _check_choices(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r} "
                                    "(fp8_e5m2 and vLLM's fp8_ds_mla layout are not built)")
        if self.snapshot_policy not in SNAPSHOT_POLICIES:
            raise EngineConfigError(f"snapshot_policy must be one of {SNAPSHOT_POLICIES}, got {self.snapshot_policy!r}")
    def _check_memory_fraction(self) -> None:
        """gpu_memory_utilization / cpu_memory alone and together; combinations with two meanings are refused."""
        util = self.gpu_memory_utilization
        if util is not None:
            if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0:
                raise EngineConfigError(f"--gpu-memory-utilization (gpu_memory_utilization) must be in (0, 1], got {util!r}")
            if self.kv_cache_memory is not None:
                raise EngineConfigError("--gpu-memory-utilization and --kv-cache-memory both size the KV and "
                                        "state pools: set one (--kv-cache-memory is the explicit override)")
        if self.cpu_memory is not None:
            if util is None:
                raise EngineConfigError("--cpu-memory is the budget --gpu-memory-utilization is a fraction of on CPU; "
                                        "set --gpu-memory-utilization too (or size the pools with --kv-cache-memory)")
            if not str(self.device).startswith("cpu"):
                raise EngineConfigError(f"--cpu-memory applies on CPU only; device {self.device!r} sizes by its "
                                        "own memory")
            if parse_bytes(self.cpu_memory, "cpu_memory") <= 0:
                raise EngineConfigError(f"--cpu-memory (cpu_memory) must be positive, got {self.cpu_memory!r}")

    def _resolve_compilation(self) -> None:
        if self.compilation_config is not None:  # None stays None (the defaults): a command line omits it
            object.__setattr__(self, "compilation_config", CompilationConfig.parse(self.compilation_config))
        if not isinstance(self.enforce_eager, bool):
            raise EngineConfigError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")

    def _resolve_speculative(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is None:
            return
        k = spec.num_speculative_tokens
        if self.num_speculative_tokens not in (0, k):
            raise EngineConfigError(f"num_speculative_tokens {self.num_speculative_tokens} disagrees with "
                                    f"speculative_config's {k}")
        object.__setattr__(self, "num_speculative_tokens", k)
        if self.max_forward_tokens is not None and self.max_forward_tokens < 1 + k:
            raise EngineConfigError(f"max_forward_tokens {self.max_forward_tokens} must hold a verification of "
                                    f"1 + {k} positions")


@dataclass(frozen=True)
class CachePlan:
    """Pool sizes and cache policy, fixed for the engine's lifetime."""

    block_size: int
    num_blocks: int
    slots_per_request: int  # 1 running slot + one per speculative position
    num_running_slots: int  # max_num_seqs * slots_per_request, slot ids [0, num_running_slots)
    num_snapshot_slots: int  # slot ids [num_running_slots, num_running_slots + num_snapshot_slots)
    snapshot_interval: int  # tokens; 0 when prefix caching is off
    max_model_len: int
    bytes_per_token: int
    bytes_per_state: int
    snapshot_policy: str = "hybrid"  # engine/memory/policy.py
    kv_cache_dtype: str = "auto"  # EngineArgs.kv_cache_dtype
    decode_context_parallel_size: int = 1  # EngineArgs.decode_context_parallel_size: a rank holds 1/N of a block

    @property
    def rank_block_size(self) -> int:
        """Tokens of each block one rank's cache holds (block_size / N under DCP)."""
        return self.block_size // self.decode_context_parallel_size

    @property
    def snapshot_budget_bytes(self) -> int:
        """The bytes the snapshot slots hold: the most KDA snapshots may ever take."""
        return self.num_snapshot_slots * self.bytes_per_state

    @property
    def num_slots(self) -> int:
        return self.num_running_slots + self.num_snapshot_slots

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.rank_block_size * self.bytes_per_token  # one rank's

    @property
    def state_bytes(self) -> int:
        return self.num_slots * self.bytes_per_state


def auto_snapshot_interval(block_size: int, token_bytes: int, state_bytes: int) -> int:
    """The state's bytes in tokens of KV, rounded to whole blocks."""
    if token_bytes == 0:
        return block_size
    blocks = round(state_bytes / (token_bytes * block_size))
    return block_size * min(MAX_AUTO_INTERVAL_BLOCKS, max(1, blocks))


def plan_cache(args: EngineArgs, config: ModelConfig, dtype_bytes: int, budget: int | None = None) -> CachePlan:
    """`budget`: the pools' bytes measured by engine/memory_profile.py (needed when gpu_memory_utilization is set);
    None: `kv_cache_memory` (default `DEFAULT_KV_CACHE_MEMORY`)."""
    from engine.model.batch import bytes_per_state, bytes_per_token  # torch: the option classes above stay light

    bs = args.block_size
    token_b = bytes_per_token(config, dtype_bytes, args.kv_cache_dtype)
    state_b = bytes_per_state(config, dtype_bytes, tensor_parallel_size=args.tensor_parallel_size)  # one rank's heads
    if budget is None:
        if args.gpu_memory_utilization is not None:
            raise EngineConfigError("gpu_memory_utilization sizes the pools from a profile run of the loaded model "
                                    "(engine/memory_profile.py); plan_cache needs its budget")
        budget = parse_bytes(DEFAULT_KV_CACHE_MEMORY if args.kv_cache_memory is None else args.kv_cache_memory)
    what = "kv_cache_memory" if args.gpu_memory_utilization is None else "the gpu_memory_utilization budget"
    slots_per_request = 1 + args.num_speculative_tokens
    running = args.max_num_seqs * slots_per_request
    rest = budget - running * state_b
    if rest <= 0 and args.num_kv_blocks is None:
        raise EngineConfigError(
            f"{what} {budget} B does not hold {running} running KDA states of {state_b} B "
            f"(max_num_seqs {args.max_num_seqs}); raise it or lower max_num_seqs")
    caching = args.enable_prefix_caching
    snapshots = 0
    if caching and state_b:
        snapshots = args.num_snapshot_slots
        if snapshots is None and args.snapshot_budget is not None:
            snapshots = parse_bytes(args.snapshot_budget, "snapshot_budget") // state_b
        elif snapshots is None:
            snapshots = int(max(rest, 0) * args.snapshot_memory_fraction) // state_b
    num_blocks = args.num_kv_blocks
    if num_blocks is None:
        num_blocks = (rest - snapshots * state_b) // max(1, bs // args.decode_context_parallel_size * token_b)
        if num_blocks <= 0:
            raise EngineConfigError(f"{what} {budget} B leaves no room for KV blocks after the state pool")
    interval = 0
    if caching:
        interval = (auto_snapshot_interval(bs, token_b, state_b) if args.snapshot_interval == "auto"
                    else int(args.snapshot_interval))
    max_len = min(config.max_position_embeddings, num_blocks * bs)
    if args.max_model_len is not None:
        if args.max_model_len > config.max_position_embeddings:
            raise EngineConfigError(f"max_model_len {args.max_model_len} exceeds the model's limit "
                                    f"{config.max_position_embeddings}")
        max_len = args.max_model_len
    return CachePlan(block_size=bs, num_blocks=int(num_blocks), slots_per_request=slots_per_request,
                     num_running_slots=running, num_snapshot_slots=int(snapshots), snapshot_interval=interval,
                     max_model_len=int(max_len), bytes_per_token=token_b, bytes_per_state=state_b,
                     snapshot_policy=args.snapshot_policy, kv_cache_dtype=args.kv_cache_dtype,
                     decode_context_parallel_size=args.decode_context_parallel_size)
