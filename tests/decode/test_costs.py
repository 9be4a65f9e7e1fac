"""Cost measurement (decode.costs): the timers, the auto-γ cost model measured on a decoder's own forward path
(calibrate, measure_costs) and the warm-up that compiles every shape class before serving."""
import random

import numpy as np
import pytest
import torch

from decode import SpeculativeDecoder, costs
from decode.bench.bare_forward import BareTimer, measure_bare_forwards
from decode.cache import StaticKV
from tests.conftest import perturbed_copy, tiny_llama
from tests.decode.test_engine import prompts_of


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0, layers=2)
    return target, {"copy": target, "perturbed": perturbed_copy(target, 0.6)}


@pytest.mark.parametrize("static_cache", [False, True, {"target": True, "draft": False}])
def test_measure_cost_ratio_times_the_given_calls_on_the_same_context_each_time(static_cache):
    """Every timed forward goes through the given call (e.g. a compiled forward), on the same cache each time:
    the positions fed are the context's next ones on every call, on the DynamicCache copy and on the static cache
    whose write column is moved back after each call."""

    target = tiny_llama(seed=0, layers=1)
    draft = perturbed_copy(target, 0.5)
    seen = {"target": [], "draft": []}
    kinds = {"target": set(), "draft": set()}

    def counting(name, model):
        def call(**kw):
            seen[name].append((kw["input_ids"].shape[1], kw["position_ids"].tolist()))
            kinds[name].add(type(kw.get("cache", kw.get("past_key_values"))).__name__)
            return model(**kw)
        return call

    context = torch.tensor([[5, 6, 7, 8, 9, 10]] * 2)
    m = costs.measure_cost_ratio(target, draft, context, repeats=3, verify_gammas=[2],
                           static_cache=static_cache, target_call=counting("target", target),
                           draft_call=counting("draft", draft))
    assert m["cost_ratio"] > 0 and [v["gamma"] for v in m["verify"]] == [2]
    assert m["catchup_cost_ratio"] == m["draft_catchup_forward_s"] / m["target_forward_s"] > 0
    # (3 timed + 2 untimed) x (1 token, verify) on the target, x (1 token, the 2-token catch-up) on the draft
    assert len(seen["draft"]) == 10 and len(seen["target"]) == 10
    assert all(pos == [[5, 6][:k]] * 2 for k, pos in seen["draft"])
    assert all(pos == [[5, 6, 7][:k]] * 2 for k, pos in seen["target"])
    static = static_cache if isinstance(static_cache, dict) else dict.fromkeys(seen, static_cache)
    for name in seen:  # the static path writes into the StaticKV's transformers StaticCache
        assert kinds[name] == ({"StaticCache"} if static[name] else {"DynamicCache"}), name
    assert StaticKV.supported(target) is None


def test_measure_cost_ratio_names_a_bad_argument_before_any_forward():
    """These raised IndexError/RuntimeError/StatisticsError from inside the models or the median."""

    target = tiny_llama(seed=0, layers=1)  # 256 positions
    draft = perturbed_copy(target, 0.5)
    ok = torch.tensor([[5, 6, 7]])
    cases = [((target, None, ok), {}, "both are needed"),
             ((target, draft, ok[0]), {}, r"\(B, L\) integer tensor .* got a torch.int64 tensor of shape \(3,\)"),
             ((target, draft, ok[:, :1]), {}, "L >= 2"), ((target, draft, ok.float()), {}, "integer tensor"),
             ((target, draft, [[5, 6, 7]]), {}, "got list"),
             ((target, draft, torch.tensor([[5, 500]])), {}, r"ids 5\.\.500, outside the target's embedding"),
             ((target, draft, torch.tensor([[-3, 5]])), {}, "outside the target's embedding"),
             ((target, draft, ok), {"repeats": 0}, "repeats must be an integer >= 1"),
             ((target, draft, ok), {"verify_gammas": [-1]}, "verify_gammas must be integers >= 1"),
             ((target, draft, torch.ones(1, 250, dtype=torch.long)), {"verify_gammas": [8]},
              "need 258 positions, more than the target's 256"),
             ((target, draft, ok), {"static_cache": {"targte": True}}, "static_cache keys"),
             ((target, draft, ok), {"target_call": 5}, "target_call must be callable")]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            costs.measure_cost_ratio(*args, **kwargs)


