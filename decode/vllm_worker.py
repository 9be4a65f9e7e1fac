"""Run a target, alone and with a draft, in vLLM: the half of ``python -m decode vllm-check`` that runs inside vLLM's
own virtual environment.

It imports nothing from draftkit (that environment has vLLM's pins, not ours): ``python vllm_worker.py JOB OUT``
reads the job (JSON), writes the result (JSON) and reports progress on stderr. The job names ``target``,
``draft``, ``num_draft_tokens``, ``prompts`` (token ids), ``temperatures``, ``max_tokens``, ``seed``, ``dtype``,
``ignore_eos``, ``max_model_len`` and ``enforce_eager``. For each engine ("plain": the target alone, "speculative":
with ``draft_model`` speculation, the draft sampling from its own distribution at T > 0 so the rejection rule sees
its probabilities) and each temperature it records every prompt's output ids, the wall time and vLLM's
speculative-decoding counters (``LLM.get_metrics()``, the difference over that temperature's requests).
"""
from __future__ import annotations

import json
import sys
import time

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
                 "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
PROGRESS = "vllm-check: "  # the prefix of the progress lines vllm-check passes on


def read_counters(llm) -> dict:
    """vLLM's speculative-decoding counters now (zeros before the first step)."""
    out = {name: 0 for name in SPEC_COUNTERS.values()}
    out["accepted_per_position"] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == PER_POSITION:
            out["accepted_per_position"] = [int(v) for v in metric.values]
    return out


def counter_difference(after: dict, before: dict) -> dict:
    """``after − before`` for every counter (per-position lists padded with zeros)."""
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    a, b = after["accepted_per_position"], before["accepted_per_position"]
    b = b + [0] * (len(a) - len(b))
    out["accepted_per_position"] = [x - y for x, y in zip(a, b)]
    return out


def run_engine(job: dict, speculative: bool) -> dict:
    """One engine over every temperature of the job; returns {temperature: result}."""
    from vllm import LLM, SamplingParams  # pylint: disable=import-outside-toplevel,import-error
    from vllm.inputs import TokensPrompt  # pylint: disable=import-outside-toplevel,import-error

    kwargs = {}
    if speculative:
        kwargs["speculative_config"] = {"method": "draft_model", "model": job["draft"],
                                        "num_speculative_tokens": job["num_draft_tokens"],
                                        "draft_sample_method": job.get("draft_sample_method", "probabilistic")}
    print(f"{PROGRESS}starting vLLM ({'target + draft' if speculative else 'target alone'})", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job["dtype"], seed=job["seed"], enforce_eager=job["enforce_eager"],
              max_model_len=job["max_model_len"], max_num_seqs=max(len(job["prompts"]), 1),
              disable_log_stats=False, **kwargs)
    load_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    results = {}
    for temperature in job["temperatures"]:
        params = [SamplingParams(temperature=temperature, max_tokens=job["max_tokens"], seed=job["seed"] + i,
                                 ignore_eos=job["ignore_eos"]) for i in range(len(prompts))]
        before = read_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        results[str(temperature)] = {"outputs": ids, "seconds": seconds, "num_tokens": sum(map(len, ids)),
                                     "counters": counter_difference(read_counters(llm), before)}
        print(f"{PROGRESS}vLLM {'speculative' if speculative else 'plain'} T={temperature:g}: "
              f"{results[str(temperature)]['num_tokens']} tokens in {seconds:.1f} s", file=sys.stderr, flush=True)
    del llm
    return {"load_s": load_s, "per_temperature": results}


def main(job_path: str, out_path: str) -> None:
    """Run the job's engines and write the result."""
    import vllm  # pylint: disable=import-outside-toplevel,import-error

    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    from vllm.platforms import current_platform  # pylint: disable=import-outside-toplevel,import-error

    result = {"vllm_version": vllm.__version__, "device": str(current_platform.device_type),
              "plain": run_engine(job, speculative=False)}
    if job.get("draft"):
        result["speculative"] = run_engine(job, speculative=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine in a new process, which imports this file again
    main(sys.argv[1], sys.argv[2])
