"""The argument types shared by ``python -m decode generate`` and ``serve``."""
import argparse

import pytest

from decode.cli_args import num_draft_tokens_arg


def test_num_draft_tokens_takes_an_integer_or_auto():
    assert num_draft_tokens_arg("0") == 0
    assert num_draft_tokens_arg("4") == 4
    assert num_draft_tokens_arg("auto") == "auto"


@pytest.mark.parametrize("value, message", [("-1", "must be >= 0, got -1"), ("four", "an integer >= 0 or 'auto'"),
                                            ("Auto", "an integer >= 0 or 'auto'")])
def test_num_draft_tokens_refuses_the_rest(value, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        num_draft_tokens_arg(value)
