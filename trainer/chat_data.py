"""The seeded synthetic chat set of the demo model: tasks whose answers the generator computes, and tool dialogues.

Contract:
- `make_example(rng) -> ChatExample` draws one conversation: `messages` (OpenAI chat form), `tools` (OpenAI tool
  declarations or None), `template_kwargs` (K3 `chat_template_kwargs`: thinking on with an effort, or off), and
  `task` (`Task`: the last user prompt, its kind and what a correct answer holds). The same `random.Random` state
  gives the same example.
- Kinds: "arithmetic" (a + b, a - b, a × b), "string" (reverse, upper case, length, first letter), "list" (sorted,
  max, min, sum, length), "chat" (greetings), "tool" (a declared tool is called with typed arguments, the tool answers,
  the assistant answers from the result). Every assistant turn with thinking on has a non-empty reasoning; a tool
  call turn has empty content. Tools may be declared for a task that needs none (then none is called).
- `expected` of a task: for arithmetic/string/list the answer text that a correct reply contains; for "tool" the tool
  name; for "chat" None.
- `check_reply(task, content, calls)` scores a model reply against its task (see `expected`).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

WORDS = ("apple", "river", "garden", "planet", "silver", "window", "rocket", "forest", "pencil", "castle", "dragon",
         "orange", "butter", "candle", "mirror", "puzzle", "jungle", "marble", "pepper", "ticket", "violin", "wizard",
         "yellow", "banana", "cookie", "engine", "flower", "guitar", "helmet", "island", "jacket", "kitten", "lemon",
         "magnet", "needle", "oyster", "parrot", "rabbit", "saddle", "tomato", "turtle", "velvet", "walnut", "zipper",
         "cloud", "stone", "light", "music", "ocean", "paper", "table", "train", "water", "world", "horse", "bread")
CITIES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo", "Lima", "Sydney", "Toronto",
          "Dublin", "Vienna", "Prague", "Seoul", "Delhi", "Nairobi", "Lisbon", "Athens", "Warsaw", "Boston", "Denver",
          "Chicago", "Austin", "Miami", "Helsinki", "Zurich", "Bangkok", "Hanoi", "Manila", "Jakarta", "Santiago")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD")
SYMBOLS = ("AAPL", "MSFT", "GOOG", "AMZN", "NVDA", "TSLA", "IBM", "ORCL")
EFFORTS = ("max", "max", "max", "high", "low")
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a concise assistant.", "Answer briefly and correctly.")


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = {
    "get_weather": _tool("get_weather", "Get the current weather in a city.", {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    "convert_currency": _tool("convert_currency", "Convert an amount of money between currencies.", {
        "amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
        ["amount", "from_currency", "to_currency"]),
    "set_timer": _tool("set_timer", "Start a countdown timer.", {
        "minutes": {"type": "integer"}, "label": {"type": "string"}}, ["minutes"]),
    "get_stock_price": _tool("get_stock_price", "Look up the latest price of a stock.", {
        "symbol": {"type": "string"}}, ["symbol"]),
}


@dataclass(frozen=True)
class Task:
    kind: str
    prompt: str
    expected: str | None


@dataclass(frozen=True)
class Turn:
    """One user prompt and the assistant's answer, before rendering."""

    task: Task
    reasoning: str
    answer: str


@dataclass(frozen=True)
class ChatExample:
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    task: Task


def _arithmetic(rng: random.Random) -> Turn:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        value, verb = a * b, "multiply"
    else:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        value, verb = (a + b, "add") if op == "+" else (a - b, "subtract")
    sym = {"+": "+", "-": "-", "*": "*"}[op]
    prompt = rng.choice(("What is {a} {s} {b}?", "Compute {a} {s} {b}.", "Calculate {a} {s} {b}",
                         "{a} {s} {b} = ?", "Please work out {a} {s} {b}.")).format(a=a, s=sym, b=b)
    reasoning = f"I need to {verb} {a} and {b}. {a} {sym} {b} = {value}."
    answer = rng.choice(("{a} {s} {b} = {v}.", "The answer is {v}.", "{v}")).format(a=a, s=sym, b=b, v=value)
    return Turn(Task("arithmetic", prompt, str(value)), reasoning, answer)


