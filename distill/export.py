"""Export a training checkpoint as a plain Hugging Face draft: LoRA merged, safetensors, tokenizer, and a card.

The card (``README.md`` + ``draftkit_card.json``) names the target, holds the training config and the α/τ measured
per temperature by the last evaluation of that checkpoint, so a draft is never shipped without its acceptance.
The result loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` and works as ``assistant_model`` in
``transformers`` ``generate`` or as the draft of ``decode.SpeculativeDecoder``.

Before anything is written the draft is checked for what vLLM's ``draft_model`` speculation and SGLang's
STANDALONE algorithm would reject (:mod:`distill.engine_checks`): a draft that fails is refused, or with
``draftkit_only`` exported for draftkit's decoder with a card that has no vLLM/SGLang lines and says why. A
vocabulary-pruned draft (``draft.vocab.keep``) loads with ``decode.loading.load_causal_lm`` and decodes with
draftkit's decoder only, and its card says so; ``full_vocab`` expands its head back to the full vocabulary
(:func:`decode.vocab_map.expand_draft_head`) so the engines can serve it. The checkpoint may also be an earlier
export (a folder with ``draftkit_card.json``): its card is carried over and ``exported_from`` names it.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from decode.compat import output_vocab_size
from decode.loading import (RemoteCodeError, load_causal_lm, load_tokenizer, local_folder, looks_local, run_draft_base,
                            untie_adapted_weights)
from decode.outputs import check_output_dir, umask
from decode.vllm_card import CARD_JSON, served_markdown
from decode.vocab_map import MAP_KEY, draft_vocab_map, expand_draft_head
from distill.checkpoint import (MANIFEST_FILE, CheckpointError, load_weights, load_tensors, read_config,
                                read_state)
from distill.engine_checks import ENGINES, EngineProblem, check_quantization, engine_problems, read_target_config


def load_checkpoint_draft(checkpoint: str | Path, dtype: Any = None, trust_remote_code: bool = False,
                          lora_base: str | Path | None = None) -> tuple[Any, Any, dict]:
    """(draft with any LoRA merged, tokenizer, trainer_state) of a checkpoint folder (``step_N`` or ``best``).

    A LoRA checkpoint's adapter is applied to its base (``draft_base``: the draft the run started from), whose
    folder gives the architecture; the weights are then the checkpoint's own full copy (``model.safetensors``:
    base and adapter as trained), so a base folder changed after training (re-exported over, fine-tuned in place)
    does not change what is merged. ``lora_base`` replaces the recorded base: the same draft moved elsewhere (its
    weights are used only by a checkpoint without that full copy, a DeepSpeed/FSDP one).

    The draft, its LoRA base and its tokenizer load through ``decode.loading`` (a pruned draft's head and map
    restored); a folder that ships its own Python code (``auto_map``) is refused unless ``trust_remote_code``.

    Raises FileNotFoundError if the folder is not a checkpoint or the LoRA base is missing; CheckpointError if the
    checkpoint's weights do not fit the base's architecture; ``decode.loading.RemoteCodeError`` (a ValueError) for
    a draft, base or tokenizer with its own code while ``trust_remote_code`` is off.
    """
    checkpoint = Path(checkpoint)
    state = read_state(checkpoint)
    draft_dir = checkpoint / "draft"
    if (draft_dir / "adapter_config.json").exists():
        from peft import PeftModel

        run = checkpoint.resolve().parent  # a moved or copied run's own draft_base, not the recorded old place
        base_path = str(lora_base) if lora_base is not None else run_draft_base(run, state.get("draft_base"))
        if not base_path or (base_path.startswith(("/", ".")) and not Path(base_path).exists()):
            raise FileNotFoundError(
                f"the LoRA base of {checkpoint} ({base_path!r}) is missing; it is the draft checkpoint the run "
                "started from (or <output_dir>/draft_base for a built draft). If it moved, give its new place: "
                f"python -m distill export {checkpoint} OUT_DIR --lora-base NEW_PATH (its config gives the "
                "architecture, the weights are the checkpoint's own), then use OUT_DIR")
        base = load_causal_lm(base_path, "LoRA base", dtype, trust_remote_code=trust_remote_code)
        peft_model = PeftModel.from_pretrained(base, str(draft_dir))
        if (checkpoint / "model.safetensors").is_file():  # not in a DeepSpeed/FSDP checkpoint (accelerate/)
            tensors = load_tensors(checkpoint / "model.safetensors")
            _check_base_head(tensors, base, base_path, checkpoint)
            load_weights(peft_model, tensors, checkpoint)
        untie_adapted_weights(peft_model)
        draft = peft_model.merge_and_unload()
    else:
        draft = load_causal_lm(str(draft_dir), "draft", dtype, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(str(draft_dir), "draft tokenizer", trust_remote_code=trust_remote_code,
                               fix="save the tokenizer in the checkpoint's draft/ folder")
    return draft.eval(), tokenizer, state


def _check_base_head(tensors: dict, base: Any, base_path: str, checkpoint: Path) -> None:
    """A vocabulary-pruned checkpoint needs a base pruned to as many ids (the run's ``draft_base``); a full-head
    base failed with the raw state-dict size mismatch.

    Raises:
        CheckpointError: naming both head sizes and ``--lora-base <output_dir>/draft_base``.
    """
    maps = [t for key, t in tensors.items() if key.split(".")[-1] == MAP_KEY]
    own = draft_vocab_map(base)
    if maps and (own is None or own.numel() != maps[0].numel()):
        head = "a full" if own is None else f"a {own.numel()}-id pruned"
        raise CheckpointError(
            f"{checkpoint} is a vocabulary-pruned draft ({maps[0].numel()} ids) but the LoRA base {base_path!r} has "
            f"{head} head ({output_vocab_size(base)} rows): give the pruned base the run saved, "
            f"python -m distill export {checkpoint} OUT_DIR --lora-base <output_dir>/draft_base")


# What an export written before the card listed its files could hold: save_pretrained's config, weights (one file
# or shards and their index) and remote-code modules, every tokenizer's files, and the card.
EARLIER_EXPORT_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                        "configuration_*.py", "modeling_*.py", "tokenization_*.py", "tokenizer*", "*.model",
                        "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template.*",
                        "README.md", CARD_JSON)


def _not_export_files(out_dir: Path) -> list[str]:
    """Names in ``out_dir`` (an earlier export) that the export did not write: its card's ``files`` list, or for a
    card without one, the names in :data:`EARLIER_EXPORT_FILES`."""
    try:
        files = json.loads((out_dir / CARD_JSON).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if isinstance(files, list):
        return sorted(p.name for p in out_dir.iterdir() if p.name not in files)
    return sorted(p.name for p in out_dir.iterdir()
                  if not p.is_file() or not any(fnmatch.fnmatchcase(p.name, pat) for pat in EARLIER_EXPORT_FILES))


def check_export_dir(out_dir: str | Path, overwrite: bool = False) -> Path:
    """``out_dir`` must be missing or empty; with ``overwrite`` it may hold an earlier export (it has
    ``draftkit_card.json``) and only the files that export wrote: anything else there (a user's notes, eval results)
    is refused, never deleted. Raises CheckpointError naming the fix."""
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"OUT_DIR {out_dir} is a file; give a folder")
    if not out_dir.exists():
        try:
            check_output_dir(out_dir, "OUT_DIR")  # under a file, or in a folder that cannot be written
        except ValueError as err:
            raise CheckpointError(str(err)) from None
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise CheckpointError(f"OUT_DIR {out_dir} is not empty; nothing was written. Choose a new folder, or pass "
                                  "--overwrite (overwrite=True from Python) to replace an earlier export there")
        if not is_export(out_dir):
            raise CheckpointError(f"OUT_DIR {out_dir} holds files that are not a draftkit export (no {CARD_JSON}); "
                                  "--overwrite only replaces an earlier export. Choose a new folder")
        foreign = _not_export_files(out_dir)
        if foreign:
            more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            raise CheckpointError(
                f"OUT_DIR {out_dir} holds an earlier export and also what the export did not write "
                f"({', '.join(foreign[:3])}{more}); --overwrite replaces only an earlier export's own files, so "
                "nothing was changed. Move those out of OUT_DIR, or choose another folder")
    return out_dir


def stopped_export_folders(out_dir: str | Path) -> dict[str, list[Path]]:
    """Folders an export into ``out_dir`` that was stopped without cleaning up (SIGKILL, power loss) left beside it,
    as :func:`export` names them: ``{"moved_aside": [...], "partial": [...]}``. ``.OUT.<id>.old`` holds the earlier
    export, moved aside just before the new one was renamed into place (when ``out_dir`` is missing, it is the only
    copy); ``.OUT.<id>.tmp`` holds a partial export (or one being written right now by another export). Neither is
    used or deleted by an export: the user decides."""
    out_dir = Path(out_dir).expanduser().resolve()
    if not out_dir.parent.is_dir():
        return {"moved_aside": [], "partial": []}
    found = sorted(p for p in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*") if p.is_dir())
    return {"moved_aside": [p for p in found if p.name.endswith(".old") and is_export(p)],
            "partial": [p for p in found if p.name.endswith(".tmp")]}


def stopped_export_notes(out_dir: str | Path) -> list[str]:
    """One line per folder of :func:`stopped_export_folders`, saying what it holds and that it is kept."""
    found = stopped_export_folders(out_dir)
    return ([f"note: {p} holds an earlier export of {Path(out_dir).name}, moved aside by an export that was stopped "
             "before it finished; it is kept (delete it once you no longer need it)" for p in found["moved_aside"]]
            + [f"note: {p} holds a partial export left by a stopped export (or one that is running now); it is not "
               "used: delete it when no export into that folder is running" for p in found["partial"]])


def serving_commands(target: str, draft_dir: str, evaluation: dict | None, config: dict | None,
                     pruned: bool = False, engines_note: str | None = None, cross_vocab: bool = False) -> dict:
    """Command lines that serve the exported draft in vLLM and SGLang, with γ from the recipe's evaluation.

    A vocabulary-pruned draft (``pruned``) or one that failed the engine checks (``engines_note``: why) has no
    vLLM/SGLang lines (``vllm``/``sglang`` are None); ``draftkit`` is the ``python -m decode serve`` line, which
    reads a pruned draft's id map, in every card.

    γ is the ``best_gamma`` the evaluation picked at its lowest measured temperature (greedy when measured; the
    table lists the best γ per temperature); without an evaluation it is the training config's
    ``eval.num_draft_tokens`` and ``gamma_source`` says so. vLLM's draft-model speculation takes
    ``--speculative-config`` with ``model``, ``num_speculative_tokens``, ``method: draft_model`` (older vLLM
    releases infer the method and reject the key: drop it there) and ``draft_sample_method: probabilistic``: vLLM's
    default drafts greedily and treats the draft as one-hot in the rejection rule, which accepts fewer tokens than
    the card's α at T > 0 (greedy requests are unchanged). SGLang's STANDALONE algorithm runs a chain of
    ``--speculative-num-steps`` draft steps with top-k 1, verifying γ + 1 tokens per step; draftkit does not run
    SGLang, so that line is unmeasured (``sglang_note``). Every argument is shell-quoted (``shlex.split`` gives
    back the exact paths and the JSON).

    A draft with a tokenizer of its own (``cross_vocab``) gets a vLLM line with ``use_heterogeneous_vocab: true``
    (vLLM's token-level intersection, the method it was trained with; vLLM then reads the draft's tokenizer from its
    folder and allows greedy draft sampling only), marked not run by draftkit (``vllm_note``), and no SGLang line.
    """
    per_t = (evaluation or {}).get("per_temperature") or {}
    if per_t:
        temp = min(per_t, key=lambda t: float(t))
        gamma, source = int(per_t[temp]["best_gamma"]), f"best γ of the evaluation at temperature {temp}"
    else:
        gamma = int(((config or {}).get("eval") or {}).get("num_draft_tokens") or 4)
        source = "eval.num_draft_tokens of the training config (no evaluation recorded: γ was not measured)"
    spec = json.dumps({"model": draft_dir, "num_speculative_tokens": gamma, "method": "draft_model",
                       **({"use_heterogeneous_vocab": True, "draft_sample_method": "greedy"} if cross_vocab
                          else {"draft_sample_method": "probabilistic"})})
    vllm = shlex.join(["vllm", "serve", target, "--speculative-config", spec])
    sglang = shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm",
                         "STANDALONE", "--speculative-draft-model-path", draft_dir, "--speculative-num-steps",
                         str(gamma), "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(gamma + 1)])
    draftkit = shlex.join(["python", "-m", "decode", "serve", "--target", target, "--draft", draft_dir,
                           "--num-draft-tokens", str(gamma)])
    if pruned:
        engines_note = engines_note or PRUNED_NOTE
    if engines_note:
        vllm = sglang = None
    if cross_vocab:
        sglang = None
    return {"draft": draft_dir, "num_draft_tokens": gamma, "gamma_source": source, "vllm": vllm, "sglang": sglang,
            "sglang_note": None if sglang is None else SGLANG_NOTE, "engines_note": engines_note,
            "draftkit": draftkit, "vllm_note": CROSS_VLLM_NOTE if cross_vocab and vllm else None}


PRUNED_NOTE = ("its lm_head is vocabulary-pruned, and vLLM and SGLang do not read its id map: re-export it with "
               "--full-vocab (python -m distill export THIS_FOLDER NEW_FOLDER --full-vocab) for them")
SGLANG_NOTE = "not run by draftkit: its acceptance in SGLang is unmeasured"
CROSS_VLLM_NOTE = ("not run by draftkit: vLLM's use_heterogeneous_vocab drafts through the token-level intersection "
                   "(vllm/v1/spec_decode/vocab_mapping.py) with greedy draft sampling only, so at T > 0 it accepts "
                   "fewer tokens than the table's α")


def _verify_markdown(ev: dict) -> str:
    """The card's sentence on the speedup model: verify-aware with the v_γ measured beside c, or Leviathan's."""
    verify = ev.get("verify_costs")
    if not verify or len(verify) < 2:
        return "The predicted speedup is Leviathan et al. (2023): (1 − α^(γ+1)) / ((1 − α)(γc + 1))."
    shown = ", ".join(f"{v:.2f}" for v in verify[1:])
    return ("The predicted speedup is Leviathan et al. (2023) with verify costs: (1 − α^(γ+1)) / ((1 − α)(γc + v_γ)), "
            "v_γ = time of a target forward over γ+1 tokens / over one (v_1.. = "
            f"{shown}; measured beside c unless the training config's eval.verify_costs set them). On a GPU at "
            "batch 1 a verify costs about one forward (v = 1): pass `eval.cost_ratio=C` measured there to predict "
            "for it.")


def _coverage(report: Any) -> dict:
    """The run's held-out coverage of the kept ids (``trainer_state.json``'s ``vocab``: distill.vocab), if recorded."""
    keys = ("heldout_mass", "heldout_token_share", "heldout_positions", "selection_mass", "selection_positions")
    return {k: report[k] for k in keys if isinstance(report, dict) and report.get(k) is not None}


def _coverage_words(pv: dict) -> str:
    if pv.get("heldout_mass") is None:
        return ""
    return (f"; on {pv['heldout_positions']} held-out target tokens they carry {pv['heldout_mass']:.1%} of the "
            f"target's probability mass and {pv['heldout_token_share']:.1%} of its greedy tokens are among them")


def _pruned_markdown(card: dict) -> str:
    """The card's paragraph on a vocabulary-pruned head (empty for a full-vocabulary draft)."""
    pv = card.get("draft_vocab")
    if not pv:
        return ""
    return (f"\n**Vocabulary-pruned draft**: its lm_head scores {pv['kept_ids']} of the target's "
            f"{pv['vocab_size'] or '?'} ids (the ids with the most target probability on the training data"
            f"{_coverage_words(pv)}); the "
            "draft-to-target id map is the int64 tensor `draft_vocab_map` in `model.safetensors` (`config.json`: "
            "`draft_vocab_map_size`, `draft_vocab_tokenizer_hash`). Load it with `decode.loading.load_causal_lm` "
            "(draftkit's decoder puts q = 0 on the other ids, so decoding stays lossless); plain `from_pretrained` "
            "refuses the smaller head, and vLLM and SGLang, which do not read the map, cannot use it: "
            "`python -m distill export THIS_FOLDER NEW_FOLDER --full-vocab` writes a copy they can serve.\n")


def _pairing_markdown(card: dict) -> str:
    """The card's paragraph on a draft with a tokenizer of its own (empty for a draft of the target's)."""
    pairing = card.get("tokenizer_pairing")
    if not pairing:
        return ""
    return (f"\n**A draft with its own tokenizer**: this folder holds the draft's tokenizer (vocabulary "
            f"`{pairing['draft_vocab_hash']}`, {pairing['draft_vocab_size']:,} ids), not the target's (vocabulary "
            f"`{pairing['target_vocab_hash']}`, {pairing['target_vocab_size']:,} ids). The two share "
            f"{pairing['shared_tokens']:,} tokens ({pairing['coverage']:.1%} of the target's). The draft was "
            "trained and is decoded through their token-level intersection (Timor et al., ICML 2025, \"Accelerating "
            "LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies\"): it "
            "reads the target's tokens mapped one to one into its vocabulary and proposes only shared tokens, so "
            "verification is the ordinary rule on the target's tokens and the output is the target's "
            "distribution. draftkit's decoder does this when given both tokenizers (`draft_tokenizer=`, or "
            "the draft's own tokenizer found in its folder).\n")


def _expanded_markdown(card: dict) -> str:
    """The card's paragraph on a head expanded from a pruned one (empty otherwise)."""
    kept = card.get("head_expanded_from")
    if not kept:
        return ""
    return (f"\n**Head expanded from {kept} ids**: the draft was trained with an lm_head over {kept} of the "
            "target's ids; this export gives it a full-vocabulary head whose other rows are zero (logit 0). "
            "Greedy drafting proposes the same ids wherever the best kept logit is positive; a sampled draft puts "
            "some probability on the other ids, so acceptance at T > 0 can differ from the table below "
            "(`python -m decode vllm-check` measures what vLLM accepts).\n")


def _engines_markdown(card: dict) -> str:
    """The card's notes from the engine checks: why vLLM/SGLang lines are missing, and the warnings."""
    note = (card.get("serving") or {}).get("engines_note")
    lines = [] if not note or card.get("draft_vocab") else [f"\n**Not for vLLM or SGLang**: {note}.\n"]
    warnings = [p for p in (card.get("engine_checks") or {}).get("problems") or [] if not p.get("error")]
    if warnings:
        lines.append("\nEngine notes:\n" + "".join(f"- `{p['field']}`: {p['what']}; fix: {p['fix']}.\n"
                                                   for p in warnings))
    return "".join(lines)


def _acceptance_markdown(ev: dict) -> str:
    """The card's acceptance section: the evaluation's table, γ, step and cost model, or that none was recorded."""
    if not ev.get("per_temperature"):
        return ("## Measured acceptance\n\nNo evaluation was recorded in the checkpoint, so acceptance was not "
                "measured. Measure it with `python -m distill eval +target.name_or_path=TARGET "
                "draft.name_or_path=DRAFT` (the target and draft paths of the Use section below).\n")

    def alpha(m: dict) -> str:  # "-": the evaluation recorded no α
        a = m.get("alpha")
        return "-" if a is None else f"{a:.3f}"

    rows = "\n".join(
        f"| {t} | {m['acceptance_rate']:.3f} | {alpha(m)} | {m['mean_accepted_length']:.2f} | {m['best_gamma']} | "
        f"{m['predicted_speedup']:.2f} |" for t, m in ev["per_temperature"].items())
    header = ("| temperature | acceptance rate (Σaccepted/Σdrafted) | α (per-token acceptance) | τ (mean accepted "
              "length) | best γ | predicted speedup |\n| --- | --- | --- | --- | --- | --- |")
    c = ev.get("cost_ratio")
    c = "not recorded" if c is None or c != c else f"{c:.3f}"  # c != c: NaN
    gamma, step = ev.get("num_draft_tokens", "-"), ev.get("step", "-")
    return f"""## Measured acceptance (held-out prompts, γ = {gamma}, step {step})

{header}
{rows}

{_method_markdown(ev)}Cost ratio c (draft / target forward time) used for the prediction: {c}.
{_verify_markdown(ev)}{_slower_markdown(ev)}
"""


def _method_markdown(ev: dict) -> str:
    """How the evaluation got α: teacher-forced (the rate and τ then follow from α) or counted while decoding."""
    if ev.get("method") != "teacher_forced":
        return ""
    return ("α is teacher-forced: the mean over the target's greedy responses to the held-out prompts of Σ min(p, q) "
            "(the chance that speculative sampling accepts the draft's token at each position; at T = 0 whether "
            "both argmaxes agree); the acceptance rate and τ follow from α at γ.\n\n")


def slower_temperatures(ev: dict | None) -> dict[str, float]:
    """``{temperature: predicted speedup}`` of the temperatures at which the evaluation predicts the draft, even at
    its best γ, to be slower than plain decoding of the target (a predicted speedup below 1)."""
    per_t = (ev or {}).get("per_temperature") or {}
    return {t: float(m["predicted_speedup"]) for t, m in per_t.items()
            if m.get("predicted_speedup") is not None and float(m["predicted_speedup"]) < 1}


def _slower_markdown(ev: dict) -> str:
    slower = slower_temperatures(ev)
    if not slower:
        return ""
    shown = ", ".join(f"{t} ({v:.2f}×)" for t, v in slower.items())
    return (f"\n**Predicted slower than plain decoding** at temperature {shown}: at this cost ratio the acceptance "
            "does not pay for the draft's forwards. Measure on the serving hardware (`python -m decode bench`) "
            "before serving it at these temperatures.\n")


def _use_markdown(card: dict) -> str:
    """The card's Use and Serve sections: transformers, vLLM and SGLang, or for a draft they cannot serve (a
    vocabulary-pruned one, whose id map none of them reads, or one that failed the engine checks) draftkit's
    decoder and server."""
    serving = card["serving"]
    if card.get("tokenizer_pairing"):
        return _cross_use_markdown(card)
    if serving.get("vllm"):
        return f"""## Use

The paths are the target's and the one this draft was exported to; change them if you move either folder.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
target = AutoModelForCausalLM.from_pretrained({str(card['target'])!r})
draft = AutoModelForCausalLM.from_pretrained({serving['draft']!r})
tokenizer = AutoTokenizer.from_pretrained({serving['draft']!r})
inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)
print(tokenizer.decode(out[0]))
```

## Serve

With γ = {serving['num_draft_tokens']} ({serving['gamma_source']}){_serve_caveat(card)}:

```bash
# vLLM: draft_sample_method "probabilistic" samples the draft at T > 0, as the acceptance above assumes
{serving['vllm']}
# SGLang ({serving.get('sglang_note') or SGLANG_NOTE})
{serving['sglang']}
```

`python -m decode vllm-check` runs this pair in vLLM and records its served acceptance in this card (docs/vllm.md).
"""
    why = ("A vocabulary-pruned draft runs in draftkit's decoder, which reads its id map: `transformers` assisted "
           "generation, vLLM and SGLang do not (plain `from_pretrained` refuses its smaller head)."
           if card.get("draft_vocab") else "This draft runs in draftkit's decoder; vLLM and SGLang would reject it "
           "(see above).")
    tokenizer = serving["draft"] if card.get("tokenizer_saved", True) else str(card["target"])
    return f"""## Use

The paths are the target's and the one this draft was exported to; change them if you move either folder. {why}

```python
from decode import SpeculativeDecoder
from decode.loading import load_causal_lm, load_tokenizer
target = load_causal_lm({str(card['target'])!r}, "target")
draft = load_causal_lm({serving['draft']!r}, "draft")
tokenizer = load_tokenizer({tokenizer!r})
prompt_ids = tokenizer("def fibonacci(n):")["input_ids"]
decoder = SpeculativeDecoder(target, draft, {serving['num_draft_tokens']}, tokenizer=tokenizer)
out = decoder.generate([prompt_ids], max_new_tokens=128)
print(tokenizer.decode(out.sequences[0]))
```

## Serve

With γ = {serving['num_draft_tokens']} ({serving['gamma_source']}){_serve_caveat(card)}, an OpenAI-compatible server:

```bash
{serving['draftkit']}
```
"""


def _cross_use_markdown(card: dict) -> str:
    """The Use and Serve sections of a draft with a tokenizer of its own: draftkit's decoder with both tokenizers,
    its server, and vLLM's heterogeneous-vocabulary line (not run by draftkit)."""
    serving = card["serving"]
    vllm = (f"# vLLM ({serving['vllm_note']})\n{serving['vllm']}\n" if serving.get("vllm") else "")
    return f"""## Use

The paths are the target's and the one this draft was exported to; change them if you move either folder.

```python
from decode import SpeculativeDecoder
from decode.loading import load_causal_lm, load_tokenizer
target = load_causal_lm({str(card['target'])!r}, "target")
draft = load_causal_lm({serving['draft']!r}, "draft")
tokenizer = load_tokenizer({str(card['target'])!r})
draft_tokenizer = load_tokenizer({serving['draft']!r})
prompt_ids = tokenizer("def fibonacci(n):")["input_ids"]
decoder = SpeculativeDecoder(target, draft, {serving['num_draft_tokens']}, tokenizer=tokenizer,
                             draft_tokenizer=draft_tokenizer)
out = decoder.generate([prompt_ids], max_new_tokens=128)
print(tokenizer.decode(out.sequences[0]))
```

## Serve

With γ = {serving['num_draft_tokens']} ({serving['gamma_source']}){_serve_caveat(card)}:

```bash
# draftkit's OpenAI-compatible server (reads the draft's tokenizer from its folder)
{serving['draftkit']}
{vllm}```
"""


def _serve_caveat(card: dict) -> str:
    slower = slower_temperatures(card.get("evaluation"))
    return f"; predicted slower than plain decoding at temperature {', '.join(slower)}: see above" if slower else ""


def _revision(card: dict) -> str:
    rev = card.get("target_revision")
    earlier = "".join(f"; through step {e['through_step']} against revision `{e['target_revision']}`"
                      for e in card.get("earlier_target_revisions") or [])
    return f" (hub revision `{rev}`{earlier})" if rev else ""


def _target_markdown(card: dict) -> str:
    """A note when the recorded target was not found when the draft was exported (empty otherwise)."""
    if card.get("target_found", True):
        return ""
    return (f"\n**The target was not found at `{card['target']}` when this draft was exported**: replace that path "
            "below with the target's place.\n")


def _dtype_markdown(card: dict) -> str:
    """The weights' dtype, and whether the measured acceptance below is of another dtype."""
    dtype, measured = card.get("dtype"), card.get("evaluated_dtype")
    if not dtype:
        return ""
    if measured and measured != dtype:
        return (f"Weights: {dtype} (converted at export from the checkpoint's {measured}, in which the acceptance "
                f"below was measured; measure this export with `python -m distill eval ... draft.dtype={dtype}`).")
    if measured and dtype != "float32":  # distill eval loads a draft as float32 unless told
        return (f"Weights: {dtype}, in which the acceptance below was measured (`python -m distill eval` reproduces "
                f"it with `draft.dtype={dtype}`).")
    return f"Weights: {dtype}."


def _card_markdown(card: dict) -> str:
    # a vocabulary-pruned draft does not load with transformers alone (its head is smaller than its config says),
    # and one that failed the engine checks may not serve as the draft that was measured
    library = "library_name: transformers\n" if (card.get("serving") or {}).get("vllm") else ""
    return f"""---
{library}tags: [speculative-decoding, draft-model, distillation, draftkit]
---
# Draft model for `{card['target']}`

A draft model for speculative decoding, distilled against the frozen target `{card['target']}`{_revision(card)} with
draftkit (`python -m distill train`, loss `{card['loss']}`, {card['steps']} steps).
LoRA merged: {card['lora_merged']}. {_dtype_markdown(card)}{_exported_from(card)}
{_target_markdown(card)}{_pairing_markdown(card)}{_pruned_markdown(card)}{_expanded_markdown(card)}{_engines_markdown(card)}
{_acceptance_markdown(card.get('evaluation') or {})}
{_use_markdown(card)}
The full training config is in `{CARD_JSON}` (key `config`).
{_served(card)}"""


def _served(card: dict) -> str:
    """vLLM's served acceptance recorded by ``python -m decode vllm-check`` (kept by a re-export with the same
    weights, which the section then says), if any."""
    section = served_markdown(card)
    if not section:
        return ""
    if card.get("exported_from"):
        heading = "## Served acceptance\n\n"
        section = section.replace(heading, heading + (
            f"These figures were measured on the earlier export `{card['exported_from']}` (or an export before it) "
            "with the same weights as this one; the command below names the folder it ran on, and "
            "`python -m decode vllm-check` on this folder measures it again.\n\n"), 1)
    return "\n" + section


def _exported_from(card: dict) -> str:
    source = card.get("exported_from")
    return f"\nRe-exported from the earlier export `{source}`." if source else ""


def export(checkpoint: str | Path, out_dir: str | Path, dtype: Any = None, overwrite: bool = False,
           trust_remote_code: bool = False, lora_base: str | Path | None = None, full_vocab: bool = False,
           draftkit_only: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Write the merged draft, its tokenizer and the card to ``out_dir``; returns the card dict.

    ``checkpoint`` is a training checkpoint (``step_N``/``best``) or an earlier export (its card is carried over,
    ``exported_from`` names it). Before anything is written the draft is checked for what vLLM and SGLang would
    reject (:func:`distill.engine_checks.engine_problems`, recorded as the card's ``engine_checks``): a
    full-vocabulary draft with an error is refused unless ``draftkit_only``, which exports it for draftkit's
    decoder with a card without vLLM/SGLang lines that says why. A vocabulary-pruned draft is exported for
    draftkit's decoder (the card says vLLM/SGLang need ``full_vocab``); ``full_vocab`` expands its head to the
    full vocabulary first (:func:`decode.vocab_map.expand_draft_head`; the card's ``head_expanded_from``).

    Everything is written to a temporary folder next to ``out_dir`` and renamed into place at the end, so a failed
    export leaves nothing half-written and an earlier export is replaced only when complete. The card lists the
    files written (``files``), so a later ``overwrite`` can tell them from files added to the folder since.
    ``lora_base``: where a LoRA checkpoint's base is now, if it moved (:func:`load_checkpoint_draft`).

    vLLM's served figures (the card's ``served``, from ``python -m decode vllm-check``) describe the weights they
    were measured on: a re-export that keeps the weights (same dtype, no head expanded) carries them, one that
    changes them does not, and ``overwrite`` replaces an earlier export's figures with the source's (none from a
    training checkpoint). ``log`` takes each note on what this export did to the head or the served figures
    (default: print on stderr).

    Raises:
        CheckpointError: ``checkpoint`` is not a complete checkpoint nor an export (a run folder: the message names
            its newest checkpoint, :func:`distill.checkpoint.check_complete`; a plain Hugging Face model folder:
            the message says what export takes), ``out_dir`` is ``checkpoint`` (or
            inside an earlier export read as ``checkpoint``), or ``out_dir`` is not empty or holds more than an
            earlier export (see :func:`check_export_dir`), checked before anything loads.
        FileNotFoundError: the LoRA base is missing.
        CheckpointError: the draft ships its own Python code (``auto_map``) and ``trust_remote_code`` is off.
        CheckpointError: the draft's ``config.json`` has a ``quantization_config`` (checked before it loads).
        CheckpointError: the draft fails an engine check and ``draftkit_only`` is off; nothing was written.
        CheckpointError: the file system refused a write (a full disk, a quota); ``out_dir`` is left as it was.
    """
    checkpoint = Path(checkpoint)
    _check_not_into_source(checkpoint, out_dir)
    out_dir = check_export_dir(out_dir, overwrite)
    earlier_served = (_read_card(out_dir) or {}).get("served")
    draft, tokenizer, source = _load_source(checkpoint, dtype, trust_remote_code, lora_base)
    notes = []
    if full_vocab and draft_vocab_map(draft) is not None:
        source["head_expanded_from"] = int(draft_vocab_map(draft).numel())
        expand_draft_head(draft, int(draft.config.vocab_size))
        notes.append(f"note: the lm_head was expanded from {source['head_expanded_from']} ids to the full vocabulary "
                     "(zero rows for the other ids; the card says what that means for sampled drafting)")
    dropped = not _keep_served(source, draft, expanded=bool(notes))
    if dropped or (earlier_served and earlier_served != source.get("served")):  # overwritten by other figures
        notes.append(SERVED_NOT_CARRIED)
    checks = _engine_checks(draft, tokenizer, str(source.get("target")), draftkit_only, checkpoint,
                            bool(source.get("tokenizer_pairing")))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it private; the export is an ordinary folder
    try:
        try:
            card = _write_export(tmp, draft, tokenizer, source, checks, final_dir=out_dir)
        except Exception as err:  # noqa: BLE001  (tokenizers reports a full disk as a plain Exception)
            if not _is_write_error(err):
                raise
            kept = "the earlier export there is unchanged" if out_dir.exists() else "nothing was written there"
            raise CheckpointError(f"could not write the export to OUT_DIR {out_dir} ({type(err).__name__}: {err}); "
                                  f"{kept}. Free space on that disk, then run the same command again") from err
        old = out_dir.with_name(tmp.name[:-4] + ".old")
        check_export_dir(out_dir, overwrite)  # again: files may have been added to OUT_DIR while this ran
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for line in notes:
        (log or _stderr)(line)
    return card


def _keep_served(source: dict, draft: Any, expanded: bool) -> bool:
    """Drop the source's served figures from ``source`` when this export changes the weights they were measured
    on (the head expanded, another dtype than the earlier export's); False when it dropped some."""
    source_dtype = source.pop("source_dtype", None)
    if not source.get("served"):
        return True
    if expanded or (source_dtype and source_dtype != str(draft.dtype).removeprefix("torch.")):
        del source["served"]
        return False
    return True


SERVED_NOT_CARRIED = (
    "note: the earlier export's served figures (vLLM's acceptance from python -m decode vllm-check, measured on the "
    "earlier weights) are not carried over; python -m decode vllm-check measures the new export")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _read_card(folder: Path) -> dict | None:
    """The draftkit card in ``folder`` as a dict, or None when it has none (or one that does not read)."""
    try:
        card = json.loads((folder / CARD_JSON).read_text())
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) else None


def _check_not_into_source(checkpoint: Path, out_dir: str | Path) -> None:
    """Refuse an ``out_dir`` that is the checkpoint (or earlier export) being read, or a folder inside an earlier
    export (a later ``--overwrite`` of that export would find the new one there and refuse)."""
    source, out = checkpoint.expanduser().resolve(), Path(out_dir).expanduser().resolve()
    if out == source or (source in out.parents and is_export(source)):
        raise CheckpointError(f"OUT_DIR {out} is CHECKPOINT {source} or inside it; an export never writes into the "
                              "folder it reads. Choose another OUT_DIR")


def is_export(folder: str | Path) -> bool:
    """True for a folder written by :func:`export` (it holds ``draftkit_card.json``)."""
    return (Path(folder) / CARD_JSON).is_file()


def _load_source(checkpoint: Path, dtype: Any, trust_remote_code: bool,
                 lora_base: str | Path | None) -> tuple[Any, Any, dict]:
    """(draft, tokenizer or None, the card fields it brings) of a training checkpoint or an earlier export."""
    try:
        if is_export(checkpoint):
            _refuse_quantized(checkpoint, checkpoint)
            return load_export_draft(checkpoint, dtype, trust_remote_code)
        if (checkpoint / "config.json").is_file() and not (checkpoint / MANIFEST_FILE).is_file():
            raise CheckpointError(
                f"{checkpoint} is a plain Hugging Face model (a config.json, no {CARD_JSON} nor {MANIFEST_FILE}), "
                "not a draftkit checkpoint or export: export takes <run>/best, <run>/step_N or an earlier export's "
                "folder. Train it with python -m distill train (draft.name_or_path set to this folder) and export "
                "the run's checkpoint")
        read_state(checkpoint)  # a run folder or an incomplete checkpoint is named before anything loads
        _refuse_quantized(checkpoint / "draft", checkpoint)
        draft, tokenizer, state = load_checkpoint_draft(checkpoint, dtype, trust_remote_code, lora_base)
    except RemoteCodeError as err:  # (its message names decode's --trust-remote-code, which export does not take)
        raise CheckpointError(f"{checkpoint}: the draft, its LoRA base or its tokenizer ships its own Python code "
                              "(auto_map), which export does not run; nothing was written. Read that code first; "
                              "--trust-remote-code (export(..., trust_remote_code=True)) runs it") from err
    return draft, tokenizer, _checkpoint_fields(checkpoint, state)


def _refuse_quantized(folder: Path, checkpoint: Path) -> None:
    """Refuse a draft whose ``config.json`` in ``folder`` has a ``quantization_config``, before transformers loads
    it (and fails on the quantization's own package), with the engine check's words
    (:func:`distill.engine_checks.check_quantization`)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # no readable config: the load names it
    problems = check_quantization(config) if isinstance(config, dict) else []
    if problems:
        raise CheckpointError(f"{checkpoint}: {ENGINES} would not serve this draft as measured, and export does not "
                              "load a quantized draft; nothing was written:\n"
                              + "\n".join(f"  {p}" for p in problems))


# The fields of an earlier export's card that a re-export carries over (the rest describe the new folder).
CARRIED_FIELDS = ("target", "target_revision", "earlier_target_revisions", "checkpoint", "steps", "tokens_seen",
                  "lora_merged", "loss", "evaluation", "initial_evaluation", "best", "config", "evaluated_dtype",
                  "head_expanded_from", "served", "tokenizer_pairing")


def load_export_draft(folder: str | Path, dtype: Any = None,
                      trust_remote_code: bool = False) -> tuple[Any, Any, dict]:
    """(draft, tokenizer or None when the folder has none, card fields) of an earlier export: the fields of
    :data:`CARRIED_FIELDS`, the pruned head's recorded coverage, and ``exported_from``."""
    folder = Path(folder)
    try:
        card = json.loads((folder / CARD_JSON).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder / CARD_JSON} could not be read ({err}); export from the training "
                              "checkpoint instead") from None
    if not isinstance(card, dict):
        raise CheckpointError(f"{folder / CARD_JSON} does not hold a JSON object; export from the training checkpoint")
    draft = load_causal_lm(str(folder), "draft", dtype, trust_remote_code=trust_remote_code).eval()
    try:
        tokenizer = load_tokenizer(str(folder), "draft tokenizer", trust_remote_code=trust_remote_code)
    except FileNotFoundError:
        tokenizer = None  # named by the engine checks
    fields = {k: card[k] for k in CARRIED_FIELDS if k in card}
    fields["vocab_report"] = {k: v for k, v in (card.get("draft_vocab") or {}).items()
                              if k not in ("kept_ids", "lm_head_rows")}
    fields["exported_from"] = str(folder.resolve())
    fields["source_dtype"] = card.get("dtype") or _config_dtype(folder / "config.json")  # (served figures)
    return draft, tokenizer, fields


def _checkpoint_fields(checkpoint: Path, state: dict) -> dict:
    """The card fields a training checkpoint brings: its target, steps, evaluation, config, ..."""
    config = read_config(checkpoint)
    return {"target": state.get("target"), "target_revision": state.get("target_revision"),
            "earlier_target_revisions": state.get("earlier_target_revisions") or [],
            "checkpoint": str(checkpoint.resolve()), "steps": state.get("step"),
            "tokens_seen": state.get("tokens_seen"), "lora_merged": bool(state.get("lora")),
            "loss": (config or {}).get("loss", {}).get("name"), "evaluation": state.get("last_eval"),
            "initial_evaluation": state.get("initial_eval"), "best": state.get("best"), "config": config,
            "evaluated_dtype": _checkpoint_dtype(checkpoint, state),
            "vocab_report": {"vocab_size": state.get("vocab_size"), **_coverage(state.get("vocab"))},
            "tokenizer_pairing": state.get("tokenizer_pairing")}


def _engine_checks(draft: Any, tokenizer: Any, target: str, draftkit_only: bool, checkpoint: Path,
                   cross_vocab: bool = False) -> dict:
    """The card's ``engine_checks``: the problems vLLM/SGLang would hit, the note on the target's config when it
    was not read, and ``servable``. Refuses a full-vocabulary draft with an error unless ``draftkit_only``.
    ``cross_vocab``: the draft has a tokenizer of its own (another vocabulary size is then a note)."""
    target_config, note = read_target_config(target)
    problems = engine_problems(draft, tokenizer, target_config, cross_vocab)
    pruned = draft_vocab_map(draft) is not None
    errors = [p for p in problems if p.error and not (pruned and p.field == "lm_head")]
    if errors and not draftkit_only:
        raise CheckpointError(
            f"{checkpoint}: {ENGINES} would not serve this draft as measured; nothing was written:\n"
            + "\n".join(f"  {p}" for p in errors)
            + "\nFix it, or pass --draftkit-only (export(..., draftkit_only=True)) to export it for draftkit's "
            "decoder only (its card then has no vLLM/SGLang lines)")
    return {"engines": ENGINES, "problems": [p.as_dict() for p in problems], "target_config_note": note,
            "servable": not pruned and not errors and not draftkit_only, "draftkit_only": draftkit_only}


def _engines_note(checks: dict, pruned: bool) -> str | None:
    """Why the card has no vLLM/SGLang lines (None when it has them)."""
    if checks["servable"]:
        return None
    if pruned:
        return PRUNED_NOTE
    errors = [EngineProblem(**p) for p in checks["problems"] if p["error"]]
    if errors:
        return "exported with --draftkit-only: " + "; ".join(f"{p.field}: {p.what} (fix: {p.fix})" for p in errors)
    return "exported with --draftkit-only"


def export_notes(card: dict) -> list[str]:
    """Lines for stderr after an export: why the card has no vLLM/SGLang lines, the engine checks' warnings, and
    a target config that was not compared."""
    checks = card.get("engine_checks") or {}
    note = (card.get("serving") or {}).get("engines_note")
    lines = [f"note: no vLLM/SGLang lines in the card: {note}"] if note else []
    lines += [f"{EngineProblem(**p)}" for p in checks.get("problems") or [] if not p["error"]]
    if checks.get("target_config_note"):
        lines.append(f"note: {checks['target_config_note']}")
    return lines


def _is_write_error(err: Exception) -> bool:
    """True for a write the file system refused (a full disk, a quota), as Python, safetensors (SafetensorError)
    or tokenizers (a plain Exception, "... (os error 28)") report it."""
    return isinstance(err, OSError) or type(err).__name__ == "SafetensorError" or "(os error " in str(err)


def _usual_permissions(folder: Path) -> None:
    """Give the folder's files the mode a new file gets under the process's umask (0644 under 022): transformers'
    ``save_pretrained`` writes ``model.safetensors`` as 0600, which a server running as another user cannot read."""
    mode = 0o666 & ~umask()
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)


def _checkpoint_dtype(checkpoint: Path, state: dict) -> str | None:
    """The dtype the checkpoint's draft was saved (and evaluated) in: its ``config.json``'s, or for a LoRA
    checkpoint its base's; None when not recorded or when the checkpoint has no evaluation."""
    if not state.get("last_eval"):
        return None
    for folder in (checkpoint / "draft", run_draft_base(checkpoint.resolve().parent, state.get("draft_base"))):
        path = Path(folder) / "config.json" if folder else None
        if path is not None and path.is_file():
            return _config_dtype(path)
    return None


def _config_dtype(path: Path) -> str | None:
    """The dtype a ``config.json`` records (``dtype``, or the older ``torch_dtype``); None when it records none or
    does not read."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return str(dtype) if dtype else None


def _write_export(out_dir: Path, draft: Any, tokenizer: Any, source: dict, checks: dict,
                  final_dir: Path | None = None) -> dict:
    """Write the export into ``out_dir`` (the temporary folder); the card's serving lines name ``final_dir``."""
    draft.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    _usual_permissions(out_dir)
    files = sorted({p.name for p in out_dir.iterdir()} | {CARD_JSON, "README.md"})
    source = dict(source)
    report = source.pop("vocab_report", None) or {}
    vocab_map = draft_vocab_map(draft)
    pruned = None if vocab_map is None else {"kept_ids": int(vocab_map.numel()), "vocab_size": report.get("vocab_size"),
                                              "lm_head_rows": int(draft.get_output_embeddings().weight.shape[0]),
                                              **{k: v for k, v in report.items() if k != "vocab_size"}}
    card = {field: source.get(field) for field in CARRIED_FIELDS if field != "served"}
    card.update({"draft_vocab": pruned, "files": files, "dtype": str(draft.dtype).removeprefix("torch."),
                 "exported_from": source.get("exported_from"), "tokenizer_saved": tokenizer is not None,
                 "engine_checks": checks})
    if source.get("served"):
        card["served"] = source["served"]
    target = str(card["target"])  # a hub id not in this machine's cache may still be on the hub
    card["target_found"] = local_folder(target) is not None if looks_local(target) else True
    card["serving"] = serving_commands(target, str((final_dir or out_dir).resolve()), card["evaluation"],
                                       card["config"], pruned=pruned is not None,
                                       engines_note=_engines_note(checks, pruned is not None),
                                       cross_vocab=bool(card.get("tokenizer_pairing")))
    (out_dir / CARD_JSON).write_text(json.dumps(card, indent=2))
    (out_dir / "README.md").write_text(_card_markdown(card))
    return card
