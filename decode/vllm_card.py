"""The served figures on a draft's card: what ``python -m decode vllm-check`` measured in vLLM, beside draftkit's.

``card["served"]["vllm"]`` (written by the check, read by ``distill export`` when it renders the card again) holds
vLLM's version and device, γ, the prompts and tokens, the command, and per temperature vLLM's acceptance rate, τ
and acceptance by position beside draftkit's decoder on the same prompts.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from decode.outputs import replace_text

CARD_JSON = "draftkit_card.json"  # the card of a draftkit export (distill.export writes it)
SERVED_BEGIN = "<!-- served: written by python -m decode vllm-check -->"
SERVED_END = "<!-- /served -->"


def fmt(value: Any, digits: int = 3) -> str:
    """A figure with ``digits`` decimals, or "-" for one not measured (None)."""
    return "-" if value is None else f"{float(value):.{digits}f}"


def served_markdown(card: dict) -> str:
    """The card's "Served acceptance" section (between :data:`SERVED_BEGIN` and :data:`SERVED_END`), or "" when
    no check has run."""
    served = ((card.get("served") or {}).get("vllm"))
    if not served:
        return ""
    rows = []
    for temperature, row in sorted(served["per_temperature"].items(), key=lambda kv: float(kv[0])):
        by_pos = ", ".join(fmt(v, 2) for v in row.get("acceptance_by_position") or []) or "-"
        rows.append(f"| {float(temperature):g} | {fmt(row['acceptance_rate'])} | "
                    f"{fmt(row.get('draftkit_acceptance_rate'))} | {fmt(row['mean_accepted_length'], 2)} | "
                    f"{fmt(row.get('draftkit_mean_accepted_length'), 2)} | {by_pos} |")
    table = "\n".join(["| T | acceptance rate, vLLM | draftkit | τ, vLLM | draftkit | vLLM by position |",
                       "| --- | --- | --- | --- | --- | --- |", *rows])
    sampled = (", the draft sampled from its own distribution at T > 0"
               if any(float(t) > 0 for t in served["per_temperature"]) else "")
    target = f" with the target `{served['target']}`" if served.get("target") else ""
    return (f"{SERVED_BEGIN}\n## Served acceptance\n\nServed acceptance in vLLM {served['version']} "
            f"({served['device']}, {served['dtype']}, γ = {served['num_draft_tokens']}{sampled}){target}, "
            f"measured on {served['num_prompts']} prompts of `{served['prompts']}`, "
            f"{served['max_new_tokens']} new tokens each, beside draftkit's decoder on the same prompts "
            f"({served['date']}):\n\n{table}\n{_failures(served)}\n```bash\n{served['command']}\n```\n{SERVED_END}\n")


def _failures(served: dict) -> str:
    """The check's failures under the table ("" when it passed), so a figure it did not trust is never read alone."""
    lines = served.get("failures") or []
    if not lines:
        return ""
    return "\n**The check failed** (vLLM's figures above are what it measured):\n\n" + "".join(
        f"- {line}\n" for line in lines)


def with_served_section(markdown: str, card: dict) -> str:
    """``markdown`` (a card's README.md) with its served section replaced by the card's, or the section appended."""
    section = served_markdown(card)
    start, end = markdown.find(SERVED_BEGIN), markdown.find(SERVED_END)
    if start >= 0 and end > start:
        return markdown[:start] + section + markdown[end + len(SERVED_END):].lstrip("\n")
    return markdown.rstrip("\n") + "\n\n" + section if section else markdown


def record_served(draft_dir: str | os.PathLike, served: dict) -> bool:
    """Add vLLM's served figures to the draftkit card in ``draft_dir`` (``draftkit_card.json`` key ``served.vllm``
    and the README's served section), each file replaced atomically. Returns False (and writes nothing) when the
    folder holds no draftkit card."""
    folder = Path(draft_dir)
    card_path = folder / CARD_JSON
    if not card_path.is_file():
        return False
    card = json.loads(card_path.read_text())
    card.setdefault("served", {})["vllm"] = served
    readme = folder / "README.md"
    markdown = readme.read_text() if readme.is_file() else ""
    replace_text(card_path, json.dumps(card, indent=2))
    replace_text(readme, with_served_section(markdown, card))
    return True
