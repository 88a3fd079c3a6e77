"""The numbers of docs/demo-model.md for a trained demo folder: `python -m bench.demo_eval [MODEL_DIR]`.

Measures, on CPU (default MODEL_DIR: the shipped deploy/models/demo-k3):
- held-out perplexity per token (and bits per byte, comparable across tokenizers; special tokens count their text's
  bytes) on the first `--heldout-bytes`
  of the held-out stdlib files the folder lists (`heldout_files.txt`), for the model, for an interpolated bigram
  model estimated on the same training tokens (the stdlib training files and chat set `training_run.json` names,
  re-tokenized with the folder's tokenizer; its interpolation weight is the best of a grid on the held-out text,
  which favours the baseline), and for the random `small-k3` (its own tokenizer, the same text); and on 200 chat
  conversations of an unused seed, for the model and the bigram;
- on 50 chat prompts whose text is not in the training set (15 tool prompts with values the generator never draws,
  `HELDOUT_TOOL_PROMPTS`, then generated tasks, seed `EVAL_SEED`): the share of greedy answers
  that end by themselves (finish reason "stop" within `--max-tokens`), the share correct on the arithmetic / string /
  list prompts (`trainer.chat_data.check_reply`), the share of tool prompts whose parsed call names the expected tool
  with arguments valid against its JSON schema, and the share whose arguments carry the prompt's value (the city,
  amount, ...);
- the folder's size on disk and its training time and tokens (from `training_run.json`).
Prints one JSON object (`--out FILE` writes it too).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
from pathlib import Path

import jsonschema
import torch
import torch.nn.functional as F

from engine.llm import LLM
from engine.model.loader import LoadConfig, load_model
from engine.sampling import SamplingParams
from engine.tokenizer import KimiTokenizer
from gateway.chat.k3 import K3Renderer
from gateway.parsers.base import ParserOptions
from gateway.parsers.k3 import K3OutputParser
from trainer import corpus
from trainer.chat_data import TOOLS, ChatExample, Task, check_reply, declared_tools, make_example, prompt_messages
from trainer.forward import train_forward

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "deploy" / "models" / "demo-k3"
EVAL_SEED = 1_000_003
NUM_PROMPTS = 50
WINDOW = 256


def heldout_text(model_dir: Path, limit_bytes: int) -> str:
    root = corpus.stdlib_root()
    names = (model_dir / corpus.HELDOUT_FILE).read_text(encoding="utf-8").split()
    text = "".join(t + "\n\n" for t in corpus.read_sources([root / n for n in names]))
    return text.encode("utf-8")[:limit_bytes].decode("utf-8", errors="ignore")


@torch.no_grad()
def model_nats(model, ids: list[int]) -> float:
    """Summed next-token negative log-likelihood of `ids` in windows of WINDOW + 1 tokens (each window fresh)."""
    total = 0.0
    for start in range(0, len(ids) - 1, WINDOW):
        window = torch.tensor(ids[start : start + WINDOW + 1]).unsqueeze(0)  # [1, <= W+1]
        logits = train_forward(model, window[:, :-1]).logits[0]
        total += float(F.cross_entropy(logits, window[0, 1:], reduction="sum"))
    return total


def perplexity_of(model_dir: Path, text: str) -> dict:
    tokenizer = KimiTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(text)
    model = load_model(model_dir, LoadConfig(dtype="float32"))
    nats = model_nats(model, ids)
    return _ppl(nats, len(ids) - 1, len(text.encode("utf-8")))


def _ppl(nats: float, tokens: int, num_bytes: int) -> dict:
    return {"tokens": tokens, "ppl_per_token": round(math.exp(nats / tokens), 3),
            "bits_per_byte": round(nats / math.log(2) / num_bytes, 4)}


def training_tokens(model_dir: Path) -> list[int]:
    """The training streams of the run that made `model_dir`, re-tokenized with its tokenizer."""
    config = json.loads((model_dir / "training_run.json").read_text())["config"]
    tokenizer = KimiTokenizer.from_pretrained(model_dir)
    renderer = K3Renderer(tokenizer)
    ids: list[int] = []
    for text in corpus.read_sources(corpus.split_files(config["code_bytes"]).train):
        ids += tokenizer.encode(text + "\n\n")
    for example in corpus.chat_examples(config["chat_examples"], config["seed"]):
        ids += corpus.render_chat(renderer, example)
    return ids


def bigram_perplexity(train_ids: list[int], eval_ids: list[int], vocab: int, num_bytes: int) -> dict:
    """Interpolated bigram `l·c(a,b)/c(a) + (1-l)·p_add1(b)`; the best `l` of a grid on `eval_ids`."""
    train = torch.tensor(train_ids)
    pair_counts = torch.bincount(train[:-1] * vocab + train[1:], minlength=vocab * vocab).reshape(vocab, vocab)
    unigram = (torch.bincount(train, minlength=vocab).double() + 1) / (len(train_ids) + vocab)
    prev, nxt = torch.tensor(eval_ids[:-1]), torch.tensor(eval_ids[1:])
    rows = pair_counts[prev].double()  # [N, V]
    p_bigram = rows.gather(1, nxt.unsqueeze(1)).squeeze(1) / rows.sum(1).clamp(min=1)
    best = None
    for lam in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99):
        nats = float(-torch.log(lam * p_bigram + (1 - lam) * unigram[nxt]).sum())
        if best is None or nats < best[0]:
            best = (nats, lam)
    return _ppl(best[0], len(eval_ids) - 1, num_bytes) | {"interpolation": best[1]}


def training_prompts(chat_examples: int, seed: int) -> set[str]:
    """Every user message of the training chat set."""
    return {m["content"] for e in corpus.chat_examples(chat_examples, seed) for m in e.messages if m["role"] == "user"}


# Tool prompts in the training templates' style with values the generator never draws (the training set covers
# nearly every (template, value) pair of its own lists, so none of those would be unseen).
HELDOUT_TOOL_PROMPTS = (
    ("get_weather", "What is the weather in {}?", ("Kyoto", "Reykjavik", "Montreal", "Geneva", "Havana")),
    ("get_weather", "How is the weather in {} today?", ("Porto", "Munich", "Osaka")),
    ("convert_currency", "Convert {} to EUR.", ("35 USD", "75 GBP", "400 CAD")),
    ("set_timer", "Set a timer for {} minutes for bread.", ("12", "25")),
    ("get_stock_price", "What is the stock price of {}?", ("META", "INTC")),
)


HELDOUT_VALUES: dict[str, str] = {}  # held-out tool prompt -> the value it carries


def carries_prompt_values(calls: list[dict], prompt: str) -> bool:
    """Whether a call's arguments hold every word of the prompt's held-out value ("Kyoto", "35" and "USD")."""
    words = HELDOUT_VALUES[prompt].split()
    return any(all(w in call["arguments"] for w in words) for call in calls)


def heldout_tool_examples(rng: random.Random) -> list:
    examples = []
    for name, template, values in HELDOUT_TOOL_PROMPTS:
        for value in values:
            prompt = template.format(value)
            kwargs = {} if rng.random() < 0.65 else {"thinking": False}
            examples.append(ChatExample([{"role": "user", "content": prompt}], declared_tools(rng, name), kwargs,
                                        Task("tool", prompt, name)))
            HELDOUT_VALUES[prompt] = value
    return examples


def eval_examples(model_dir: Path) -> list:
    """NUM_PROMPTS examples whose prompt text is not among the training prompts: the held-out tool prompts, then
    generated arithmetic / string / list prompts."""
    config = json.loads((model_dir / "training_run.json").read_text())["config"]
    seen = training_prompts(config["chat_examples"], config["seed"])
    rng = random.Random(EVAL_SEED)
    chosen = heldout_tool_examples(rng)
    while len(chosen) < NUM_PROMPTS:
        example = make_example(rng)
        if example.task.prompt not in seen and example.task.kind not in ("chat", "tool"):
            chosen.append(example)
    assert not {e.task.prompt for e in chosen} & seen
    return chosen


def schema_valid_call(calls: list[dict], name: str) -> bool:
    for call in calls:
        if call["name"] != name:
            continue
        try:
            jsonschema.validate(json.loads(call["arguments"]), TOOLS[name]["function"]["parameters"])
            return True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            continue
    return False


def chat_scores(model_dir: Path, max_tokens: int) -> dict:
    llm = LLM(str(model_dir), dtype="float32")
    tokenizer = KimiTokenizer.from_pretrained(model_dir)
    renderer = K3Renderer(tokenizer)
    examples = eval_examples(model_dir)
    prompts = [renderer.render(prompt_messages(e), e.tools, chat_template_kwargs=e.template_kwargs) for e in examples]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False)
    outputs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], params)
    stopped, solved, tools_ok, values_ok, samples = 0, {"task": [0, 0], "tool": [0, 0]}, 0, 0, []
    for example, prompt, out in zip(examples, prompts, outputs):
        completion = out.outputs[0]
        parsed = K3OutputParser(ParserOptions(start_in_reasoning=prompt.starts_in_reasoning)).parse(completion.text)
        calls = [{"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
        stopped += completion.finish_reason == "stop"
        bucket = "tool" if example.task.kind == "tool" else "task"
        solved[bucket][1] += 1
        solved[bucket][0] += check_reply(example.task, parsed.content or "", calls)
        tools_ok += example.task.kind == "tool" and schema_valid_call(calls, example.task.expected)
        values_ok += example.task.kind == "tool" and carries_prompt_values(calls, example.task.prompt)
        if len(samples) < 6 or len(samples) < 12 and example.task.kind != "tool":
            samples.append({"prompt": example.task.prompt, "kwargs": example.template_kwargs,
                            "reasoning": parsed.reasoning, "content": parsed.content, "calls": calls})
    n = len(examples)
    return {"prompts": n, "ended_by_themselves_pct": round(100 * stopped / n, 1),
            "task_prompts": solved["task"][1], "task_correct_pct": round(100 * solved["task"][0] /
                                                                         max(1, solved["task"][1]), 1),
            "tool_prompts": solved["tool"][1],
            "tool_schema_valid_call_pct": round(100 * tools_ok / max(1, solved["tool"][1]), 1),
            "tool_call_carries_prompt_values_pct": round(100 * values_ok / max(1, solved["tool"][1]), 1),
            "samples": samples}


def size_on_disk(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file() and ".train" not in p.parts)


def heldout_chat_ids(model_dir: Path, count: int = 200) -> list[int]:
    """`count` conversations drawn from a seed the training set did not use, rendered with the folder's tokenizer."""
    renderer = K3Renderer(KimiTokenizer.from_pretrained(model_dir))
    ids: list[int] = []
    for example in corpus.chat_examples(count, EVAL_SEED + 1):
        ids += corpus.render_chat(renderer, example)
    return ids


