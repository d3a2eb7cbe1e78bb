"""A checkpoint's chat template that loops for some conversations: each render is stopped at its
bound, and the routes that render nothing keep answering (issue 43, item 2)."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from layerwatch.inference_shim.runtime.chat_template import RENDER_SECONDS

from .conftest import MODEL_NAME, InProcessServer

# Loads (one user message renders at once), then loops for good on a message that says "spin".
SPINNING = (
    "{% for m in messages %}{% if m.content == 'spin' %}{% for i in range(99999) %}{% for j in range(99999) %}"
    "{% endfor %}{% endfor %}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)
CLIENTS = 7  # more than the event loop's default worker threads on a 2-core machine (6)


def test_renders_that_loop_are_stopped_and_a_plain_completion_is_answered_meanwhile(tiny_checkpoint, tmp_path):
    """Before: 7 such chats held a worker thread each for good (a disconnect did not stop them), and a
    plain /v1/completions sent after them timed out."""
    from layerwatch.inference_shim.service.shim import ServeSettings, ShimService

    folder = tmp_path / MODEL_NAME
    shutil.copytree(tiny_checkpoint.path, folder)
    (folder / "chat_template.jinja").write_text(SPINNING)
    torch.set_num_threads(1)
    settings = ServeSettings(model_dir=folder, model_name=MODEL_NAME, exporter_address="", max_tokens_cap=8)
    server = InProcessServer(ShimService.load(settings)).__enter__()
    try:
        url = server.base_url

        def chat(content: str) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            return response, time.monotonic() - started

        with ThreadPoolExecutor(CLIENTS + 1) as pool:
            spinning = [pool.submit(chat, "spin") for _ in range(CLIENTS)]
            time.sleep(0.5)  # every spinning render started or waiting
            started = time.monotonic()
            plain = httpx.post(
                f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "the", "max_tokens": 4}, timeout=60
            )
            plain_seconds = time.monotonic() - started
            answers = [future.result() for future in spinning]
        # Measured: the completion 0.2 s, the chats 2.5 to 9.4 s (two renders at once, each stopped at
        # its 2 s); before, the completion timed out behind the renders and the chats never ended.
        assert plain.status_code == 200, plain.text
        assert plain_seconds < RENDER_SECONDS, plain_seconds  # it waits for no render
        for response, seconds in answers:
            assert (
                response.status_code == 400
                and "The chat template refused the messages: the chat template" in (response.json()["error"]["message"])
            )
            assert seconds < 3 * RENDER_SECONDS * CLIENTS, seconds
        answered, _ = chat("hello")
        assert answered.status_code == 200, answered.text
    finally:
        server.__exit__(None, None, None)
