"""Greedy equality, ragged batches, stop/length rules, seeds and bad input for the speculative decoder."""
import pytest
import torch

from decode import NonFiniteLogitsError, SpeculativeDecoder
from decode.batch import left_pad
from tests.conftest import perturbed_copy, tiny_gpt2, tiny_llama

MAX_NEW = 24


@torch.no_grad()
def reference_greedy(model, prompt, max_new_tokens, eos=None):
    """Plain greedy decoding with no KV cache at all: an independent reference."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(nxt)
        if nxt == eos:
            break
    return seq[len(prompt):]


def prompts_of(lengths, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0, layers=2)
    return target, {"copy": target, "random": tiny_llama(seed=1, layers=1), "perturbed": perturbed_copy(target, 0.6)}


@pytest.fixture(scope="module")
def references(pair):
    target, _ = pair
    prompts = prompts_of([1, 5, 11, 3])
    return prompts, [reference_greedy(target, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("gamma", range(1, 9))
@pytest.mark.parametrize("kind", ["copy", "random", "perturbed"])
def test_greedy_equality_batch1(pair, references, gamma, kind):
    target, drafts = pair
    prompts, refs = references
    dec = SpeculativeDecoder(target, drafts[kind], num_draft_tokens=gamma)
    for prompt, ref in zip(prompts[:2], refs[:2]):
        out = dec.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW)
        assert out.new_tokens[0].tolist() == ref
        assert out.sequences[0].tolist() == prompt + ref
        s = out.stats
        if kind == "copy":
            assert s.acceptance_rate == 1.0
            # every full step commits γ+1; only the step cut by max_new_tokens may draft fewer
            assert s.accepted_length_histogram[-1] >= s.num_verify_steps - 1
        if kind == "random":
            assert s.acceptance_rate < 0.1
            assert s.num_verify_steps >= MAX_NEW * 0.9  # about one committed token per step


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("kind", ["copy", "random", "perturbed"])
def test_greedy_equality_ragged_left_padded_batch(pair, references, gamma, kind):
    target, drafts = pair
    prompts, refs = references
    ids, mask = left_pad(prompts, pad_id=0)
    assert mask[0].tolist()[-1] == 1 and mask.sum(1).tolist() == [len(p) for p in prompts]
    out = SpeculativeDecoder(target, drafts[kind], num_draft_tokens=gamma).generate(ids, mask, max_new_tokens=MAX_NEW)
    assert [t.tolist() for t in out.new_tokens] == refs


def test_perturbed_draft_has_ragged_acceptance(pair, references):
    target, drafts = pair
    prompts, _ = references
    out = SpeculativeDecoder(target, drafts["perturbed"], 4).generate(prompts, max_new_tokens=MAX_NEW)
    hist = out.stats.accepted_length_histogram
    assert 0.1 < out.stats.acceptance_rate < 0.95
    assert sum(1 for h in hist if h > 0) >= 3  # rows really accepted different lengths


def test_right_padded_and_list_inputs_match(pair, references):
    target, drafts = pair
    prompts, refs = references
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    dec = SpeculativeDecoder(target, drafts["perturbed"], 3)
    assert [t.tolist() for t in dec.generate(ids, mask, max_new_tokens=MAX_NEW).new_tokens] == refs
    assert [t.tolist() for t in dec.generate(prompts, max_new_tokens=MAX_NEW).new_tokens] == refs


@pytest.mark.parametrize("gamma", [2, 5])
def test_gpt2_pair_greedy_equality(gamma):
    target, draft = tiny_gpt2(seed=0, layers=2), tiny_gpt2(seed=3, layers=1)
    prompts = prompts_of([2, 7, 4], seed=5)
    refs = [reference_greedy(target, p, 16) for p in prompts]
    out = SpeculativeDecoder(target, draft, gamma).generate(prompts, max_new_tokens=16)
    assert [t.tolist() for t in out.new_tokens] == refs


def test_plain_decoding_through_same_engine(pair, references):
    target, drafts = pair
    prompts, refs = references
    out = SpeculativeDecoder(target, drafts["random"], 4).generate(prompts, max_new_tokens=MAX_NEW, num_draft_tokens=0)
    assert [t.tolist() for t in out.new_tokens] == refs
    assert out.stats.num_drafted == 0 and out.stats.mean_accepted_length == 1.0
    assert out.stats.num_target_forwards == MAX_NEW - 1  # the prefill gives the first token
    only_target = SpeculativeDecoder(target, None, 0).generate(prompts, max_new_tokens=MAX_NEW)
    assert [t.tolist() for t in only_target.new_tokens] == refs
    # without a draft, γ defaults to 0
    assert SpeculativeDecoder(target).num_draft_tokens == 0
    assert SpeculativeDecoder(target, drafts["random"]).num_draft_tokens == 4


def test_auto_gamma_is_lossless_and_adapts(pair, references):
    target, drafts = pair
    prompts, refs = references
    dec = SpeculativeDecoder(target, drafts["copy"], "auto", max_auto_draft_tokens=6)
    out = dec.generate(prompts, max_new_tokens=MAX_NEW)
    assert [t.tolist() for t in out.new_tokens] == refs
    assert 1 <= len(out.stats.accepted_per_position) <= 6  # γ stays within [1, max_auto_draft_tokens]
    out = SpeculativeDecoder(target, drafts["random"], "auto").generate(prompts, max_new_tokens=MAX_NEW)
    assert [t.tolist() for t in out.new_tokens] == refs


# ---------------------------------------------------------------- stop and length
def eos_case(pair):
    """A prompt whose greedy continuation contains a token we then declare as eos."""
    target, drafts = pair
    prompt = prompts_of([6], seed=11)[0]
    ref = reference_greedy(target, prompt, MAX_NEW)
    return target, drafts, prompt, ref, ref[5]


@pytest.mark.parametrize("kind", ["copy", "perturbed", "random"])
def test_nothing_after_first_eos(pair, kind):
    target, drafts, prompt, ref, eos = eos_case(pair)
    for gamma in (1, 4, 8):
        out = SpeculativeDecoder(target, drafts[kind], gamma).generate([prompt], max_new_tokens=MAX_NEW, eos_token_id=eos)
        new = out.new_tokens[0].tolist()
        assert new == ref[: ref.index(eos) + 1]
        assert out.stats.num_new_tokens == len(new)


def test_eos_rows_finish_independently(pair):
    target, drafts, prompt, ref, eos = eos_case(pair)
    others = prompts_of([3, 9], seed=12)
    refs = [reference_greedy(target, p, MAX_NEW, eos=eos) for p in [prompt] + others]
    out = SpeculativeDecoder(target, drafts["copy"], 4).generate([prompt] + others, max_new_tokens=MAX_NEW,
                                                                  eos_token_id=[eos, 99999])
    assert [t.tolist() for t in out.new_tokens] == refs
    assert len(refs[0]) < MAX_NEW


@pytest.mark.parametrize("max_new", [1, 2, 5, 7])
def test_never_more_than_max_new_tokens(pair, max_new):
    target, drafts = pair
    prompts = prompts_of([4, 8])
    for kind in ("copy", "perturbed"):
        out = SpeculativeDecoder(target, drafts[kind], 4).generate(prompts, max_new_tokens=max_new)
        assert [len(t) for t in out.new_tokens] == [max_new, max_new]
        assert [t.tolist() for t in out.new_tokens] == [reference_greedy(target, p, max_new) for p in prompts]


def test_prompt_up_to_context_length():
    target = tiny_llama(seed=0, max_position_embeddings=32)
    draft = perturbed_copy(target, 0.3)
    prompt = prompts_of([28])[0]
    short = prompts_of([5], seed=3)[0]
    out = SpeculativeDecoder(target, draft, 8).generate([prompt, short], max_new_tokens=10)
    # a row stops when it fills the target's context (32 positions, 28 used by the prompt); the others go on
    assert out.new_tokens[0].tolist() == reference_greedy(target, prompt, 4)
    assert out.new_tokens[1].tolist() == reference_greedy(target, short, 10)
    assert out.stats.num_drafted > 0
    with pytest.raises(ValueError, match="context is 32"):
        SpeculativeDecoder(target, draft, 4).generate([prompts_of([32])[0]], max_new_tokens=4)


# ---------------------------------------------------------------- sampling, seeds, bad input
def test_same_seed_same_output_sampling(pair):
    target, drafts = pair
    prompts = prompts_of([3, 6])
    dec = SpeculativeDecoder(target, drafts["perturbed"], 4)
    run = lambda seed: [t.tolist() for t in dec.generate(prompts, max_new_tokens=20, temperature=1.0, top_k=20,
                                                         generator=torch.Generator().manual_seed(seed)).new_tokens]
    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=2.0), "top_p"),
    (dict(num_draft_tokens=-1), "num_draft_tokens"),
    (dict(num_draft_tokens="fast"), "num_draft_tokens"),
])
def test_bad_arguments(pair, kwargs, match):
    target, drafts = pair
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, drafts["copy"], 2).generate([[5, 6]], **kwargs)


def test_bad_prompts(pair):
    target, drafts = pair
    dec = SpeculativeDecoder(target, drafts["copy"], 2)
    with pytest.raises(ValueError, match="no tokens"):
        dec.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.generate([[5, 500]])
    with pytest.raises(ValueError, match="needs a draft"):
        SpeculativeDecoder(target, None, 3)


def test_list_input_ids_take_the_attention_mask_and_a_flat_list_is_one_prompt(pair):
    """A list of ids takes the attention mask as a tensor does (its padding is not prompt), a mask may be a nested
    list, and a flat list of ids is one prompt."""
    target, drafts = pair
    dec = SpeculativeDecoder(target, drafts["perturbed"], 3)
    prompt = [5, 7, 9, 11]
    ref = reference_greedy(target, prompt, 8)
    mask = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    ids = [[0, 0] + prompt, prompt + [0, 0]]
    for m in (torch.tensor(mask), mask):
        out = dec.generate(ids, attention_mask=m, max_new_tokens=8)
        assert [t.tolist() for t in out.new_tokens] == [ref, ref]
        assert [t.tolist() for t in out.sequences] == [prompt + ref] * 2
    assert dec.generate(prompt, max_new_tokens=8).new_tokens[0].tolist() == ref
    assert dec.generate(torch.tensor(prompt, dtype=torch.int32), max_new_tokens=8).new_tokens[0].tolist() == ref


@pytest.mark.parametrize("input_ids,kwargs,match", [
    ("5 7 9", {}, "not text"),
    (torch.tensor([[5.5, 7.0]]), {}, "integer token ids"),
    ([[5.5, 7.0]], {}, "integer token ids"),
    (torch.tensor([[[5, 7]]]), {}, r"\(B, T\) or \(T,\)"),
    ([[5, 7], [9]], dict(attention_mask=[[1, 1], [1]]), "rows of equal length"),
    ({"input_ids": [[5, 7]], "attention_mask": [[1, 1]]}, {}, "BatchEncoding"),
    ([[5, 7]], dict(do_sample=True), "do_sample"),
    ([[5, 7]], dict(generator=5), "generator must be a torch.Generator"),
    (torch.tensor([[5, 7, 9]]), dict(attention_mask=torch.tensor([[1, 0, 1]])), "row 0 has padding between"),
])
def test_bad_generate_inputs_raise_value_error(pair, input_ids, kwargs, match):
    """Each bad input is a ValueError naming it, before any forward (float ids are not truncated to ints)."""
    target, drafts = pair
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, drafts["copy"], 2).generate(input_ids, max_new_tokens=2, **kwargs)


def test_model_in_training_mode_warns():
    """A model left in train() mode (dropout active) silently gave random 'greedy' output."""
    target = tiny_gpt2(seed=0)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.3), 2)
    target.train()
    try:
        with pytest.warns(UserWarning, match=r"target is in training mode.*target.eval\(\)"):
            dec.generate([[5, 6]], max_new_tokens=2)
    finally:
        target.eval()


def test_streamer_receives_prompt_then_tokens(pair):
    target, drafts = pair

    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, t):
            self.chunks.append(t.tolist())

        def end(self):
            self.ended = True

    s = Collect()
    prompt = [4, 9, 12]
    out = SpeculativeDecoder(target, drafts["perturbed"], 3).generate([prompt], max_new_tokens=12, streamer=s)
    assert s.chunks[0] == prompt and s.ended
    assert sum(s.chunks[1:], []) == out.new_tokens[0].tolist()


@pytest.mark.parametrize("value", ["both", "target", 2, None, 1, 1.0, 0])
def test_bad_compile_values_are_refused(pair, value):
    target, drafts = pair
    with pytest.raises(ValueError, match="compile must be False, True .* or 'draft'"):
        SpeculativeDecoder(target, drafts["perturbed"], 3, compile=value)


def test_compile_draft_needs_a_draft(pair):
    with pytest.raises(ValueError, match="compile='draft' compiles the draft's forwards, but draft is None"):
        SpeculativeDecoder(pair[0], None, compile="draft")


def test_compiled_forwards_keep_greedy_equality(pair, references):
    """compile=True (torch.compile of both forwards, dynamic shapes): exact greedy output, batch 1."""
    target, drafts = pair
    prompts, refs = references
    dec = SpeculativeDecoder(target, drafts["perturbed"], 3, compile=True)
    out = dec.generate([prompts[1]], max_new_tokens=MAX_NEW)
    assert out.new_tokens[0].tolist() == refs[1]
    assert 0 < out.stats.acceptance_rate < 1  # rejections and rollbacks happened under compilation


@pytest.mark.parametrize("broken", ["target", "draft"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_non_finite_logits_raise_a_clear_error(broken, gamma):
    """NaN logits (fp16 overflow, NaN weights, a NaN-producing attention path) make inverse-CDF sampling return the
    id V; the step raises NonFiniteLogitsError naming the likely causes instead of letting that id reach an embedding
    (``IndexError: index out of range in self`` deep inside a forward)."""
    import copy

    target = tiny_llama(seed=0, layers=2)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        (target if broken == "target" else draft).get_output_embeddings().weight[:, 0] = float("nan")
    dec = SpeculativeDecoder(target, draft, num_draft_tokens=gamma)
    with pytest.raises(NonFiniteLogitsError, match="logits were not finite"):
        dec.generate([[5, 6, 7]], max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert not dec.has_unfinished()  # generate() aborts what the failed step left


def test_a_failed_prefill_leaves_the_decoder_usable():
    """A prefill that raised (out of memory, Ctrl-C) took its requests out of the queue before failing: generate()'s
    cleanup could not abort them, and every later generate() raised 'request_id 0 is already queued or active'."""
    target = tiny_llama(seed=0, layers=2)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.5), num_draft_tokens=3)
    real = target.model.forward

    def fail(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    target.model.forward = fail
    with pytest.raises(RuntimeError, match="simulated"):
        dec.generate([[5, 6, 7], [8, 9]], max_new_tokens=4)
    target.model.forward = real
    assert not dec.has_unfinished()
    out = dec.generate([[5, 6, 7], [8, 9]], max_new_tokens=4)
    assert [t.tolist() for t in out.new_tokens] == [reference_greedy(target, p, 4) for p in ([5, 6, 7], [8, 9])]


# ---------------------------------------------------------------------------------------------- first token first
def _recorded(target, draft):
    """Forward hooks that log which model ran, and on how many positions."""
    events = []
    hooks = [m.register_forward_pre_hook(lambda _m, args, kwargs, name=name: events.append(
        (name, kwargs["input_ids"].shape[1])), with_kwargs=True) for name, m in (("target", target), ("draft", draft))]
    return events, hooks


@pytest.mark.parametrize("static_cache", [None, False])
def test_the_first_token_is_out_before_the_drafts_prefill(pair, static_cache):
    """The target reads the whole prompt and its next token is delivered before the draft runs at all, for a request
    that starts a batch and one that joins a running batch; the output stays the target's greedy text."""
    target, drafts = pair
    draft = drafts["perturbed"]
    dec = SpeculativeDecoder(target, draft, 3, static_cache=static_cache)  # (its checks run both models)
    events, hooks = _recorded(target, draft)
    try:
        on_tokens = lambda rid, tokens: events.append(("tokens", rid, len(tokens)))  # noqa: E731
        first, second = [5, 17, 33, 8, 9], [60, 3, 91]
        dec.add_request(first, max_new_tokens=8, request_id="a", on_tokens=on_tokens)
        out = dec.step()
        assert events[:3] == [("target", 5), ("tokens", "a", 1), ("draft", 5)]  # prefill, its token, then the draft
        assert events[3] == ("draft", 1)  # the first draft forward reads the new token alone
        events.clear()
        dec.add_request(second, max_new_tokens=8, request_id="b", on_tokens=on_tokens)
        finished = out + dec.step()
        assert events[:3] == [("target", 3), ("tokens", "b", 1), ("draft", 3)]
        while dec.has_unfinished():
            finished += dec.step()
    finally:
        for h in hooks:
            h.remove()
    got = {o.request_id: o.new_tokens for o in finished}
    assert got == {"a": reference_greedy(target, first, 8), "b": reference_greedy(target, second, 8)}
    assert all(o.stats.num_first_step_tokens == 1 and o.stats.draft_prefill_s > 0 for o in finished)