def perplexities(model_dir: Path, heldout_bytes: int, random_baseline: bool = True) -> dict:
    """Held-out stdlib code (demo, bigram, random small-k3) and held-out chat (demo, bigram) perplexities."""
    text = heldout_text(model_dir, heldout_bytes)
    tokenizer = KimiTokenizer.from_pretrained(model_dir)
    eval_ids, num_bytes = tokenizer.encode(text), len(text.encode("utf-8"))
    train_ids = training_tokens(model_dir)
    chat_ids = heldout_chat_ids(model_dir)
    chat_bytes = len(b"".join(tokenizer.id_to_bytes(i) for i in chat_ids))
    model = load_model(model_dir, LoadConfig(dtype="float32"))
    result = {"heldout_bytes": num_bytes, "demo": perplexity_of(model_dir, text),
              "bigram": bigram_perplexity(train_ids, eval_ids, tokenizer.vocab_size, num_bytes),
              "chat_heldout": {"demo": _ppl(model_nats(model, chat_ids), len(chat_ids) - 1, chat_bytes),
                               "bigram": bigram_perplexity(train_ids, chat_ids, tokenizer.vocab_size, chat_bytes)}}
    if not random_baseline:
        return result
    from engine.model.checkpoint import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint("small-k3", tmp)
        result["random_small_k3"] = perplexity_of(Path(tmp), text)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model_dir", nargs="?", default=str(DEFAULT_MODEL))
    parser.add_argument("--heldout-bytes", type=int, default=40_000)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--no-random-baseline", action="store_true", help="skip the random small-k3 (minutes)")
    parser.add_argument("--no-perplexity", action="store_true", help="the chat prompts only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    run = json.loads((model_dir / "training_run.json").read_text())
    result = {"model": str(model_dir), "size_on_disk_bytes": size_on_disk(model_dir),
              "train_seconds": run["train_seconds"], "tokens_seen": run["tokens_seen"],
              "parameters": run["parameters"], "chat": chat_scores(model_dir, args.max_tokens),
              "perplexity": None if args.no_perplexity else perplexities(model_dir, args.heldout_bytes,
                                                                         not args.no_random_baseline)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
