"""Datasets of the kdamesh lm-eval tasks, read from the JSONL files next to this file (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _load(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_choice(**_) -> datasets.DatasetDict:
    return _load("choice.jsonl")


def load_answer(**_) -> datasets.DatasetDict:
    return _load("answer.jsonl")