def _string(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    kind = rng.randrange(4)
    if kind == 0:
        value = word[::-1]
        prompt = rng.choice(('Reverse the word "{w}".', 'Spell "{w}" backwards.', 'What is "{w}" reversed?'))
        reasoning = f'The letters of "{word}" are {" ".join(word)}. Backwards: {" ".join(value)}.'
        answer = f'"{word}" reversed is "{value}".'
    elif kind == 1:
        value = word.upper()
        prompt = rng.choice(('Write "{w}" in upper case.', 'Convert "{w}" to uppercase.'))
        reasoning = f'Upper case of "{word}" is "{value}".'
        answer = f'"{value}"'
    elif kind == 2:
        value = str(len(word))
        prompt = rng.choice(('How many letters are in "{w}"?', 'What is the length of the word "{w}"?'))
        reasoning = f'The letters of "{word}" are {" ".join(word)}. That is {value} letters.'
        answer = f'"{word}" has {value} letters.'
    else:
        value = word[0]
        prompt = rng.choice(('What is the first letter of "{w}"?', 'Which letter does "{w}" start with?'))
        reasoning = f'"{word}" starts with "{value}".'
        answer = f'The first letter of "{word}" is "{value}".'
    return Turn(Task("string", prompt.format(w=word), value), reasoning, answer)


def _list(rng: random.Random) -> Turn:
    items = [rng.randint(0, 50) for _ in range(rng.randint(3, 5))]
    shown = "[" + ", ".join(map(str, items)) + "]"
    kind = rng.randrange(5)
    if kind == 0:
        value = "[" + ", ".join(map(str, sorted(items))) + "]"
        prompt, what = rng.choice(("Sort the list {l}.", "Sort {l} in ascending order.")), "sorted"
    elif kind == 1:
        value, prompt, what = str(max(items)), rng.choice(("What is the largest number in {l}?",
                                                           "Find the maximum of {l}.")), "the maximum"
    elif kind == 2:
        value, prompt, what = str(min(items)), rng.choice(("What is the smallest number in {l}?",
                                                           "Find the minimum of {l}.")), "the minimum"
    elif kind == 3:
        value, prompt, what = str(sum(items)), rng.choice(("What is the sum of {l}?", "Add up {l}.")), "the sum"
    else:
        value, prompt, what = str(len(items)), "How many items are in the list {l}?", "the length"
    reasoning = f"The list is {shown}. Its {what.removeprefix('the ')} is {value}." if kind else \
        f"The list is {shown}. In ascending order: {value}."
    answer = f"{what[0].upper() + what[1:]} of {shown} is {value}." if kind else f"Sorted: {value}."
    return Turn(Task("list", prompt.format(l=shown), value), reasoning, answer)


def _chat(rng: random.Random) -> Turn:
    prompt, answer = rng.choice((("Hello!", "Hello! How can I help you today?"),
                                 ("Hi there.", "Hi! What can I do for you?"),
                                 ("Who are you?", "I am a small demo assistant. I can do simple math, text tasks "
                                                  "and call tools."),
                                 ("Thank you!", "You are welcome!"),
                                 ("What can you do?", "I can add and multiply numbers, work with words and lists, "
                                                      "and call the tools you give me."),
                                 ("Good morning.", "Good morning! How can I help?")))
    return Turn(Task("chat", prompt, None), "The user is chatting. I should reply politely.", answer)


def _weather_call(rng: random.Random) -> tuple[str, dict, dict, str]:
    city = rng.choice(CITIES)
    unit = rng.choice(("celsius", "fahrenheit", None))
    args = {"city": city} | ({"unit": unit} if unit else {})
    prompt = rng.choice(("What is the weather in {c}?", "How is the weather in {c} today?",
                         "Is it warm in {c} right now?", "Tell me the weather for {c}.")).format(c=city)
    if unit:
        prompt = prompt.rstrip(".?") + f" in {unit}?"
    temp, cond = rng.randint(-5, 35), rng.choice(CONDITIONS)
    result = {"city": city, "temperature": temp, "unit": unit or "celsius", "condition": cond}
    final = f"It is {temp} degrees {unit or 'celsius'} and {cond} in {city}."
    return prompt, args, result, final


def _currency_call(rng: random.Random) -> tuple[str, dict, dict, str]:
    src, dst = rng.sample(CURRENCIES, 2)
    amount = rng.choice((10, 20, 50, 100, 250, 1000, 12.5, 99.9))
    prompt = rng.choice(("Convert {a} {s} to {d}.", "How much is {a} {s} in {d}?")).format(a=amount, s=src, d=dst)
    converted = round(amount * rng.uniform(0.5, 1.5), 2)
    result = {"amount": converted, "currency": dst}
    return prompt, {"amount": amount, "from_currency": src, "to_currency": dst}, result, \
        f"{amount} {src} is {converted} {dst}."


def _timer_call(rng: random.Random) -> tuple[str, dict, dict, str]:
    minutes, label = rng.randint(1, 90), rng.choice(("tea", "pasta", "break", "workout", "laundry", "meeting"))
    prompt = rng.choice(("Set a timer for {m} minutes for {l}.", "Start a {m} minute {l} timer.")).format(
        m=minutes, l=label)
    return prompt, {"minutes": minutes, "label": label}, {"status": "started", "minutes": minutes}, \
        f"Your {label} timer for {minutes} minutes has started."


def _stock_call(rng: random.Random) -> tuple[str, dict, dict, str]:
    symbol = rng.choice(SYMBOLS)
    prompt = rng.choice(("What is the stock price of {s}?", "How much is {s} trading at?")).format(s=symbol)
    price = round(rng.uniform(20, 900), 2)
    return prompt, {"symbol": symbol}, {"symbol": symbol, "price": price}, f"{symbol} is trading at {price}."


TOOL_TASKS = {"get_weather": _weather_call, "convert_currency": _currency_call, "set_timer": _timer_call,
              "get_stock_price": _stock_call}
SIMPLE_TASKS = (_arithmetic, _arithmetic, _string, _list, _chat)


def declared_tools(rng: random.Random, needed: str | None) -> list[dict]:
    """The needed tool (if any) and up to two others, shuffled; at least one tool."""
    names = [n for n in TOOLS if n != needed]
    chosen = rng.sample(names, rng.randint(0 if needed else 1, 2)) + ([needed] if needed else [])
    rng.shuffle(chosen)
    return [TOOLS[n] for n in chosen]


def _assistant(content: str, reasoning: str, thinking: bool, calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if thinking:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_dialogue(rng: random.Random, thinking: bool, turn_id: int) -> tuple[list[dict], Task]:
    name = rng.choice(list(TOOL_TASKS))
    prompt, args, result, final = TOOL_TASKS[name](rng)
    call_id = f"call_{turn_id}"
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    reasoning = f"The user asks: {prompt} I will call {name}."
    messages = [{"role": "user", "content": prompt}, _assistant("", reasoning, thinking, [call]),
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": json.dumps(result)},
                _assistant(final, f"The tool returned {json.dumps(result)}. I can answer now.", thinking)]
    return messages, Task("tool", prompt, name)


def make_example(rng: random.Random) -> ChatExample:
    """One seeded conversation (see the module docstring)."""
    thinking = rng.random() < 0.65
    kwargs = {"thinking": True, "thinking_effort": rng.choice(EFFORTS)} if thinking else {"thinking": False}
    if thinking and kwargs["thinking_effort"] == "max" and rng.random() < 0.5:
        kwargs = {}  # the renderer's default: thinking on, effort max
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    needed = None
    for turn_id in range(1 if rng.random() < 0.75 else 2):
        if rng.random() < 0.35:
            dialogue, task = _tool_dialogue(rng, thinking, turn_id)
            messages += dialogue
            needed = task.expected
        else:
            turn = rng.choice(SIMPLE_TASKS)(rng)
            task = turn.task
            messages += [{"role": "user", "content": task.prompt}, _assistant(turn.answer, turn.reasoning, thinking)]
    tools = declared_tools(rng, needed) if needed or rng.random() < 0.25 else None
    return ChatExample(messages, tools or None, kwargs, task)


def prompt_messages(example: ChatExample) -> list[dict]:
    """The conversation up to (not including) the assistant's reply to the last task's prompt."""
    last_user = max(i for i, m in enumerate(example.messages) if m["role"] == "user")
    return example.messages[: last_user + 1]


def check_reply(task: Task, content: str, calls: list[dict]) -> bool:
    """Whether a reply solves `task`: the answer text in the content, or a call of the expected tool."""
    if task.kind == "tool":
        return any(c["name"] == task.expected for c in calls)
    if task.expected is None:
        return bool(content.strip())
    return re.search(rf"(?<![\w-]){re.escape(task.expected)}(?![\w])", content) is not None
