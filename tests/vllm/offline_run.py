"""Run in .venv-vllm by the tests (tests/vllm_engine.run_helper): greedy completions of vLLM's offline `LLM`, one
prompt at a time, on stock vLLM or on the plugin; the line of stdout after RESULT is JSON.

    offline_run.py FOLDER MAX_TOKENS PROMPTS_JSON [SETTINGS_JSON [TENSOR_PARALLEL [PIPELINE_PARALLEL [SAMPLED]]]]

Without SETTINGS_JSON, stock vLLM serves FOLDER (which must hold no gate file: vLLM would take it for weights).
With it, the plugin serves it with those layerwatch settings, its frames sent to a UDP socket of this script:
each prompt's frames (scores, skips, first layer, the datagram in hex) are returned with its tokens, and each
worker's executed counters. With SAMPLED > 0, then the prompts at once, sampled (n = 2, temperature 0.8, SAMPLED
tokens each): their frames and token count. Pipeline stages run with vLLM's compile warm-up (docs/vllm.md,
"Past one machine").
"""

from __future__ import annotations

import json
import socket
import sys

from vllm import LLM, SamplingParams

from layerwatch.vllm_plugin import ARCHITECTURE
from layerwatch.wire import decode_frame

RESULT = "RESULT "  # the line that holds the JSON: vLLM logs to stdout too


def frames_since(sock: socket.socket) -> list[dict]:
    frames = []
    while True:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return frames
        frame = decode_frame(data)
        frames.append(
            {
                "scores": frame.entropies.tolist(),
                "skipped": frame.skipped.tolist(),
                "seq": frame.sequence,
                "first_layer": frame.first_layer,
                "data": data.hex(),
            }
        )


def main() -> None:
    folder, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    settings = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    tensor_parallel = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    pipeline_parallel = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    sampled_tokens = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    options: dict = {}
    sock = None
    if settings is not None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        settings = settings | {"exporter_address": f"127.0.0.1:{sock.getsockname()[1]}"}
        options = {
            "hf_overrides": {"architectures": [ARCHITECTURE], "layerwatch": settings},
            "worker_extension_cls": "layerwatch.vllm_plugin.worker.LayerwatchWorker",
        }
    llm = LLM(
        model=folder,
        dtype="float32",
        enforce_eager=pipeline_parallel == 1,
        max_model_len=512,
        block_size=32,  # as the shared engine's (tests/vllm_engine.py)
        tensor_parallel_size=tensor_parallel,
        pipeline_parallel_size=pipeline_parallel,
        **options,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for prompt in prompts:
        (output,) = llm.generate([prompt], greedy, use_tqdm=False)
        run = {"prompt_ids": output.prompt_token_ids, "output_ids": list(output.outputs[0].token_ids)}
        if sock is not None:
            run["frames"] = frames_since(sock)
        runs.append(run)
    sampled = None
    if sampled_tokens and sock is not None:
        params = SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=sampled_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(sample.token_ids) for output in outputs for sample in output.outputs)
        sampled = {"tokens": tokens, "frames": frames_since(sock)}
    executed = llm.collective_rpc("layerwatch_executed") if sock is not None else None
    print(RESULT + json.dumps({"runs": runs, "sampled": sampled, "executed": executed}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine and workers: the script must be importable without running
    main()
