"""What ``python -m decode generate`` and ``serve`` share: the γ argument, its default, the slowdown warning."""
import argparse

import pytest

from decode.cli_args import (DEFAULT_NUM_DRAFT_TOKENS, command_gamma, fixed_gamma_speedup, num_draft_tokens_arg,
                             slowdown_warning)


def test_num_draft_tokens_takes_an_integer_or_auto():
    assert num_draft_tokens_arg("0") == 0
    assert num_draft_tokens_arg("4") == 4
    assert num_draft_tokens_arg("auto") == "auto"


@pytest.mark.parametrize("value, message", [("-1", "must be >= 0, got -1"), ("four", "an integer >= 0 or 'auto'"),
                                            ("Auto", "an integer >= 0 or 'auto'")])
def test_num_draft_tokens_refuses_the_rest(value, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        num_draft_tokens_arg(value)


def test_the_commands_default_to_auto_with_a_draft_and_0_without():
    assert command_gamma(None, True) == DEFAULT_NUM_DRAFT_TOKENS == "auto"
    assert command_gamma(4, True) == 4 and command_gamma(0, True) == 0
    assert command_gamma(None, False) == 0 and command_gamma("auto", False) == 0


def test_slowdown_warning_when_the_measured_acceptance_predicts_a_fixed_gamma_slower_than_plain_decoding():
    costs = {"cost_ratio": 0.1, "verify": [1.0, 1.1, 1.2, 1.3, 1.4]}
    # α = 0.05, γ = 4: (1 − 0.05^5) / (0.95 · (0.4 + 1.4)) = 0.585
    assert fixed_gamma_speedup(0.05, 4, costs) == pytest.approx((1 - 0.05 ** 5) / (0.95 * 1.8))
    message = slowdown_warning(0.05, 488, 4, costs, "use auto")
    assert message == ("warning: at the measured acceptance (α = 0.050 over 488 drafted tokens) and the "
                       "measured costs (c = 0.100, v_4 = 1.40), γ = 4 is predicted to run at 0.58× plain decoding's "
                       "speed, slower than the target alone: use auto")
    assert fixed_gamma_speedup(0.8, 4, costs) > 1 and slowdown_warning(0.8, 488, 4, costs, "x") is None
    assert fixed_gamma_speedup(0.3, 8, costs) == pytest.approx((1 - 0.3 ** 9) / (0.7 * (0.8 + 1.4)))  # last v
    assert slowdown_warning(0.05, 0, 4, costs, "x") is None and slowdown_warning(0.05, 488, 0, costs, "x") is None