def test_cost_timers_name_a_bad_argument_before_any_forward():
    """A new user's trial: BareTimer took no draft, lists, ids outside the embedding and contexts longer than the
    positions to torch (TypeError/AttributeError/IndexError or a silent run), and CostTimer took warmup_rounds=-1,
    verify_gammas=None and few_row_linear="yes"; all are named ValueErrors now, before any forward."""

    target = tiny_llama(seed=0, layers=1)  # 256 positions
    draft = perturbed_copy(target, 0.5)
    ok = torch.tensor([[5, 6, 7]])
    for make in (costs.CostTimer, BareTimer):
        for args, kwargs, message in (
                ((target, None, ok), {}, "both are needed"), ((target, draft, [[5, 6, 7]]), {}, "got list"),
                ((target, draft, torch.tensor([[5, 500]])), {}, "outside the target's embedding"),
                ((target, draft, torch.ones(1, 257, dtype=torch.long)), {},
                 "need 258 positions, more than the target's"),
                ((target, draft, ok), {"warmup_rounds": -1}, "warmup_rounds must be an integer >= 0"),
                ((target, draft, ok), {"warmup_rounds": 2.5}, "warmup_rounds"),
                ((target, draft, ok), {"few_row_linear": "yes"}, "few_row_linear must be True or False")):
            with pytest.raises(ValueError, match=message):
                make(*args, **kwargs)
    for gammas in (None, 2, "24"):
        with pytest.raises(ValueError, match="verify_gammas must be a sequence"):
            costs.CostTimer(target, draft, ok, verify_gammas=gammas)
    with pytest.raises(ValueError, match=r"shape \(1, L\)"):
        BareTimer(target, draft, torch.cat([ok, ok]))
    for repeats in (True, 2.5, "3", None, 0):
        with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
            measure_bare_forwards(target, draft, ok, repeats=repeats)
    timer = costs.CostTimer(target, draft, ok, verify_gammas=np.array([2, 1]), static_cache=True)  # numpy γ: ints
    assert timer.verify_gammas == [1, 2] and all(type(g) is int for g in timer.verify_gammas)  # (static cache sizes)
    for timer in (costs.CostTimer(target, draft, ok), BareTimer(target, draft, ok)):
        timer.round()
        with pytest.raises(ValueError, match="no timed round yet"):
            timer.result()


def test_calibrate_checks_its_arguments(pair):
    """Ids outside the vocabulary raised IndexError inside the embedding; batch size 0 measured batch 2."""
    target, drafts = pair
    dec = SpeculativeDecoder(target, drafts["copy"], "auto")
    with pytest.raises(ValueError, match="context_ids"):
        costs.calibrate(dec, [5, 500], (1,), repeats=1)
    with pytest.raises(ValueError, match="batch_sizes"):
        costs.calibrate(dec, [5, 6], (0,), repeats=1)
    assert set(costs.calibrate(dec, list(range(5, 95)) * 4, (1,), repeats=1)) == {1}  # long contexts: cut, not refused


def test_calibrate_fills_the_cost_model_before_decoding(pair):
    target, drafts = pair
    dec = SpeculativeDecoder(target, drafts["perturbed"], "auto", max_auto_draft_tokens=3)
    model = costs.calibrate(dec, [4, 5, 6], batch_sizes=[1, 3])
    assert set(model) == {1, 4}
    for entry in model.values():
        assert entry["cost_ratio"] > 0 and len(entry["verify"]) == 4 and entry["verify"][0] == 1.0
        assert entry["target_forward_s"] > 0  # kept for decode.speedup.simulate_batch_speedup
    before = dict(model)
    dec.generate([[4, 5, 6]], max_new_tokens=5)
    assert dec.auto_costs == before  # batch 1 was measured already: nothing re-measured inside the steps


