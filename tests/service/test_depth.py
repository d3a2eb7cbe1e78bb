"""The depth each request runs at (layerwatch/inference_shim/service/depth.py), against the real served tiny
model over real HTTP: the request field (through the official `openai` client's extra_body), the
long-prompt rule, the complexity pre-check, the staged rollout with its demotion (the
override and the demotion by a paging alert, which come from the alert-driven mitigation, are in
test_mitigation.py). "Ran at tau" is read from what the engine did: a request at full depth skips no layer
(usage.layers_skipped, the per-layer counters), one at the served tau skips the tiny gates' low
layers; the depth metrics count each request once by mode and reason.
"""

from __future__ import annotations

import argparse
import logging
import re

import httpx
import openai
import pytest

from layerwatch.inference_shim.service.depth import (
    DepthSettings,
    RolloutLevel,
    parse_rollout_levels,
    parse_threshold_range,
    request_position,
)
from tests.service.conftest import MODEL_NAME
from tests.service.test_shadow import checks_done, settled
from tests.support import sample_sum

SHORT = "In"  # BOS + 1 token
LONG = "In the beginning God created the heaven and the earth."  # well over 8 tokens


def complete(base_url: str, prompt: str = SHORT, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0, **fields}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def decisions(server, mode: str, reason: str) -> float:
    return sample_sum(server.metrics(), "layerwatch_depth_decisions_total", mode=mode, reason=reason)


def test_request_field_sets_the_threshold_within_the_operator_range(in_process):
    server = in_process(request_threshold_range=(0.0, 0.3))
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)

    def run(tau: float) -> dict:
        completion = client.completions.create(
            model=MODEL_NAME, prompt=SHORT, max_tokens=16, temperature=0, extra_body={"skip_threshold": tau}
        )
        assert completion.usage is not None
        return completion.usage.model_dump()

    full = run(0.0)
    assert full["layers_skipped"] == 0 and full["layers_executed"] == 16 * 6
    assert run(0.18)["layers_skipped"] > 0  # the tiny gates' low layers, after the patience
    run(0.05)
    assert decisions(server, "full", "request") == 1
    assert decisions(server, "gated", "request") == 1
    assert decisions(server, "strict", "request") == 1  # below the served 0.18
    snapshot = server.metrics()
    assert sample_sum(snapshot, "layerwatch_request_threshold_bucket", le="0.0") == 1  # the full-depth one
    assert sample_sum(snapshot, "layerwatch_request_threshold_bucket", le="0.05") == 2
    assert sample_sum(snapshot, "layerwatch_request_threshold_count") == 3

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=SHORT, max_tokens=4, extra_body={"skip_threshold": 0.5})
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "skip_threshold"
    assert "skip_threshold must be in [0, 0.3] on this server, got 0.5" in error["message"]


def test_request_field_is_refused_unless_the_operator_allows_it(server):
    before = sample_sum(server.metrics(), "layerwatch_depth_decisions_total")
    messages = []
    for value in (0.1, "0.1", True):
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": SHORT, "max_tokens": 2, "skip_threshold": value},
            timeout=30,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "skip_threshold"
        messages.append(error["message"])
    assert "does not accept per-request thresholds" in messages[0]
    assert "--request-threshold-range LO:HI" in messages[0]
    assert all("valid number" in m for m in messages[1:])  # the schema's strict types
    assert sample_sum(server.metrics(), "layerwatch_depth_decisions_total") == before


def test_long_prompts_run_at_the_long_prompt_threshold(in_process):
    server = in_process(long_prompt_tokens=8)
    assert complete(server.base_url, LONG)["usage"]["layers_skipped"] == 0
    assert complete(server.base_url, SHORT)["usage"]["layers_skipped"] > 0
    assert decisions(server, "full", "prompt_length") == 1
    assert decisions(server, "gated", "default") == 1


def test_complexity_precheck_runs_complex_prompts_at_full_depth_after_their_prefill(in_process):
    server = in_process(complexity_cutoff=0.0)  # every prompt is at least 0 complex
    response = complete(server.base_url, LONG, n=2)
    assert response["usage"]["layers_skipped"] == 0  # both choices, decided after their prefill
    assert decisions(server, "full", "complexity") == 2
    snapshot = server.metrics()
    assert sample_sum(snapshot, "layerwatch_prompt_complexity_count") == 2
    # The tiny gates score layers 1 and 2 of the skippable 1..4 low on every token: at least half.
    assert sample_sum(snapshot, "layerwatch_prompt_complexity_bucket", le="0.45") == 0


