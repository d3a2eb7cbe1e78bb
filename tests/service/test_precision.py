"""`serve --quantization` and `--dtype`: the quantized model behind the real HTTP API, its gates
loaded on it (they were trained on the float weights), and the refusals before anything loads."""

from __future__ import annotations

import httpx
import pytest

from layerwatch.inference_shim.runtime.quantization import QuantizedLinear
from layerwatch.inference_shim.service.shim import ServeSettings, ShimService

from .conftest import MODEL_NAME


def test_serve_quantized_answers_with_the_gates_of_its_float_weights(in_process, tiny_checkpoint):
    server = in_process(quantization="int4", dtype="bfloat16")
    model = server.service.model
    assert isinstance(down := model.layers[0].mlp.down_proj, QuantizedLinear) and down.method == "int4"
    assert model.gates is not None
    body = {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    [info] = [dict(labels) for (name, labels) in server.metrics() if name == "layerwatch_model_info"]
    assert info["gates_sha256"] == tiny_checkpoint.gates_sha256
    # An operator comparing quality or speed across a fleet sees the precision each shim serves in.
    assert (info["dtype"], info["quantization"]) == ("bfloat16", "int4")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"dtype": "float16"}, "--dtype float16 is slow on the CPU"),
        # Unguarded, meta (or mps, xpu on this build) is a traceback from the first
        # tensor op, seconds into loading. (int8 on a GPU: tests/model/test_quantization.py.)
        ({"device": "meta"}, "--device meta: the model runs on cpu or cuda"),
        ({"device": "mps"}, "--device mps: the model runs on cpu or cuda"),
    ],
)
def test_serve_refuses_a_precision_the_device_cannot_run_before_loading(tmp_path, settings, message):
    # A folder that does not exist: the refusal comes before any file is read.
    with pytest.raises(ValueError) as refused:
        ShimService.load(ServeSettings(model_dir=tmp_path / "absent", exporter_address="", **settings))
    assert str(refused.value).startswith(message)