def test_calibrate_times_the_forwards_the_steps_run(pair, monkeypatch):
    """The auto-γ cost model is measured through the decoder's own forward calls (the compiled ones with
    ``compile``; a counting call stands in for them here) on its cache kind, so a compiled draft's lower c reaches
    the γ choice."""
    target, drafts = pair
    dec = SpeculativeDecoder(target, drafts["copy"], "auto", max_auto_draft_tokens=2)
    calls = []
    dec.draft_call = lambda **kw: calls.append(kw["input_ids"].shape) or dec.draft(**kw)
    seen = {}
    real = costs.measure_cost_ratio

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(costs, "measure_cost_ratio", spy)
    model = costs.calibrate(dec, [5, 6, 7, 8], (1,), repeats=2)
    # 2 timed + 2 untimed rounds of a one-token draft forward and the two-token catch-up
    assert calls == [torch.Size([1, 1]), torch.Size([1, 2])] * 4
    assert seen["static_cache"] == dec.static_cache and seen["target_call"] is None
    assert model[1]["cost_ratio"] > 0 and len(model[1]["verify"]) == 3
    assert model[1]["catchup_cost_ratio"] >= model[1]["cost_ratio"]
    with pytest.raises(ValueError, match="no draft"):
        costs.measure_costs(SpeculativeDecoder(target, None), torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match=r"got list \(calibrate\(\) takes a list of ids\)"):
        costs.measure_costs(dec, [[5, 6]])
    with pytest.raises(ValueError, match=r"ids 5\.\.900, outside the target's embedding"):
        costs.measure_costs(dec, torch.tensor([[5, 900]]))
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        costs.calibrate(dec, [5, 6, 7], (1,), repeats=0)