def test_complexity_is_scored_but_decides_nothing_without_a_cutoff(in_process):
    server = in_process(request_threshold_range=(0.0, 1.0))
    assert complete(server.base_url, LONG)["usage"]["layers_skipped"] > 0
    # The request field outranks the pre-check.
    assert complete(server.base_url, LONG, skip_threshold=0.0)["usage"]["layers_skipped"] == 0
    assert decisions(server, "gated", "default") == 1
    assert decisions(server, "full", "request") == 1
    assert sample_sum(server.metrics(), "layerwatch_prompt_complexity_count") == 2


def test_rollout_enables_skipping_per_level_and_demotes_to_the_previous_one(in_process, caplog):
    levels = parse_rollout_levels("share=0;share=1,max_tokens=8")
    server = in_process(rollout_levels=levels)  # starts at the last level
    depth = server.service.depth
    assert sample_sum(server.metrics(), "layerwatch_rollout_level") == 2
    assert complete(server.base_url, max_tokens=8)["usage"]["layers_skipped"] > 0
    assert complete(server.base_url, max_tokens=16)["usage"]["layers_skipped"] == 0  # over the level's limit
    assert decisions(server, "full", "rollout") == 1

    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.service.depth"):
        assert depth.demote("LayerwatchRunawaySkipping") is True
        assert depth.demote("LayerwatchRunawaySkipping") is False  # already at the first level
    demoted = 'ROLLOUT_DEMOTED: from_level=2 to_level=1 conditions="share=0" reason=LayerwatchRunawaySkipping'
    assert demoted in caplog.text
    snapshot = server.metrics()
    assert sample_sum(snapshot, "layerwatch_rollout_level") == 1
    assert sample_sum(snapshot, "layerwatch_rollout_demotions_total") == 1
    assert complete(server.base_url, max_tokens=8)["usage"]["layers_skipped"] == 0  # share 0: nobody skips
    assert decisions(server, "full", "rollout") == 2


@pytest.mark.parametrize("holdoff_minutes, levels_after", [(10.0, [2, 2]), (0.0, [2, 1])])
def test_demotions_within_the_holdoff_cost_one_level(in_process, caplog, holdoff_minutes, levels_after):
    """One incident pages once per alert and per instance: the second page within the hold-off
    leaves the level where the first put it."""
    server = in_process(
        rollout_levels=parse_rollout_levels("share=0;share=0.5;share=1"),
        rollout_demotion_holdoff_minutes=holdoff_minutes,
    )
    levels = []
    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.service.depth"):
        for alertname in ("LayerwatchRoutingStatic", "LayerwatchRunawaySkipping"):
            server.service.depth.demote(alertname)
            levels.append(sample_sum(server.metrics(), "layerwatch_rollout_level"))
    assert levels == levels_after
    assert sample_sum(server.metrics(), "layerwatch_rollout_demotions_total") == 3 - levels_after[-1]
    assert ("hold-off" in caplog.text) == (holdoff_minutes > 0)


def test_rollout_starts_at_the_level_the_operator_sets(in_process):
    server = in_process(rollout_levels=parse_rollout_levels("share=0;share=1"), rollout_level=1)
    assert complete(server.base_url)["usage"]["layers_skipped"] == 0
    assert sample_sum(server.metrics(), "layerwatch_rollout_level") == 1


def test_rollout_share_is_a_deterministic_share_of_request_ids():
    ids = [f"cmpl-{i:024x}" for i in range(2000)]
    assert [request_position(i) for i in ids] == [request_position(i) for i in ids]
    enabled = sum(RolloutLevel(share=0.25).enables(i, 16, 0.0) for i in ids)
    assert 400 < enabled < 600
    assert not RolloutLevel(min_temperature=0.5).enables(ids[0], 16, 0.0)
    assert RolloutLevel(min_temperature=0.5).enables(ids[0], 16, 0.7)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("share=2", "rollout level 1: share must be in [0, 1], got 2"),
        ("share=0.1;;share=1", "rollout level 2 is empty"),
        ("share=0.1;depth=3", "rollout level 2: 'depth=3' is not one of share=S"),
        ("share=0.1,share=0.2", "rollout level 1: 'share=0.2' is not one of"),
        ("max_tokens=8.5", "rollout level 1: max_tokens must be an integer, got '8.5'"),
        ("share=half", "rollout level 1: share must be a number, got 'half'"),
        ("max_tokens=0", "rollout level 1: max_tokens must be >= 1, got 0"),
        ("min_temperature=-1", "rollout level 1: min_temperature must be >= 0, got -1"),
        # Out of order: a demotion (back one level) would widen skipping on a paging alert.
        ("share=1;share=0.1", "rollout level 2 (share=0.1) enables skipping for fewer requests than level 1"),
        ("share=0.5;share=1,max_tokens=8", "rollout level 2 (share=1,max_tokens=8) enables skipping for fewer"),
        ("share=0.5,max_tokens=64;share=1,max_tokens=8", "rollout level 2 (share=1,max_tokens=8) enables"),
        ("min_temperature=0.5;min_temperature=0.7", "rollout level 2 (share=1,min_temperature=0.7) enables"),
    ],
)
def test_bad_rollout_levels_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_rollout_levels(text)


