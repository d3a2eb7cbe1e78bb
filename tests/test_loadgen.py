"""layerwatch.demo.loadgen's traffic category: its share of the requests, spread evenly."""

from __future__ import annotations

import pytest

from layerwatch.demo.loadgen import PROMPTS, STUTTER, STUTTER_PROMPTS, Category


@pytest.mark.parametrize("share", [0.0, 0.05, 0.1, 1 / 3, 1.0])
def test_a_category_takes_exactly_its_share_of_the_requests_evenly(share):
    category = Category(("x",), share)
    included = [i for i in range(600) if category.includes(i)]
    assert len(included) == round(600 * share)
    gaps = {b - a for a, b in zip(included, included[1:])}
    assert not gaps or max(gaps) - min(gaps) <= 1  # never bunched


def test_the_stutter_category_is_five_percent_greedy_and_its_own_prompts():
    assert (STUTTER.share, STUTTER.greedy, STUTTER.prompts) == (0.05, True, STUTTER_PROMPTS)
    assert not set(STUTTER_PROMPTS) & set(PROMPTS)


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError):
        Category(("x",), share)
