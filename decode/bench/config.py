"""What a benchmark run measures: its settings (``BenchConfig``), the γ/temperature/batch lists of the command
line, and the list of methods (plain, ours at each γ, HF assisted generation) built from them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from decode.compiling import check_compile
from decode.lookup import check_prompt_lookup

OURS, HF = "ours", "hf"
BATCHING = ("static", "continuous")  # the batch pass's two ways to batch (BenchConfig.batching)


@dataclass
class BenchConfig:
    """Everything a run depends on; stored verbatim in ``results.json["config"]``."""

    gammas: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    auto: bool = True  # also run num_draft_tokens="auto"
    auto_max_gamma: int = 8  # upper bound of the adaptive γ controller
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8])
    # How the batch pass batches: "static" (generate() calls of batch_size rows: a batch ends with its slowest row)
    # and/or "continuous" (a stream of requests, batch_size at a time, joining as others finish: the server's way).
    batching: list[str] = field(default_factory=lambda: ["static", "continuous"])
    max_new_tokens: int = 64
    hf: bool = True  # run HF generate (target alone, and with assistant_model=draft)
    # Extra HF assisted runs at fixed γ (constant schedule, no confidence stop), next to HF's defaults.
    hf_gammas: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # always generate max_new_tokens (comparable token counts across methods)
    batch_gamma: int | None = None  # γ for the batch pass; None: best measured fixed γ at that temperature
    cost_context_tokens: int | None = None  # None: mean prompt length + max_new_tokens // 2
    cost_repeats: int = 21
    # Timed runs of each method on each prompt (and batch); the run with the median wall time is the one recorded.
    repeats: int = 1
    warmup: bool = True
    seed: int = 0
    # Also run our decoder built with SpeculativeDecoder(..., compile=compile) (True: both models' forwards;
    # "draft": the draft's only): plain_compiled, spec_g{γ}_compiled.
    compile: bool | str = False
    # SpeculativeDecoder(few_row_linear=...) for our decoder: None = its default (on for float32 CPU models).
    few_row_linear: bool | None = None
    # SpeculativeDecoder(prompt_lookup_ngram=...) for our speculative methods: prompt lookup for greedy runs (0: off).
    prompt_lookup_ngram: int = 0
    # Attach a decode.profile.StepProfile to our methods' timed main-pass calls (runs[].profile): a little overhead.
    profile: bool = False
    # Descriptive, filled by the CLI.
    target: str | None = None
    draft: str | None = None
    target_revision: str | None = None  # the hub snapshot commit of a hub id (decode.loading.hub_revision)
    draft_revision: str | None = None
    draft_tokenizer: str | None = None  # --draft-tokenizer as given (None: the draft's own, else the target's)
    # the draft's tokenizer has another vocabulary than the target's (decode.cross_vocab; HF: universal assisted
    # decoding)
    cross_vocab: bool = False
    prompts: str | None = None
    limit: int | None = None
    max_prompt_tokens: int | None = None  # prompts were cut to their last this-many tokens
    chat_template: bool | None = None  # whether the prompts went through the tokenizer's chat template
    chat_template_source: str | None = None  # the tokenizer whose template it was (its path or hub id)
    device: str | None = None
    dtype: str | None = None

    def validate(self) -> None:
        """Raise ValueError naming the bad setting and the fix; called before any model work starts."""
        check_compile(self.compile)  # the decoder's own checks of the settings, before any model loads
        check_prompt_lookup(self.prompt_lookup_ngram, name="--prompt-lookup-ngram (prompt_lookup_ngram)")
        if not self.gammas and not self.auto:
            raise ValueError("no speculative method to run: give --gammas with at least one γ >= 1, or 'auto'")
        if any((not isinstance(g, int)) or g < 1 for g in self.gammas):
            raise ValueError(f"every γ must be an integer >= 1 (got {self.gammas}); γ=0 (plain decoding) always runs")
        if any((not math.isfinite(t)) or t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"--temperatures (temperatures) must be >= 0 and finite, at least one (got {self.temperatures})")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"--batch-sizes (batch_sizes) must each be >= 1 (got {self.batch_sizes})")
        if not self.batching or any(b not in BATCHING for b in self.batching):
            raise ValueError(f"--batching (batching) takes one or both of {', '.join(BATCHING)} (got "
                             f"{self.batching})")
        if self.batching == ["continuous"] and max(self.batch_sizes, default=1) < 2:
            raise ValueError(f"--batching continuous runs streams at batch sizes > 1 (at 1 a stream is the main pass), "
                             f"but --batch-sizes (batch_sizes) is {self.batch_sizes}: add a size > 1 or static")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens (max_new_tokens) must be >= 1 (got {self.max_new_tokens})")
        if isinstance(self.cost_repeats, bool) or not isinstance(self.cost_repeats, int) or self.cost_repeats < 3:
            raise ValueError(f"--cost-repeats (cost_repeats) must be an integer >= 3 for a meaningful median "
                             f"(got {self.cost_repeats!r})")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"--repeats (repeats) must be an integer >= 1: timed runs per prompt and method, the "
                             f"median kept (got {self.repeats!r})")
        if self.auto_max_gamma < 1:  # the decoder refuses max_auto_draft_tokens < 1 whether or not auto runs
            raise ValueError(f"--auto-max-gamma (auto_max_gamma) must be >= 1 (got {self.auto_max_gamma})")
        if any(g < 1 for g in self.hf_gammas):
            raise ValueError(f"--hf-gammas (hf_gammas) must each be >= 1 (got {self.hf_gammas})")
        if self.batch_gamma is not None and self.batch_gamma < 1:
            raise ValueError(f"--batch-gamma (batch_gamma) must be >= 1 (got {self.batch_gamma})")
        if self.cost_context_tokens is not None and self.cost_context_tokens < 2:
            raise ValueError(f"--cost-context (cost_context_tokens) must be >= 2: one prefilled token and the one "
                             f"timed (got {self.cost_context_tokens}); omit it for mean prompt + max_new_tokens // 2")
        for name, values in (("gammas", self.gammas), ("temperatures", self.temperatures),
                             ("batch_sizes", self.batch_sizes), ("hf_gammas", self.hf_gammas),
                             ("batching", self.batching)):
            if len(set(values)) != len(values):  # each would run, and be pooled, twice
                raise ValueError(f"--{name.replace('_', '-')} ({name}) lists a value twice ({values}); give each once")


def parse_gammas(text: str, option: str = "--gammas") -> tuple[list[int], bool]:
    """Parse ``"1,2,4,8,auto"`` -> ([1, 2, 4, 8], True): sorted, each γ once. Raises ValueError naming ``option``
    and the bad item."""
    gammas, auto = [], False
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        if item.lower() == "auto":
            auto = True
            continue
        try:
            g = int(item)
        except ValueError:
            raise ValueError(f"bad γ {item!r} in {option} {text!r}: use comma-separated integers >= 1 and/or "
                             f"'auto', e.g. {option} 1,2,4,8") from None
        if g < 1:
            raise ValueError(f"bad γ {g} in {option} {text!r}: every γ must be >= 1 (plain decoding, γ=0, always "
                             "runs)")
        gammas.append(g)
    if not gammas and not auto:
        raise ValueError(f"empty γ list {option} {text!r}: e.g. {option} 1,2,4,8")
    return sorted(set(gammas)), auto


def parse_list(text: str, kind: type, what: str) -> list:
    """Parse a comma-separated list of ``kind`` (``"0,1"`` -> [0.0, 1.0]) in the order given, each value once
    (``"0,0.0,1"`` -> [0.0, 1.0]: duplicates are compared as parsed values); ValueError names ``what``."""
    try:
        out = [kind(s.strip()) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"bad {what} list {text!r}: use comma-separated numbers, e.g. 0,1") from None
    if not out:
        raise ValueError(f"empty {what} list {text!r}")
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Method:
    """One way to decode: ``kind`` is OURS or HF; ``gamma`` is 0 (plain), an int or "auto" for ours; for HF None
    (its own assistant settings) or the fixed num_assistant_tokens of an assisted run. ``compiled``: ours, run by
    the decoder built with ``compile=True``."""

    name: str
    kind: str
    gamma: int | str | None
    assisted: bool = False  # HF only: generate(..., assistant_model=draft)
    compiled: bool = False


def build_methods(cfg: BenchConfig) -> list[Method]:
    """plain, spec_g{γ} for each γ, spec_auto, [plain_compiled, spec_g{γ}_compiled, spec_auto_compiled], hf_target,
    hf_assisted, hf_assisted_g{γ} (as configured)."""
    methods = [Method("plain", OURS, 0)] + [Method(f"spec_g{g}", OURS, g) for g in cfg.gammas]
    if cfg.auto:
        methods.append(Method("spec_auto", OURS, "auto"))
    if cfg.compile:
        methods.append(Method("plain_compiled", OURS, 0, compiled=True))
        methods += [Method(f"spec_g{g}_compiled", OURS, g, compiled=True) for g in cfg.gammas]
        if cfg.auto:  # also what the batch pass runs, so its batch size 1 reuses these rows
            methods.append(Method("spec_auto_compiled", OURS, "auto", compiled=True))
    if cfg.hf:
        methods += [Method("hf_target", HF, None), Method("hf_assisted", HF, None, assisted=True)]
        methods += [Method(f"hf_assisted_g{g}", HF, g, assisted=True) for g in cfg.hf_gammas]
    return methods
