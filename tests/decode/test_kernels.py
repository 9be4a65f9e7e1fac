"""decode.kernels: the few-row linear is the same function as F.linear (transposed product for 1-2 rows, oneDNN on a
packed weight beyond, or the fallback without oneDNN), keeps its packed copies in step with the weights, leaves
everything it is not meant for to the original bit for bit, is installed only inside its blocks (nested, threads,
exceptions), and the engine runs its steps under it by default on float32 CPU models (greedy equality on both
paths)."""
import copy
import gc
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from decode import SpeculativeDecoder, costs, kernels
from tests.conftest import perturbed_copy, tiny_llama

ORIGINAL = F.linear


@pytest.fixture(params=["onednn", "no-onednn"])
def backend(request, monkeypatch):
    """Both forms the kernel takes beyond TRANSPOSED_ROWS: oneDNN where the build has it, else the fallback."""
    if request.param == "onednn":
        assert kernels.onednn_available()  # the torch CPU wheels have it: a build without would test nothing here
    monkeypatch.setattr(kernels, "_ONEDNN", request.param == "onednn")
    return request.param


@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (3, 48), (9, 48), (64, 48), (1, 1, 48), (1, 8, 48), (2, 4, 48),
                                   (2, 9, 48), (2, 20, 48), (4, 16, 48)])  # 1..64 rows, 2-D and 3-D
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(shape, bias, backend):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-2])
    x = torch.randn(*shape, generator=g)
    w = torch.randn(80, 48, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    out = kernels.linear(x, w, b)
    ref = ORIGINAL(x, w, b)
    assert out.shape == ref.shape and out.is_contiguous() and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _refusing(*args, **kwargs):
    raise AssertionError("took the original F.linear")


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64])
def test_eligible_inputs_take_the_measured_form(monkeypatch, rows, backend):
    """1-2 rows: the transposed product; more: oneDNN on a packed copy of the weight, or without oneDNN the
    transposed product up to TRANSPOSED_FALLBACK_ROWS and the original F.linear beyond (bit for bit)."""
    x, w, b = torch.randn(1, rows, 16), torch.randn(24, 16), torch.randn(24)
    packed = rows > kernels.TRANSPOSED_ROWS and backend == "onednn"
    original = rows > kernels.TRANSPOSED_FALLBACK_ROWS and backend == "no-onednn"
    if not original:
        monkeypatch.setattr(kernels, "_original", _refusing)
    with kernels.few_row_linear():  # packed copies are kept while a block is open
        out = kernels.linear(x, w, b)
        assert (id(w) in kernels._packed) is packed
    assert out.shape == (1, rows, 24)
    if original:
        assert torch.equal(out, ORIGINAL(x, w, b))


@pytest.mark.parametrize("rows", [1, 5])
def test_odd_biases_and_empty_weights_match_f_linear(rows, backend):
    """A strided 1-D bias is read densely (oneDNN read it as contiguous: errors of 3.5, and 3.6e32 for an expanded
    one); a bias F.linear broadcasts (0-D, (1, N)) or rejects (wrong length or dtype) and a weight with no outputs
    go to the original, so values and errors are F.linear's."""
    w, x = torch.randn(48, 32), torch.randn(rows, 32)
    for b in (torch.randn(96)[::2], torch.tensor([0.5]).expand(48), torch.tensor(0.5), torch.randn(1, 48)):
        with kernels.few_row_linear():
            out = F.linear(x, w, b)
        torch.testing.assert_close(out, ORIGINAL(x, w, b), rtol=1e-5, atol=1e-5)
    for b in (torch.randn(47), torch.randn(48, dtype=torch.float64)):
        with pytest.raises(RuntimeError) as ours, kernels.few_row_linear():
            F.linear(x, w, b)
        with pytest.raises(RuntimeError) as theirs:
            ORIGINAL(x, w, b)
        assert str(ours.value) == str(theirs.value)
    with kernels.few_row_linear():
        assert F.linear(x, torch.randn(0, 32)).shape == (rows, 0)


