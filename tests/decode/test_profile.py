"""The per-step profile (decode.profile): exclusive parts that add up to the steps' time, attached to a decoder
without changing its output."""
import time

import pytest
import torch

from decode import SpeculativeDecoder
from decode.profile import PARTS, StepProfile
from tests.conftest import perturbed_copy, tiny_llama


def test_parts_are_exclusive_and_add_up_to_the_steps():
    prof = StepProfile()
    for _ in range(2):
        with prof.step():
            with prof.part("drafting"):
                time.sleep(0.01)
                with prof.part("draft_forward"):
                    time.sleep(0.02)
            time.sleep(0.005)  # outside every part: "other"
    s = prof.summary()
    assert s["steps"] == 2 and s["parts"]["draft_forward"]["calls"] == 2
    assert s["parts"]["draft_forward"]["ms_per_call"] >= 20 and 10 <= s["parts"]["drafting"]["ms_per_call"] < 20
    assert s["parts"]["other"]["ms_per_step"] >= 5
    assert sum(p["total_s"] for p in s["parts"].values()) == pytest.approx(prof.step_s)
    assert sum(p["share"] for p in s["parts"].values()) == pytest.approx(1.0)
    assert set(s["parts"]) == {"drafting", "draft_forward", "other"}  # parts never entered are left out


def test_an_unknown_part_is_refused():
    with pytest.raises(ValueError, match="unknown profile part 'verify'"):
        with StepProfile().part("verify"):
            pass


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_profiled_decoder_times_every_part_and_decodes_the_same(temperature):
    target = tiny_llama(seed=0, layers=2)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.5), 3)
    prompts = [[5, 17, 33, 8], [60, 3]]
    args = dict(max_new_tokens=10, temperature=temperature)
    plain = dec.generate(prompts, generator=torch.Generator().manual_seed(1), **args)
    dec.profile = prof = StepProfile()
    profiled = dec.generate(prompts, generator=torch.Generator().manual_seed(1), **args)
    dec.profile = None
    assert [t.tolist() for t in profiled.new_tokens] == [t.tolist() for t in plain.new_tokens]
    s = prof.summary()
    assert set(s["parts"]) == set(PARTS)
    assert s["steps"] == profiled.stats.num_target_forwards  # the first step admits the rows, then verifies too
    assert s["parts"]["verify_forward"]["calls"] == profiled.stats.num_target_forwards
    assert s["parts"]["draft_forward"]["calls"] == profiled.stats.num_draft_forwards
    assert s["parts"]["prefill_target"]["calls"] == s["parts"]["prefill_draft"]["calls"] == 1
    assert sum(p["share"] for p in s["parts"].values()) == pytest.approx(1.0)
