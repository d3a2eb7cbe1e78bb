"""A checkpoint's chat template that loops for some conversations, served by a real `layerwatch serve`:
each render is stopped at its bound, a render waits for a worker no longer than that bound, the
routes that render nothing keep answering, and SIGTERM drains promptly and cleanly (issue 43, item 2)."""

from __future__ import annotations

import dataclasses
import shutil
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

from layerwatch.inference_shim.runtime.chat_template import RENDER_SECONDS
from tests.reliability.conftest import MODEL_NAME, Shim
from tests.support import sample_sum, wait_for

# Loads (one user message renders at once), then loops for good on a message that says "spin".
SPINNING = (
    "{% for m in messages %}{% if m.content == 'spin' %}{% for i in range(99999) %}{% for j in range(99999) %}"
    "{% endfor %}{% endfor %}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)
# More than the event loop's default worker threads on a 2-core machine (6), and six times the
# template workers: waiting their turns, the last would be answered after 12 s.
CLIENTS = 12
# A render waits at most RENDER_SECONDS for a worker and runs at most RENDER_SECONDS; the rest is margin
# for a loaded machine.
ANSWERED_WITHIN = 4 * RENDER_SECONDS


def test_looping_renders_are_bounded_and_sigterm_drains_them_promptly_without_tracebacks(tiny_checkpoint, tmp_path):
    """Before: 7 such chats held a worker thread each for good (a disconnect did not stop them), a
    plain /v1/completions sent after them timed out, and SIGTERM took 35 s and logged 8 CancelledError
    tracebacks. With renders bounded but queued: 30 chats answered over 34 s, SIGTERM 33 s and 4
    tracebacks (cut off by the drain)."""
    folder = tmp_path / MODEL_NAME
    shutil.copytree(tiny_checkpoint.path, folder)
    (folder / "chat_template.jinja").write_text(SPINNING)
    checkpoint = dataclasses.replace(tiny_checkpoint, path=folder, gates_path=folder / "gates.safetensors")
    shim = Shim(tmp_path, checkpoint).start()
    try:

        def chat() -> tuple[httpx.Response, float]:
            started = time.monotonic()
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "spin"}], "max_tokens": 4}
            response = httpx.post(f"{shim.url}/v1/chat/completions", json=body, timeout=60)
            return response, time.monotonic() - started

        def all_admitted(spinning: list[Future]) -> bool:
            # Admitted from its body's arrival until answered: rendering or waiting to render, or done.
            waiting = sample_sum(shim.metrics(), "layerwatch_requests_waiting")
            return waiting + sum(future.done() for future in spinning) >= CLIENTS

        with ThreadPoolExecutor(CLIENTS) as pool:
            spinning = [pool.submit(chat) for _ in range(CLIENTS)]
            wait_for(lambda: all_admitted(spinning), what="every chat admitted")  # none refused by the drain
            started = time.monotonic()
            plain = shim.complete("the")
            plain_seconds = time.monotonic() - started
            shim.process.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            answers = [future.result() for future in spinning]
            exit_code = shim.process.proc.wait(30)
            exit_seconds = time.monotonic() - signalled
        # Measured on 2 busy cores: the completion 0.2 s; the chats within 5.6 s (two renders stopped
        # at their 2 s, the others refused once they had waited 2 s); exit 2.4 to 4.6 s after SIGTERM.
        assert plain.status_code == 200, plain.text
        assert plain_seconds < RENDER_SECONDS, plain_seconds  # it waits for no render
        for response, seconds in answers:
            assert response.status_code == 400, response.text
            assert "The chat template refused the messages: the chat template" in response.json()["error"]["message"]
            assert seconds < ANSWERED_WITHIN, seconds
        assert exit_code == -signal.SIGTERM and exit_seconds < ANSWERED_WITHIN, (exit_code, exit_seconds)
        log = shim.process.log_path.read_text()
        assert "SIGTERM received: draining" in log and "Traceback" not in log, log[-3000:]
    finally:
        shim.stop()
