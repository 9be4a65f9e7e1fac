"""Training prompts for a chat target, built from the training corpora, one group per kind of request Spec-Bench
measures (Xia et al. 2024): conversation, translation, summarization, qa, math_reasoning and rag.

No evaluation set is read: the prompts come from GSM8K's train split, Code Alpaca 2k (CC-BY-NC-4.0: a draft
trained on it inherits a non-commercial dataset's terms; drop the kind with ``kinds``), TinyStories and tiny
shakespeare, under the shared data folder (:func:`decode.prompts.shared_data_dir`). The target writes the
responses (``python -m distill generate-data``); these prompts only have to ask for the same kinds of answer.

    conversation    Code Alpaca instructions (+ their input), story writing, a Shakespeare scene to continue
    translation     "Translate English to German/French/Spanish: <a TinyStories sentence>"
    summarization   "Summarize: <TinyStories stories, 800-2,000 characters>"
    qa              short Code Alpaca questions, questions about a story's opening
    math_reasoning  GSM8K train questions
    rag             three TinyStories passages, then a question about one of them
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Callable

from decode.prompts import SHARED_DATA_HINT, shared_data_dir

KINDS = ("conversation", "translation", "summarization", "qa", "math_reasoning", "rag")
LANGUAGES = ("German", "French", "Spanish")


def _read(relpath: str) -> str:
    path = shared_data_dir() / relpath
    if not path.is_file():
        raise FileNotFoundError(f"training prompts need {path}; {SHARED_DATA_HINT}")
    return path.read_text(encoding="utf-8")


# A few TinyStories stories hold UTF-8 quotes and dashes decoded as cp1252 once ("â€œ" for "“"): put them back.
MOJIBAKE = {"â€œ": "“", "â€™": "’", "â€˜": "‘", "â€“": "–", "â€”": "—", "â€Š": " ", "â€": "”"}


def fix_mojibake(text: str) -> str:
    for bad, good in MOJIBAKE.items():
        text = text.replace(bad, good)
    return text


def stories() -> list[str]:
    """TinyStories stories (blank-line separated), whitespace collapsed."""
    text = fix_mojibake(_read("tinystories/tinystories_val.txt"))
    return [" ".join(s.split()) for s in text.split("\n\n") if s.strip()]


def shakespeare_scenes(max_chars: int = 600) -> list[str]:
    """tiny shakespeare cut at speaker turns into excerpts of up to ``max_chars`` characters."""
    turns = [t.strip() for t in _read("tinyshakespeare/input.txt").split("\n\n") if t.strip()]
    scenes, cur = [], ""
    for turn in turns:
        if cur and len(cur) + len(turn) > max_chars:
            scenes.append(cur)
            cur = ""
        cur = f"{cur}\n\n{turn}" if cur else turn
    return scenes


def code_alpaca() -> list[dict]:
    """Code Alpaca 2k rows (instruction, input, output)."""
    return json.loads(_read("code_alpaca/code_alpaca_2k.json"))


def gsm8k_train() -> list[str]:
    """GSM8K train-split questions (never the test split, which Spec-Bench's math_reasoning is drawn from)."""
    return [json.loads(line)["question"] for line in _read("gsm8k/train.jsonl").splitlines() if line.strip()]


def sentences(text: str) -> list[str]:
    """Sentences of a story (split after . ! ?), at least 5 words each."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 5]


def opening(story: str, words: int = 8) -> str:
    """A story's first ``words`` words, to point at it in a question (quotes dropped)."""
    return " ".join(story.replace('"', "").replace("“", "").replace("”", "").split()[:words])


def conversation(rng: random.Random, n: int) -> list[str]:
    rows, scenes = code_alpaca(), shakespeare_scenes()
    firsts = [s[0] for s in map(sentences, stories()) if s]
    makers: list[Callable[[], str]] = [
        lambda: (lambda r: f"{r['instruction']}\n{r['input']}".strip())(rng.choice(rows)),
        lambda: f"Write a short story for children that begins with: \"{rng.choice(firsts)}\"",
        lambda: f"Continue this scene, speaking as its characters:\n\n{rng.choice(scenes)}",
    ]
    return [makers[i % len(makers)]() for i in range(n)]


def translation(rng: random.Random, n: int) -> list[str]:
    pool = [s for story in stories()[:2000] for s in sentences(story) if len(s) < 200]
    return [f"Translate English to {LANGUAGES[i % len(LANGUAGES)]}: {rng.choice(pool)}" for i in range(n)]


def _passage(rng: random.Random, tales: list[str], low: int, high: int) -> str:
    text = rng.choice(tales)
    while len(text) < low:
        text = f"{text} {rng.choice(tales)}"
    return text[:high]


def summarization(rng: random.Random, n: int) -> list[str]:
    tales = stories()
    return [f"Summarize: {_passage(rng, tales, 800, 2000)}" for _ in range(n)]


def qa(rng: random.Random, n: int) -> list[str]:
    questions = [r["instruction"].strip() for r in code_alpaca()
                 if r["instruction"].strip().endswith("?") and not r["input"].strip()]
    tales = stories()
    makers: list[Callable[[], str]] = [
        lambda: rng.choice(questions),
        lambda: f"Who is the story that begins \"{opening(rng.choice(tales))}\" about?",
    ]
    return [makers[i % len(makers)]() for i in range(n)]


def math_reasoning(rng: random.Random, n: int) -> list[str]:
    return rng.sample(gsm8k_train(), n)


def rag(rng: random.Random, n: int) -> list[str]:
    tales = stories()
    asks = ("What happens in the story that begins \"{}\"?", "Who are the characters of the story that begins \"{}\"?",
            "What lesson does the story that begins \"{}\" teach?")
    out = []
    for i in range(n):
        passages = [_passage(rng, tales, 300, 700) for _ in range(3)]
        out.append("\n".join(passages) + "\n" + asks[i % len(asks)].format(opening(rng.choice(passages))))
    return out


BUILDERS: dict[str, Callable[[random.Random, int], list[str]]] = {
    "conversation": conversation, "translation": translation, "summarization": summarization, "qa": qa,
    "math_reasoning": math_reasoning, "rag": rag}


def build_prompts(per_kind: int, seed: int = 0, kinds: tuple[str, ...] = KINDS, tail_per_kind: int = 0) -> list[dict]:
    """``per_kind`` prompts of each kind as ``{"prompt", "kind"}`` rows, deterministic in ``seed``: grouped by kind
    (prompts of one kind have similar lengths, so batched generation pads little), except the last
    ``tail_per_kind`` of each kind, which close the list interleaved kind by kind (the recipe holds out the last
    ``data.holdout`` rows: ``tail_per_kind = holdout / len(kinds)`` gives a held-out set with every kind).

    Raises:
        ValueError: ``per_kind < 1``, a tail outside ``[0, per_kind]`` or an unknown kind.
    """
    if per_kind < 1:
        raise ValueError(f"quickstart.prompts.per_kind must be >= 1, got {per_kind}")
    if not 0 <= tail_per_kind <= per_kind:
        raise ValueError(f"the interleaved tail ({tail_per_kind} per kind) must lie in [0, per_kind={per_kind}]: "
                         "lower data.holdout or raise quickstart.prompts.per_kind")
    unknown = [k for k in kinds if k not in BUILDERS]
    if unknown:
        raise ValueError(f"quickstart.prompts.kinds: unknown kind(s) {unknown}; choose from {list(KINDS)}")
    made = {k: BUILDERS[k](random.Random(f"{seed}:{k}"), per_kind) for k in kinds}
    head = per_kind - tail_per_kind
    grouped = [{"prompt": made[k][i], "kind": k} for k in kinds for i in range(head)]
    return grouped + [{"prompt": made[k][i], "kind": k} for i in range(head, per_kind) for k in kinds]


def write_prompts(path: str | Path, rows: list[dict]) -> Path:
    """Write ``rows`` as JSON lines (a temp file renamed into place: whole or not at all)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return path
