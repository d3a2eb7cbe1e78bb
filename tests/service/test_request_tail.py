"""Per-request skipping over real HTTP: the histograms and runaway counters against hand-counted requests.

Each request's skipped layers come from its own debug activity header, its below-threshold scores
from the trace file (requests are sent one at a time, so each one's trace lines are consecutive),
and its statistics are recomputed here by hand (the Wilson bound written out again), then compared
with what /metrics says moved.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from layerwatch.alerts.profile_file import PROFILES_DIR, load_profiles
from layerwatch.catalog import DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION, REQUEST_FRACTION_BUCKETS
from layerwatch.cli.serve import profile_runaway_fraction
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_NAME
from layerwatch.inference_shim.service.shim import ServeSettings
from layerwatch.trace import read_trace
from tests.service.conftest import MODEL_NAME, NUM_LAYERS
from tests.support import sample_sum

THRESHOLD = 0.18  # the tiny gates' calibrated threshold
Z = 1.2815515655446004  # one-sided 90 %
CUTOFF = 0.3  # the tiny model skips layers 1-2 always and 3 sometimes: long requests exceed 0.3


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)


def hand_share(tokens: int, below: np.ndarray) -> float | None:
    """The token-dependent share, by hand: static = one-sided 90 % Wilson lower bound of the low rate >= 0.95."""
    if tokens < 32 or below.sum() == 0:
        return None
    p = below / tokens
    n, z2 = tokens, Z * Z
    lower = (p + z2 / (2 * n) - Z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (1 + z2 / n)
    static = lower >= 0.95
    return 1 - below[static].sum() / below.sum()


@pytest.fixture
def tail_server(in_process, tmp_path):
    trace = tmp_path / "trace.jsonl"
    server = in_process(allow_debug=True, trace_file=trace, request_runaway_fraction=CUTOFF)  # max_tokens <= 32
    return server, trace


def test_histograms_and_runaway_counters_match_hand_counted_requests(tail_server):
    server, trace_path = tail_server
    before = server.metrics()
    assert sample_sum(before, "layerwatch_request_runaway_skip_fraction") == CUTOFF
    requests = [  # (max_tokens, temperature, seed)
        (2, 0.0, None),  # only patience tokens: nothing skipped
        (6, 0.0, None),
        (12, 0.9, 3),
        (32, 0.0, None),  # long enough for a token-dependent share
        (32, 0.9, 5),
        (32, 0.9, 7),
    ]
    counted = []
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for max_tokens, temperature, seed in requests:
            lines_before = sum(1 for _ in read_trace(trace_path)) if trace_path.exists() else 0
            body = {"model": MODEL_NAME, "prompt": "And God said", "max_tokens": max_tokens, "temperature": temperature}
            if seed is not None:
                body["seed"] = seed
            response = client.post("/v1/completions", json=body, headers={"x-layerwatch-debug": "true"})
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            activity = np.array(json.loads(response.headers["x-layerwatch-layer-activity"]), dtype=bool)
            rows = list(read_trace(trace_path))[lines_before:]
            tokens = usage["completion_tokens"]
            assert tokens == max_tokens == len(activity) == len(rows)
            skipped = (~activity).sum(axis=0)
            np.testing.assert_array_equal(skipped, np.stack([r.skipped for r in rows]).sum(axis=0))
            below = (np.stack([r.scores for r in rows]) < np.float32(THRESHOLD)).sum(axis=0)
            fraction = usage["layers_skipped"] / (tokens * NUM_LAYERS)
            assert fraction == skipped.sum() / (tokens * NUM_LAYERS)
            counted.append((tokens, fraction, hand_share(tokens, below), skipped))
        # Not observed: a request refused before the engine (400) has no decode tokens.
        assert client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 99}).status_code
    after = server.metrics()

    fractions = [f for _, f, _, _ in counted]
    shares = [s for _, _, s, _ in counted if s is not None]
    runaway = [(t, skipped) for t, f, _, skipped in counted if f > CUTOFF]
    assert fractions[0] == 0.0 and len(shares) == 3 and 0 < len(runaway) < len(counted)  # the test covers both sides

    assert delta(after, before, "layerwatch_request_skip_fraction_count") == len(counted)
    assert delta(after, before, "layerwatch_request_skip_fraction_sum") == pytest.approx(sum(fractions), abs=1e-12)
    assert delta(after, before, "layerwatch_request_token_dependent_share_count") == len(shares)
    assert delta(after, before, "layerwatch_request_token_dependent_share_sum") == pytest.approx(sum(shares), abs=1e-12)
    for edge in REQUEST_FRACTION_BUCKETS:
        le = str(edge)
        assert delta(after, before, "layerwatch_request_skip_fraction_bucket", le=le) == sum(
            f <= edge for f in fractions
        )
        assert delta(after, before, "layerwatch_request_token_dependent_share_bucket", le=le) == sum(
            s <= edge for s in shares
        )
    assert delta(after, before, "layerwatch_request_runaway_tokens_total") == sum(t for t, _ in runaway)
    for layer in range(NUM_LAYERS):
        assert delta(after, before, "layerwatch_request_runaway_layer_skips_total", layer=str(layer)) == sum(
            int(skipped[layer]) for _, skipped in runaway
        )
    # Consistent with the model-wide counters: runaway skips are a part of all skips.
    assert delta(after, before, "layerwatch_request_runaway_layer_skips_total") <= delta(
        after, before, "layerwatch_layer_skips_total"
    )


def test_a_runaway_cutoff_off_the_bucket_edges_is_refused(in_process):
    with pytest.raises(ValueError, match="bucket edge"):
        in_process(request_runaway_fraction=0.33)


def test_serve_takes_the_cutoff_from_the_served_models_profile(tmp_path):
    (demo,) = [p for p in load_profiles(PROFILES_DIR) if p.model_name == DEMO_MODEL_NAME]
    found = profile_runaway_fraction(ServeSettings(model_dir=Path("unused"), model_name=DEMO_MODEL_NAME))
    assert found == (demo.request_tail.runaway_skip_fraction, str(PROFILES_DIR / "demo.yaml"))
    # A model without a profile: None (serve then uses the catalog's default), as for a broken file.
    assert profile_runaway_fraction(ServeSettings(model_dir=tmp_path / "other-model")) is None
    (tmp_path / "broken.yaml").write_text("model_name: [")
    assert profile_runaway_fraction(ServeSettings(model_dir=Path("x"), model_name="x"), tmp_path) is None
    # Unchecked, these stop serve at start with a traceback (UnicodeDecodeError, RecursionError).
    (tmp_path / "latin-1.yaml").write_bytes("model_name: café\n".encode("latin-1"))
    (tmp_path / "deep.yaml").write_text("model_name: " + "[" * 5000 + "]" * 5000)
    # And this one with OverflowError.
    demo_text = (PROFILES_DIR / "demo.yaml").read_text()
    (tmp_path / "huge.yaml").write_text(demo_text.replace("threshold: 0.18", "threshold: " + "9" * 401))
    (tmp_path / "z-demo.yaml").write_bytes((PROFILES_DIR / "demo.yaml").read_bytes())  # sorted after them
    found = profile_runaway_fraction(ServeSettings(model_dir=Path("x"), model_name=DEMO_MODEL_NAME), tmp_path)
    assert found == (demo.request_tail.runaway_skip_fraction, str(tmp_path / "z-demo.yaml"))
    assert DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION in REQUEST_FRACTION_BUCKETS
    assert not math.isclose(demo.request_tail.runaway_skip_fraction, DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION)