@pytest.mark.parametrize("rows", [3, 12])
def test_weights_made_under_inference_mode_take_the_fallback(rows):
    """Inference tensors have no version counter (reading it raises), so no packed copy could be kept in step."""
    with torch.inference_mode():
        w = torch.randn(24, 16)
    x = torch.randn(rows, 16)
    for mode in (torch.no_grad(), torch.inference_mode()):
        with mode:
            out = kernels.linear(x, w)
        torch.testing.assert_close(out, ORIGINAL(x, w), rtol=1e-5, atol=1e-5)
    assert id(w) not in kernels._packed


def test_packed_copy_follows_the_weight():
    """A packed copy is made again after an in-place update (training, load_state_dict: the version counter moves)
    and, at its first use in a new block, after an update through ``.data`` (peft's merge writes
    ``weight.data += BA``; the version counter stays), also one that changes a single row or column. A dead
    weight's copy goes with it; clear_packed frees the rest; outside any block nothing is kept."""
    assert kernels.onednn_available()
    layer = torch.nn.Linear(16, 24, bias=False).requires_grad_(False)
    x = torch.randn(5, 16)

    def check():
        torch.testing.assert_close(kernels.linear(x, layer.weight), ORIGINAL(x, layer.weight), rtol=1e-5, atol=1e-5)

    with kernels.few_row_linear():
        check()
        assert id(layer.weight) in kernels._packed and kernels.packed_bytes() >= layer.weight.numel() * 4
        with torch.no_grad():
            layer.weight.mul_(-2.0)
        check()
        layer.load_state_dict({"weight": torch.ones(24, 16)})
        check()
    for edit in (lambda w: w.data.mul_(3.0), lambda w: w.data[7].add_(1.0), lambda w: w.data[:, 11].sub_(0.5)):
        version = layer.weight._version
        edit(layer.weight)
        assert layer.weight._version == version  # unseen by the version counter
        with kernels.few_row_linear():
            check()
    key, w = id(layer.weight), layer.weight
    del layer
    gc.collect()
    assert key in kernels._packed  # w still holds the weight
    del w
    gc.collect()
    assert key not in kernels._packed
    w = torch.randn(24, 16)
    with kernels.few_row_linear():
        kernels.linear(x, w)
    assert kernels.clear_packed() >= 1 and not kernels._packed
    kernels.linear(x, w)
    assert not kernels._packed


def test_check_packed_does_the_first_use_check_before_a_timed_forward(monkeypatch):
    """In a fresh block, check_packed makes each kept copy ready (checked against its weight, re-packed after a
    ``.data`` edit), so the forward after it neither samples nor packs; weights with no copy stay without one, and
    outside a block it does nothing. CostTimer rounds and the bare forwards call it before timing (a first forward
    timed in a fresh block paid the checks: 5.5 ms on pair X's target at batch 8)."""
    assert kernels.onednn_available()
    used, unused = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 8, bias=False)
    model = torch.nn.Sequential(used, unused).requires_grad_(False)
    x = torch.randn(5, 16)
    with kernels.few_row_linear():
        kernels.linear(x, used.weight)
    samples, made = [], []
    equal, reorder = torch.equal, kernels._reorder
    monkeypatch.setattr(torch, "equal", lambda a, b: samples.append(1) or equal(a, b))
    monkeypatch.setattr(kernels, "_reorder", lambda w: made.append(w.data_ptr()) or reorder(w))
    kernels.check_packed(model, None)  # outside a block: nothing
    assert samples == [] and made == []
    for bad in ("x", [model], used.weight):  # a clear error, in and outside a block (was AttributeError inside)
        with pytest.raises(TypeError, match="check_packed takes models"):
            kernels.check_packed(bad)
    used.weight.data.mul_(2.0)  # unseen by the version counter: found by the sample check
    with kernels.few_row_linear():
        kernels.check_packed(model)
        assert len(samples) == 1 and made == [used.weight.data_ptr()] and id(unused.weight) not in kernels._packed
        samples.clear(), made.clear()
        torch.testing.assert_close(kernels.linear(x, used.weight), ORIGINAL(x, used.weight), rtol=1e-5, atol=1e-5)
        assert samples == [] and made == []  # the forward paid nothing more
    calls = []
    monkeypatch.setattr(kernels, "check_packed", lambda *models: calls.append(len(models)))
    from decode.bench.bare_forward import BareTimer
    from decode.costs import CostTimer

    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    ctx = torch.tensor([[1, 5, 6, 7, 8]])
    for timer in (CostTimer(target, perturbed_copy(target), ctx, [2], static_cache=True, few_row_linear=True),
                  BareTimer(target, perturbed_copy(target), ctx, few_row_linear=True)):
        calls.clear()
        timer.round()
        assert calls == [2]  # target and draft, once per round


