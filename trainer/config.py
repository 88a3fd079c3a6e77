"""The one frozen configuration of a demo-model training run (`kdamesh train-demo` flags map onto it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str
    tiny: bool = False  # the suite's end-to-end configuration (engine.model.presets.demo_k3_config(tiny=True))
    steps: int = 100_000  # an upper bound: the run ends at `time_budget_s` (the schedule follows elapsed time)
    time_budget_s: float = 2880.0  # wall-clock training budget; the learning-rate schedule runs over it
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chat_fraction: float = 0.75
    chat_examples: int = 40_000
    tokenizer_chat_examples: int = 4_000
    code_bytes: int = 6_000_000  # training stdlib sources taken (sorted order); the held-out files are not capped
    seed: int = 0
    threads: int = 1  # measured under contention: 1 thread ~5.7 s/step, 2 threads 14-63 s/step (OpenMP barrier spin)
    save_every_s: float = 120.0  # resumable training state at most this often (and at the end)
    bias_update_rate: float = 1e-3  # noaux_tc load balancing: router bias step per update
    log_every: int = 10

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "chat_examples", "threads", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s}")
        if not 0.0 <= self.chat_fraction <= 1.0:
            raise ValueError(f"chat_fraction must be in [0, 1], got {self.chat_fraction}")


@dataclass(frozen=True)
class DistillConfig:
    """The drafters' distillation (trainer/distill.py): per drafter, at most `steps` steps or `time_budget_s`."""

    steps: int = 10_000
    time_budget_s: float = 900.0
    batch_size: int = 4
    seq_len: int = 256
    anchors: int = 16  # DSpark blocks per window
    lr: float = 2e-3
    code_fraction: float = 0.3  # windows of code (the rest chat): drafters serve code completion too
    seed: int = 0
    # The target's own greedy continuations as the data (trainer/generated.py); 0 and 0: the corpus windows instead
    generated_chat: int = 2_500  # training-seed conversations the target answers
    generated_code: int = 300  # training stdlib file heads the target continues
    generated_tokens: int = 128  # the most tokens a continuation takes (it stops earlier where the target stops)
    generated_batch: int = 64  # prompts generated together
    threads: int = 2  # torch threads while distilling (set for the call, restored after)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "anchors", "generated_tokens", "generated_batch",
                     "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"distill {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.code_fraction <= 1.0:
            raise ValueError(f"distill code_fraction must be in [0, 1], got {self.code_fraction}")
        if min(self.generated_chat, self.generated_code) < 0:
            raise ValueError("distill generated_chat and generated_code must be >= 0")
        if self.generated and ((self.code_fraction > 0 and not self.generated_code)
                               or (self.code_fraction < 1 and not self.generated_chat)):
            raise ValueError(f"distill code_fraction {self.code_fraction} draws from a generated kind of none: "
                             f"generated_chat={self.generated_chat}, generated_code={self.generated_code}")

    @property
    def generated(self) -> bool:
        return bool(self.generated_chat or self.generated_code)
