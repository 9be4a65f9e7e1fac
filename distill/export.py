"""Export a training checkpoint as a plain Hugging Face draft: LoRA merged, safetensors, tokenizer, and a card.

The card (``README.md`` + ``draftkit_card.json``) names the target, holds the training config and the α/τ measured
per temperature by the last evaluation of that checkpoint, so a draft is never shipped without its acceptance.
The result loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` and works as ``assistant_model`` in
``transformers`` ``generate`` or as the draft of ``decode.SpeculativeDecoder``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distill.checkpoint import read_state

CARD_JSON = "draftkit_card.json"


def load_checkpoint_draft(checkpoint: str | Path, dtype: Any = None) -> tuple[Any, Any, dict]:
    """(draft with any LoRA merged, tokenizer, trainer_state) of a checkpoint folder (``step_N`` or ``best``).

    Raises FileNotFoundError if the folder is not a checkpoint or the LoRA base is missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = Path(checkpoint)
    state = read_state(checkpoint)
    draft_dir = checkpoint / "draft"
    kw = {"dtype": dtype} if dtype is not None else {}
    if (draft_dir / "adapter_config.json").exists():
        from peft import PeftModel

        base_path = state.get("draft_base")
        if not base_path or (base_path.startswith(("/", ".")) and not Path(base_path).exists()):
            raise FileNotFoundError(f"the LoRA base of {checkpoint} ({base_path!r}) is missing; it is the draft "
                                    "checkpoint the run started from (or <output_dir>/draft_base for a built draft)")
        base = AutoModelForCausalLM.from_pretrained(base_path, **kw)
        draft = PeftModel.from_pretrained(base, str(draft_dir)).merge_and_unload()
    else:
        draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(draft_dir))
    return draft.eval(), tokenizer, state


def serving_commands(target: str, draft_dir: str, evaluation: dict | None, config: dict | None) -> dict:
    """Command lines that serve the exported draft in vLLM and SGLang, with γ from the recipe's evaluation.

    γ is the ``best_gamma`` the evaluation picked at its lowest measured temperature (greedy when measured; the
    table lists the best γ per temperature); without an evaluation it is the training config's
    ``eval.num_draft_tokens`` and ``gamma_source`` says so. vLLM's draft-model speculation takes
    ``--speculative-config`` with ``model``, ``num_speculative_tokens`` and ``method: draft_model`` (older vLLM
    releases infer the method and reject the key: drop it there); SGLang's STANDALONE algorithm runs a chain of
    ``--speculative-num-steps`` draft steps with top-k 1, verifying γ + 1 tokens per step.
    """
    per_t = (evaluation or {}).get("per_temperature") or {}
    if per_t:
        temp = min(per_t, key=lambda t: float(t))
        gamma, source = int(per_t[temp]["best_gamma"]), f"best γ of the evaluation at temperature {temp}"
    else:
        gamma = int(((config or {}).get("eval") or {}).get("num_draft_tokens") or 4)
        source = "eval.num_draft_tokens of the training config (no evaluation recorded: γ was not measured)"
    spec = json.dumps({"model": draft_dir, "num_speculative_tokens": gamma, "method": "draft_model"})
    vllm = f"vllm serve {target} --speculative-config '{spec}'"
    sglang = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm STANDALONE "
              f"--speculative-draft-model-path {draft_dir} --speculative-num-steps {gamma} "
              f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}")
    return {"num_draft_tokens": gamma, "gamma_source": source, "vllm": vllm, "sglang": sglang}


def _card_markdown(card: dict) -> str:
    ev = card.get("evaluation") or {}
    rows = "\n".join(
        f"| {t} | {m['acceptance_rate']:.3f} | {m['mean_accepted_length']:.2f} | {m['best_gamma']} | "
        f"{m['predicted_speedup']:.2f} |" for t, m in (ev.get("per_temperature") or {}).items())
    table = ("| temperature | α (acceptance rate) | τ (mean accepted length) | best γ | predicted speedup |\n"
             "| --- | --- | --- | --- | --- |\n" + rows) if rows else "No evaluation was recorded in the checkpoint."
    return f"""---
library_name: transformers
tags: [speculative-decoding, draft-model, distillation, draftkit]
---
# Draft model for `{card['target']}`

A draft model for speculative decoding, distilled against the frozen target `{card['target']}` with
draftkit (`python -m distill train`, loss `{card['loss']}`, {card['steps']} steps).
LoRA merged: {card['lora_merged']}.

## Measured acceptance (held-out prompts, γ = {ev.get('num_draft_tokens', '?')}, step {ev.get('step', '?')})

{table}

Cost ratio c (draft / target forward time) used for the prediction: {ev.get('cost_ratio', float('nan')):.3f}.
The predicted speedup is Leviathan et al. (2023): (1 − α^(γ+1)) / ((1 − α)(γc + 1)).

## Use

```python
from transformers import AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained("{card['target']}")
draft = AutoModelForCausalLM.from_pretrained("PATH_TO_THIS_FOLDER")
out = target.generate(input_ids, assistant_model=draft, max_new_tokens=128)
```

## Serve

With γ = {card['serving']['num_draft_tokens']} ({card['serving']['gamma_source']}):

```bash
{card['serving']['vllm']}
{card['serving']['sglang']}
```

The full training config is in `{CARD_JSON}` (key `config`).
"""


def export(checkpoint: str | Path, out_dir: str | Path, dtype: Any = None) -> dict:
    """Write the merged draft, its tokenizer and the card to ``out_dir``; returns the card dict.

    Raises FileNotFoundError if ``checkpoint`` is not a checkpoint folder.
    """
    import yaml

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    draft, tokenizer, state = load_checkpoint_draft(checkpoint, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    cfg_file = checkpoint / "config.yaml"
    config = yaml.safe_load(cfg_file.read_text()) if cfg_file.exists() else None
    card = {"target": state.get("target"), "checkpoint": str(checkpoint.resolve()), "steps": state.get("step"),
            "tokens_seen": state.get("tokens_seen"), "lora_merged": bool(state.get("lora")),
            "loss": (config or {}).get("loss", {}).get("name"), "evaluation": state.get("last_eval"),
            "initial_evaluation": state.get("initial_eval"), "best": state.get("best"), "config": config}
    card["serving"] = serving_commands(str(card["target"]), str(out_dir.resolve()), card["evaluation"], config)
    (out_dir / CARD_JSON).write_text(json.dumps(card, indent=2))
    (out_dir / "README.md").write_text(_card_markdown(card))
    return card