@pytest.mark.parametrize("text", ["0.5:0.1", "0.1", "a:b", "-0.1:0.2", "0:1.5", "nan:nan"])
def test_bad_threshold_ranges_are_refused(text):
    with pytest.raises(ValueError, match="expected LO:HI with 0 <= LO <= HI <= 1"):
        parse_threshold_range(text)


def test_bad_depth_settings_are_refused_at_start():
    with pytest.raises(ValueError, match="--request-threshold-range must satisfy"):
        DepthSettings(request_threshold_range=(0.5, 0.1)).check()
    with pytest.raises(ValueError, match="--rollout-level needs --rollout-levels"):
        DepthSettings(rollout_level=1).check()
    with pytest.raises(ValueError, match=r"--rollout-level must be in 1\.\.2"):
        DepthSettings(rollout_levels=parse_rollout_levels("share=0;share=1"), rollout_level=3).check()


def test_bad_depth_settings_fail_before_the_model_loads(tmp_path):
    """As a bad token file does: a typo in a depth flag must not wait for minutes of loading (and
    compiling) to be reported. The model folder here does not exist: the flag is named first."""
    from layerwatch.inference_shim.service.shim import ServeSettings, ShimService

    settings = ServeSettings(model_dir=tmp_path / "absent", exporter_address="", rollout_level=2)
    with pytest.raises(ValueError, match="--rollout-level needs --rollout-levels"):
        ShimService.load(settings)


def test_serve_flags_parse_and_refuse_with_the_reason(capsys):
    from layerwatch.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--request-threshold-range", "0:0.3", "--rollout-levels", "share=0.1;share=1"])
    settings = serve.settings_from_arguments(args)
    assert settings.request_threshold_range == (0.0, 0.3)
    assert settings.rollout_levels == (RolloutLevel(0.1), RolloutLevel(1.0))
    with pytest.raises(SystemExit):
        parser.parse_args(["--rollout-levels", "share=0.1;speed=2"])
    assert "'speed=2' is not one of share=S" in capsys.readouterr().err


def test_full_depth_decisions_are_not_shadow_checked(in_process):
    """A request that ran at full depth by its decision has nothing gated to check: its shadow check
    would always agree and dilute the agreement ratio LayerwatchShadowAgreementLow reads (with a
    rollout at share 0.1, nine checks in ten were of full-depth requests)."""
    server = in_process(shadow_rate=1.0, request_threshold_range=(0.0, 1.0))
    complete(server.base_url, skip_threshold=0.0)  # full depth, by the request field
    complete(server.base_url)  # the served tau
    tokens, *_ = checks_done(server, 1)
    assert tokens == 16  # the gated request's alone


def test_a_sampled_request_moved_to_full_depth_after_its_prefill_is_counted_not_checked(in_process):
    """The shadow sample is decided at admission; the complexity pre-check may move the request to full
    depth after its prefill, and then there is nothing gated to check: counted as full_depth."""
    server = in_process(shadow_rate=1.0, complexity_cutoff=0.0)  # every prompt is at least 0 complex
    complete(server.base_url, LONG, temperature=0.8, seed=1)
    assert decisions(server, "full", "complexity") == 1
    tokens, *_ = settled(server)
    assert tokens == 0
    snapshot = server.metrics()
    assert sample_sum(snapshot, "layerwatch_shadow_requests_total", outcome="full_depth") == 1
    assert sample_sum(snapshot, "layerwatch_shadow_requests_total", outcome="checked") == 0
