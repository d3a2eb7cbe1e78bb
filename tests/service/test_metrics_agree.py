"""/metrics against what clients saw: counters move exactly by the `usage` of the requests served."""

from __future__ import annotations

import concurrent.futures
import hashlib

import httpx
from prometheus_client.parser import text_string_to_metric_families

from layerwatch import catalog
from tests.service.conftest import MODEL_NAME, NUM_LAYERS
from tests.support import sample_sum


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)


def test_every_shim_metric_of_the_catalog_is_exposed(server):
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    families = {f.name for f in text_string_to_metric_families(text)}
    exposed = {spec.base_name for spec in catalog.for_component(catalog.SHIM)}
    assert exposed <= families, exposed - families


def test_model_info_carries_the_gate_files_sha256(server):
    info = [labels for (name, labels), _ in server.metrics().items() if name == "layerwatch_model_info"]
    assert len(info) == 1
    labels = dict(info[0])
    assert labels["gates_sha256"] == hashlib.sha256(server.checkpoint.gates_path.read_bytes()).hexdigest()
    assert labels["layers"] == str(NUM_LAYERS) and labels["model_name"] == MODEL_NAME
    assert labels["threshold"] == "0.18" and labels["patience"] == "3" and labels["kv_policy"] == "project"


def test_counters_agree_with_usage_under_concurrent_requests(server):
    server.wait_idle()
    before = server.metrics()
    bodies = [
        (
            "/v1/completions",
            {
                "model": MODEL_NAME,
                "prompt": f"And the evening {i}",
                "max_tokens": 5 + 3 * i,
                "temperature": 0 if i % 2 else 0.9,
                "seed": i,
            },
        )
        for i in range(6)
    ]
    bodies.append(
        (
            "/v1/chat/completions",
            {"model": MODEL_NAME, "max_tokens": 11, "messages": [{"role": "user", "content": "the first day"}]},
        )
    )
    # Scored prompts (echo with logprobs): their scoring steps read the prompt, they generate nothing.
    for max_tokens in (0, 4):
        echo = {"model": MODEL_NAME, "prompt": "And God saw the light", "echo": True, "logprobs": 1}
        bodies.append(("/v1/completions", {**echo, "max_tokens": max_tokens, "temperature": 0}))
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:  # more requests than --max-batch-size 4
        usages = [r["usage"] for r in pool.map(lambda b: post(server, *b), bodies)]
    after = server.metrics()

    completion = sum(u["completion_tokens"] for u in usages)
    assert completion == sum(5 + 3 * i for i in range(6)) + 11 + 4
    assert delta(after, before, "layerwatch_requests_total", status="ok") == len(bodies)
    assert delta(after, before, "layerwatch_tokens_total", phase="decode") == completion
    assert delta(after, before, "layerwatch_tokens_total", phase="prefill") == sum(u["prompt_tokens"] for u in usages)
    assert delta(after, before, "layerwatch_layers_executed_count") == completion
    assert delta(after, before, "layerwatch_layers_executed_sum") == sum(u["layers_executed"] for u in usages)
    assert delta(after, before, "layerwatch_layer_skips_executed_total") == sum(u["layers_skipped"] for u in usages)
    for layer in map(str, range(NUM_LAYERS)):
        evaluations = delta(after, before, "layerwatch_layer_evaluations_total", layer=layer)
        assert evaluations == completion
        decided = delta(after, before, "layerwatch_layer_skips_total", layer=layer)
        executed = delta(after, before, "layerwatch_layer_skips_executed_total", layer=layer)
        unneeded = delta(after, before, "layerwatch_layer_unneeded_runs_total", layer=layer)
        assert 0 <= decided <= evaluations and 0 <= unneeded <= decided and 0 <= executed <= evaluations
        batch_steps = delta(after, before, "layerwatch_batch_layer_steps_total", layer=layer)
        assert 0 < batch_steps < completion  # rows shared decode steps
        assert delta(after, before, "layerwatch_batch_layer_skips_total", layer=layer) <= batch_steps
    for protected in ("0", str(NUM_LAYERS - 1)):
        assert delta(after, before, "layerwatch_layer_skips_total", layer=protected) == 0
    generating = sum(u["completion_tokens"] > 0 for u in usages)  # all but the max_tokens 0 echo
    assert delta(after, before, "layerwatch_time_to_first_token_seconds_count") == generating == len(bodies) - 1
    assert delta(after, before, "layerwatch_inter_token_latency_seconds_count") == completion - generating


def test_layers_executed_histogram_has_one_bucket_per_layer_count(server):
    buckets = sorted(
        float(dict(labels)["le"])
        for (name, labels), _ in server.metrics().items()
        if name == "layerwatch_layers_executed_bucket"
    )
    assert buckets == [float(n) for n in range(NUM_LAYERS + 1)] + [float("inf")]


def test_nvml_up_reports_whether_nvml_works_here(server):
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        expected = 1.0
    except Exception:  # no NVIDIA driver on this host: a normal state
        expected = 0.0
    assert server.metrics()[("layerwatch_nvml_up", ())] == expected
