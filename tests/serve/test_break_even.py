"""The server's "auto" compression: the break-even length against its naive definition, the fits through their
points."""

import math
from functools import partial

import pytest

from leanlm.generation.decode import prefill_seconds
from leanlm.serve.prompts import BreakEven, PromptCompression, fit


def naive_pays_from(be: BreakEven, rate: float, limit: int = 300_000) -> float:
    prefill = lambda n: be.a * n + be.b * n * n  # noqa: E731
    for n in range(1, limit):
        if prefill(n) - prefill(rate * n) > be.c0 + be.c * n:
            return n
    return math.inf


@pytest.mark.parametrize("be", [BreakEven(1e-3, 1e-7, 0.05, 1e-4), BreakEven(2e-3, 0.0, 0.01, 5e-4),
                                BreakEven(1e-4, 1e-8, 0.02, 5e-4), BreakEven(1e-3, 0.0, 0.0, 2e-3)])
@pytest.mark.parametrize("rate", [0.2, 0.33, 0.5, 0.9])
def test_pays_from_is_the_first_length_that_pays(be, rate):
    exact, naive = be.pays_from(rate), naive_pays_from(be, rate)
    assert (math.isinf(exact) and math.isinf(naive)) or math.ceil(exact - 1e-9) in (naive, naive - 1) or \
        naive == 1 and exact <= 1


def test_keeping_everything_never_pays():
    assert math.isinf(BreakEven(1e-3, 1e-7, 0.0, 1e-5).pays_from(1.0))


def test_fits_pass_through_their_points():
    a, b = fit((256, 1024), (0.3, 1.5), True)
    assert a * 256 + b * 256 ** 2 == pytest.approx(0.3) and a * 1024 + b * 1024 ** 2 == pytest.approx(1.5)
    c0, c = fit((256, 1024), (0.02, 0.05), False)
    assert c0 + 256 * c == pytest.approx(0.02) and c0 + 1024 * c == pytest.approx(0.05)
    assert fit((256, 1024), (0.5, 0.4), False) == (0.5, 0.0)  # never a negative cost per token


def test_prepare_measures_before_any_request(tiny):
    """--prepare-compression: the costs measured up front are the ones every auto request then uses."""
    import asyncio

    from leanlm.prompt.compressor import PromptCompressor

    net, tok = tiny
    compression = PromptCompression(PromptCompressor(model=tiny), partial(prefill_seconds, net),
                                    net.config.max_position)
    assert compression.prepare("random", tok) > 0
    measured = compression.costs["random"]
    assert isinstance(measured, BreakEven) and measured.a > 0
    assert asyncio.run(compression.break_even("random", tok)) is measured