def test_warm_up_compiles_every_graph_a_mixed_workload_meets():
    """After warm_up(), long prompts (static buffers of 128 and 256 columns after the warm-up's 64), then requests
    that join and leave, ragged prompts, greedy and sampled rows, batch sizes 1..6 and an abort compile no further
    graph (a compiled draft with the few-row kernels: the most shape classes); greedy rows still equal plain greedy
    decoding. (At this width dynamo keeps a buffer length static until it sees it change, as with the quickstart's
    draft; the long prompts compiled 2 more graphs when the warm-up used one buffer length.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    target = tiny_llama(seed=0, layers=2, hidden=128, dtype=torch.float32, max_position_embeddings=512)
    draft = tiny_llama(seed=1, layers=1, hidden=128, dtype=torch.float32, max_position_embeddings=512)
    dec = SpeculativeDecoder(target, draft, 3, compile="draft")
    assert dec.few_row_linear
    rng = random.Random(0)
    before = counters["stats"]["unique_graphs"]
    assert costs.warm_up(dec) > 0
    warmed = counters["stats"]["unique_graphs"]
    assert warmed > before
    greedy = {}
    rounds = [[dict(prompt_ids=[rng.randrange(3, 90) for _ in range(n)], max_new_tokens=20, temperature=0.0)
               for _ in range(b)]
              for n in (100, 200) for b in (1, 3)]  # 3 rows: unequal acceptance, masks
    rounds += [[dict(prompt_ids=prompts_of([rng.randrange(1, 30)], seed=100 * r + i)[0],
                     max_new_tokens=rng.randrange(1, 40), temperature=rng.choice([0.0, 0.0, 1.0]), seed=i)
                for i in range(rng.randrange(1, 7))] for r in range(3)]
    for r, batch in enumerate(rounds):
        ids = [dec.add_request(**req) for req in batch]
        steps = 0
        while dec.has_unfinished():
            for out in dec.step():
                req = batch[ids.index(out.request_id)] if out.request_id in ids else None
                if req is not None and req["temperature"] == 0.0:
                    greedy[tuple(req["prompt_ids"])] = (req["max_new_tokens"], out.new_tokens)
            steps += 1
            if steps == 2 and r >= 4:  # requests joining mid-flight, one leaving early
                late = [dict(prompt_ids=prompts_of([rng.randrange(1, 30)], seed=999 + r)[0],
                             max_new_tokens=rng.randrange(5, 30), temperature=0.0)]
                ids += [dec.add_request(**req) for req in late]
                batch += late
                if len(ids) > 2:
                    dec.abort(ids[0])
    assert counters["stats"]["unique_graphs"] == warmed
    assert len(greedy) >= 5
    plain = SpeculativeDecoder(target, None)
    for prompt, (n, tokens) in greedy.items():
        assert list(tokens) == plain.generate([list(prompt)], max_new_tokens=n).new_tokens[0].tolist()


def test_warm_up_for_one_row_leaves_out_the_mask_classes_and_batch_1_compiles_nothing_more(monkeypatch):
    """warm_up(max_batch_size=1) runs the 3 unmasked classes only (a single row has no holes), and afterwards batch-1
    requests of every kind (long and short prompts, greedy and sampled, rejections, a γ cut to 0 by the budget)
    compile no further graph; with 2 rows the mask classes are run too."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    target = tiny_llama(seed=0, layers=2, hidden=128, dtype=torch.float32, max_position_embeddings=512)
    draft = tiny_llama(seed=1, layers=1, hidden=128, dtype=torch.float32, max_position_embeddings=512)
    dec = SpeculativeDecoder(target, draft, 3, compile="draft")
    seen = []
    real = costs.run_shape_classes
    monkeypatch.setattr(costs, "run_shape_classes",
                        lambda d, length, classes: (seen.extend(classes), real(d, length, classes)))
    assert costs.warm_up(dec, max_batch_size=1) > 0
    assert sorted(set(seen)) == [(1, False, 1), (1, False, 2), (1, False, 3)]
    warmed = counters["stats"]["unique_graphs"]
    rates = []
    for n, temperature, new in ((100, 0.0, 20), (200, 1.0, 17), (7, 0.0, 1), (30, 1.0, 9)):
        out = dec.generate(prompts_of([n], seed=n), max_new_tokens=new, temperature=temperature,
                           generator=torch.Generator().manual_seed(n))
        assert len(out.new_tokens[0]) == new
        rates.append(out.stats.acceptance_rate)
    assert counters["stats"]["unique_graphs"] == warmed
    assert any(r is not None and r < 1 for r in rates)  # rejections and roll-backs happened
    seen.clear()
    monkeypatch.setattr(costs, "run_shape_classes",
                        lambda d, length, classes: seen.extend(classes))  # which classes only, no compilation
    costs.warm_up(dec, max_batch_size=2)
    assert {holes for _, holes, _ in seen} == {False, True} and {rows for rows, _, _ in seen} == {1, 2}


def test_warm_up_measures_the_auto_cost_model_of_every_batch_size(pair, monkeypatch):
    """γ = "auto": warm_up(max_batch_size=5) measures buckets 1, 2, 4 and 8 once; later steps at any of those batch
    sizes measure nothing. Without compile or auto there is nothing to do; a bad size is refused."""
    target, drafts = pair
    dec = SpeculativeDecoder(target, drafts["perturbed"], "auto")
    assert costs.warm_up(dec, max_batch_size=5) > 0
    assert sorted(dec.auto_costs) == [1, 2, 4, 8]
    monkeypatch.setattr(costs, "calibrate", lambda *a, **k: pytest.fail("calibrated inside a step"))
    out = dec.generate(prompts_of([3, 5, 7, 2, 9]), max_new_tokens=8)
    assert out.stats.num_verify_steps > 0
    assert costs.warm_up(SpeculativeDecoder(target, drafts["perturbed"], 3)) == 0.0
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_batch_size"):
            costs.warm_up(dec, max_batch_size=bad)