def _ineligible_cases():
    w = torch.randn(24, 16)
    yield "prefill-sized", torch.randn(1, kernels.MAX_ROWS + 1, 16), w
    yield "bf16", torch.randn(1, 4, 16, dtype=torch.bfloat16), w.bfloat16()
    yield "float64", torch.randn(1, 4, 16, dtype=torch.float64), w.double()
    yield "1-D input", torch.randn(16), w
    yield "weight needs grad", torch.randn(1, 4, 16), w.clone().requires_grad_()
    yield "input needs grad", torch.randn(1, 4, 16).requires_grad_(), w


@pytest.mark.parametrize("case", list(_ineligible_cases()), ids=lambda c: c[0])
def test_ineligible_inputs_go_to_the_original_bit_for_bit(monkeypatch, case):
    _, x, w = case
    ref = ORIGINAL(x, w)
    calls = []
    monkeypatch.setattr(kernels, "_original", lambda *a: calls.append(1) or ORIGINAL(*a))
    out = kernels.linear(x, w)
    assert calls == [1]
    assert torch.equal(out, ref)


def test_autocast_and_training_keep_the_original(monkeypatch):
    layer = torch.nn.Linear(16, 24)
    x = torch.randn(1, 4, 16)
    calls = []
    monkeypatch.setattr(kernels, "_original", lambda *a: calls.append(1) or ORIGINAL(*a))
    with kernels.few_row_linear(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    with kernels.few_row_linear():
        layer(x).sum().backward()  # grad mode, weight requires grad
    assert calls == [1, 1] and layer.weight.grad is not None


def test_installed_only_inside_the_block_also_on_error():
    assert F.linear is ORIGINAL
    with kernels.few_row_linear():
        assert F.linear is kernels.linear
        with kernels.few_row_linear():  # nested
            assert F.linear is kernels.linear
        assert F.linear is kernels.linear  # the inner exit keeps the outer block's
    assert F.linear is ORIGINAL
    with pytest.raises(RuntimeError, match="boom"):
        with kernels.few_row_linear():
            raise RuntimeError("boom")
    assert F.linear is ORIGINAL
    with kernels.few_row_linear(enabled=False):
        assert F.linear is ORIGINAL


def test_blocks_in_several_threads_restore_the_original():
    barrier = threading.Barrier(6)
    seen, errors = [], []

    def work(i):
        try:
            for j in range(200):
                if j == 100:
                    barrier.wait(timeout=30)
                with kernels.few_row_linear():
                    seen.append(F.linear is kernels.linear)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(seen) and len(seen) == 1200
    assert F.linear is ORIGINAL


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_compiled_code_traces_the_transposed_form_and_leaves_the_packed_one(rows):
    """A model compiled inside a block (compile="draft" runs the draft so): dynamo traces the transposed product
    (1-2 rows) and gives more rows to the original F.linear, since the packed copies live in a Python dict (tracing
    them failed in inductor before). Same values as F.linear either way."""
    torch._dynamo.reset()
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(rows, 24)
    fn = torch.compile(layer, dynamic=True)
    with kernels.few_row_linear(), torch.no_grad():
        got = fn(x)
    torch.testing.assert_close(got, ORIGINAL(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert F.linear is ORIGINAL


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)  # the default is float64: not eligible
    return target, perturbed_copy(target, 0.5)


def test_engine_default_and_switch(pair):
    target, draft = pair
    assert SpeculativeDecoder(target, draft).few_row_linear is True  # float32 on the CPU
    assert SpeculativeDecoder(target, draft, few_row_linear=False).few_row_linear is False
    assert SpeculativeDecoder(target, draft, compile=True).few_row_linear is False
    assert SpeculativeDecoder(target, draft, compile="draft").few_row_linear is True  # the target stays eager
    half = tiny_llama(seed=0, layers=2, dtype=torch.bfloat16)
    assert SpeculativeDecoder(half, perturbed_copy(half, 0.5)).few_row_linear is False
    assert SpeculativeDecoder(tiny_llama(seed=0, layers=2)).few_row_linear is False  # float64
    assert kernels.default_for(target, None) is True


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("batch", [1, 4])
def test_engine_runs_its_forwards_under_the_switch_and_keeps_greedy_equality(pair, enabled, batch):
    target, draft = pair
    prompts = [[4, 9, 12, 30, 2], [7], [50, 51, 52, 53, 54, 55, 56, 57, 58], [3, 3]][:batch]
    plain = [SpeculativeDecoder(target, None).generate([p], max_new_tokens=20).new_tokens[0].tolist()
             for p in prompts]
    seen = []
    dec = SpeculativeDecoder(target, draft, 4, few_row_linear=enabled)  # (its construction probes run eager)
    hook = target.register_forward_hook(lambda m, a, out: seen.append(F.linear is kernels.linear))
    try:
        out = dec.generate(prompts, max_new_tokens=20)  # batch 4: verify forwards of 20 rows
        costs.calibrate(dec, prompts[0], batch_sizes=(1,), repeats=1)
    finally:
        hook.remove()
    assert [t.tolist() for t in out.new_tokens] == plain
    assert 0 < out.stats.acceptance_rate < 1  # rejections: verify forwards of several rows ran
    assert seen and all(s is enabled for s in seen)
    assert F.linear is ORIGINAL


def test_compiled_draft_keeps_the_kernels_and_greedy_equality(pair):
    """compile="draft": the draft's forwards compiled (the transposed product traced for 1-2 rows, the original
    F.linear for 4), the target's eager under the kernels; output equals plain greedy decoding at batch 1 and 4."""
    target, draft = pair
    torch._dynamo.reset()
    prompts = [[4, 9, 12, 30, 2], [7], [50, 51, 52, 53, 54, 55, 56, 57, 58], [3, 3]]
    plain = [SpeculativeDecoder(target, None).generate([p], max_new_tokens=16).new_tokens[0].tolist()
             for p in prompts]
    dec = SpeculativeDecoder(target, draft, 3, compile="draft")
    assert dec.target_call is None and dec.draft_call is not None and dec.few_row_linear
    alone = dec.generate(prompts[:1], max_new_tokens=16)
    batch = dec.generate(prompts, max_new_tokens=16)
    assert alone.new_tokens[0].tolist() == plain[0]
    assert [t.tolist() for t in batch.new_tokens] == plain
    assert 0 < batch.stats.acceptance_rate < 1  # rejections and rollbacks happened under compilation
    assert F.linear is ORIGINAL


def test_generate_packs_each_weight_once_and_follows_a_merge(pair, monkeypatch):
    """The first generate() packs each linear weight once (one block around its steps, the copies kept across
    steps); later calls reuse the copies; after a peft-style merge through ``.data`` the changed weights are packed
    again and greedy output equals plain decoding with the kernels off on the changed model."""
    target, draft = pair
    target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    made = []
    reorder = kernels._reorder
    monkeypatch.setattr(kernels, "_reorder", lambda w: made.append(w.data_ptr()) or reorder(w))
    dec = SpeculativeDecoder(target, draft, 3)
    prompts = [[4, 9, 12, 30, 2], [7], [50, 51, 52], [3, 3]]  # batch 4: every forward has more than 2 rows
    out = dec.generate(prompts, max_new_tokens=12)
    assert out.stats.num_target_forwards >= 4
    weights = {m.weight.data_ptr() for model in (target, draft) for m in model.modules()
               if isinstance(m, torch.nn.Linear)}
    assert sorted(made) == sorted(weights)
    made.clear()
    dec.generate(prompts, max_new_tokens=12)
    assert made == []
    merged = target.model.layers[0].mlp.down_proj.weight
    merged.data += 0.5 * torch.randn(merged.shape[0], 2) @ torch.randn(2, merged.shape[1])  # W + BA, as peft merges
    out = dec.generate(prompts, max_new_tokens=12)
    assert made == [merged.data_ptr()]
    plain = SpeculativeDecoder(target, None, few_row_linear=False)
    assert [t.tolist() for t in out.new_tokens] == [
        plain.generate([p], max_new_tokens=12).new_tokens[0].tolist() for p in prompts]


def test_a_block_held_by_another_thread_does_not_hide_a_merge(pair):
    """The sample check runs after each thread's outermost entry: with another thread's block open the whole time
    (a server's busy period, another decoder), generate() after a .data edit still uses the new weights."""
    target, draft = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    prompt = [5, 7, 11, 13, 2, 9, 4]
    held, release = threading.Event(), threading.Event()

    def hold():
        with kernels.few_row_linear():
            held.set()
            release.wait(60)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert held.wait(30)
        dec = SpeculativeDecoder(target, draft, 4)
        dec.generate([prompt], max_new_tokens=24)
        with torch.no_grad():
            for p in target.parameters():
                p.data.mul_(-1.0)
        out = dec.generate([prompt], max_new_tokens=24).new_tokens[0].tolist()
    finally:
        release.set()
        other.join()
    plain = SpeculativeDecoder(target, None, few_row_linear=False).generate([prompt], max_new_tokens=24)
    assert out == plain.new_tokens[0].tolist()
    assert F.linear is ORIGINAL


def test_server_holds_one_block_per_busy_period():
    """The scheduler thread keeps the kernels' block open while requests run (packed weights made once per busy
    period) and closes it when it goes idle."""
    import asyncio

    from decode.serving.metrics import ServerMetrics
    from decode.serving.scheduler import GenerationRequest, Scheduler
    from tests.decode.server_helpers import EndlessEngine

    seen = []

    class Engine(EndlessEngine):  # a request that runs until aborted; its steps do not enter a block themselves
        few_row_linear = True

        def step(self):
            seen.append(F.linear is kernels.linear)
            return super().step()

    sched = Scheduler(Engine(), None, ServerMetrics(), max_batch_size=2, max_queue=1)
    sched.start()
    loop = asyncio.new_event_loop()
    try:
        live = sched.submit(GenerationRequest(prompt_ids=[1], sampling={}, stop_ids=[]), loop)
        deadline = time.time() + 10
        while len(seen) < 5 and time.time() < deadline:
            time.sleep(0.01)
        sched.abort(live.request_id)
        while sched.num_running and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # an idle pass of the scheduler loop
        assert seen and all(seen)
        assert F.linear is ORIGINAL  # idle: the block is closed
    finally:
        sched.shutdown(drain=False, timeout=5)
        loop.close()
    assert F.linear is ORIGINAL
