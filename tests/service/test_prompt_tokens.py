"""The server's prompt token counts equal what a client counts with transformers' tokenizer on the
same checkpoint: `tokenizer(prompt)` for completions, `apply_chat_template(tokenize=True)` for chat."""

from __future__ import annotations

import shutil

import httpx
import torch
from transformers import AutoTokenizer

from layerwatch.inference_shim.service.shim import ServeSettings, ShimService
from tests.service.conftest import MODEL_NAME, InProcessServer

# ChatML, which writes no BOS, on a tokenizer that prepends BOS to plain text.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_prompt_tokens_match_transformers(tiny_checkpoint, tmp_path):
    folder = tmp_path / MODEL_NAME
    shutil.copytree(tiny_checkpoint.path, folder)
    (folder / "chat_template.jinja").write_text(CHATML)
    reference = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "In the beginning"}]
    settings = ServeSettings(model_dir=folder, model_name=MODEL_NAME, exporter_address="", max_tokens_cap=4)
    torch.set_num_threads(1)
    with InProcessServer(ShimService.load(settings)) as server:
        chat = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1},
            timeout=30,
        )
        completion = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 1},
            timeout=30,
        )
    chat_ids = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert chat.json()["usage"]["prompt_tokens"] == len(chat_ids)
    assert reference.bos_token_id not in chat_ids  # the template writes none
    prompt_ids = reference("In the beginning").input_ids
    assert completion.json()["usage"]["prompt_tokens"] == len(prompt_ids) and prompt_ids[0] == reference.bos_token_id