def test_a_request_that_ends_at_its_first_token_never_runs_the_draft(pair):
    """max_new_tokens=1, or a first token that is a stop id: the request finishes from the target's prefill alone."""
    target, drafts = pair
    draft = drafts["perturbed"]
    prompt = [5, 17, 33, 8, 9]
    ref = reference_greedy(target, prompt, 2)
    dec = SpeculativeDecoder(target, draft, 3)
    events, hooks = _recorded(target, draft)
    try:
        one = dec.generate([prompt], max_new_tokens=1)
        stop = dec.generate([prompt], max_new_tokens=6, eos_token_id=ref[0])
    finally:
        for h in hooks:
            h.remove()
    assert one.new_tokens[0].tolist() == stop.new_tokens[0].tolist() == ref[:1]
    assert [e[0] for e in events] == ["target", "target"]
    assert one.stats.num_target_forwards == 0 and one.stats.ttft_s > 0 and one.stats.draft_prefill_s == 0


def test_callbacks_at_admission_may_abort_or_raise_and_the_rows_still_decode(pair):
    """A callback that aborts another joining request drops it before the draft's prefill; one that raises
    propagates after the rows have joined, which then decode to the target's greedy text."""
    target, drafts = pair
    dec = SpeculativeDecoder(target, drafts["perturbed"], 2)
    prompts = {"x": [5, 17, 33], "y": [8, 9], "z": [60, 3, 91, 12]}

    def on_tokens(rid, tokens):
        if rid == "x" and len(got["x"]) == 0:
            dec.abort("y")
        got[rid].extend(tokens)
        if rid == "z" and len(got["z"]) == 1:
            raise RuntimeError("callback failed")

    got = {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        dec.add_request(p, max_new_tokens=6, request_id=rid, on_tokens=on_tokens)
    with pytest.raises(RuntimeError, match="callback failed"):
        dec.step()
    assert dec.active_ids == ["x", "z"] and got["y"] == []
    finished = []
    while dec.has_unfinished():
        finished += dec.step()
    assert sorted(o.request_id for o in finished) == ["x", "z"]
    for o in finished:
        assert o.new_tokens == got[o.request_id] == reference_greedy(target, prompts[o.request_id], 6)
