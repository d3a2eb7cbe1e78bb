"""What a request body that fails validation costs the shim, per shape of hostile body.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/invalid_body.py [--mib 1]

Each body is `--mib` MiB of JSON (the default is `serve`'s --max-body-bytes) whose every element is
invalid, in one of the ways a request can hold many: a list of wrong values in each list field, a
dict of them, unknown fields by the thousand. For each, as the shim handles it (`parse_json`, then
`parse_request`), printed: the seconds it took, the peak of Python's allocations (tracemalloc, a
second run) and how many errors pydantic built (the first is all the 400 names). Without the
first-bad-element bound, `"prompt": [1.5, 1.5, ...]` builds 786 k errors (4.8 s, 900 MB of RSS); figures in
docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from layerwatch.inference_shim.service.schemas import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Detokenize,
    Unsupported,
    parse_json,
    parse_request,
)

MiB = 1 << 20


def hostile_bodies(size: int) -> dict[str, tuple[type[BaseModel], dict[str, Unsupported] | None, Any]]:
    """name -> (request model, its unsupported fields, a body of about `size` bytes that fails everywhere)."""

    def repeated(element: Any) -> list[Any]:
        return [element] * (size // (len(json.dumps(element)) + 2))

    def keyed(value: Any) -> dict[str, Any]:
        return {f"k{i}": value for i in range(size // (len(json.dumps(value)) + 12))}

    def completion(**fields: Any) -> tuple[type[BaseModel], dict[str, Unsupported], dict[str, Any]]:
        return CompletionRequest, COMPLETION_UNSUPPORTED, {"model": "m", "prompt": "p", **fields}

    def chat(**fields: Any) -> tuple[type[BaseModel], dict[str, Unsupported], dict[str, Any]]:
        message = {"role": "user", "content": "c"}
        return ChatCompletionRequest, CHAT_UNSUPPORTED, {"model": "m", "messages": [message], **fields}

    return {
        "prompt of floats": completion(prompt=repeated(1.5)),
        "prompt of negative token lists": completion(prompt=repeated([-1])),
        "unknown fields": completion(**keyed(0)),
        "stop of numbers": completion(stop=repeated(1)),
        "logit_bias out of range": completion(logit_bias={str(i): 1e9 for i in range(size // 24)}),
        "allowed_token_ids negative": completion(allowed_token_ids=repeated(-1)),
        "messages without content": chat(messages=repeated({"role": "user"})),
        "content parts of no type": chat(messages=[{"role": "user", "content": repeated({"text": "t"})}]),
        "a message of unknown fields": chat(messages=[{"role": "user", "content": "c", **keyed(0)}]),
        "metadata of numbers": chat(metadata=keyed(0)),
        "documents of numbers": chat(documents=[keyed(0)]),
        "detokenize negative ids": (Detokenize, None, {"tokens": repeated(-1)}),
    }


def measured(run: Callable[[], object]) -> tuple[float, int]:
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    tracemalloc.start()
    run()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=1.0, help="size of each body in MiB")
    size = int(parser.parse_args().mib * MiB)
    print(f"{'body':32} {'bytes':>9} {'seconds':>8} {'peak MiB':>9} {'errors':>8}  400 message")
    for name, (model, unsupported, data) in hostile_bodies(size).items():
        text = json.dumps(data)
        message = ""

        def handle(text: str = text, model: type[BaseModel] = model, unsupported: Any = unsupported) -> None:
            nonlocal message
            try:
                parse_request(model, parse_json(text), unsupported)
            except APIError as refusal:
                message = refusal.message

        seconds, peak = measured(handle)
        try:
            model.model_validate({k: v for k, v in data.items() if k not in (unsupported or {})})
            errors = 0
        except ValidationError as exc:
            errors = exc.error_count()
        print(f"{name:32} {len(text):9} {seconds:8.3f} {peak / MiB:9.1f} {errors:8}  {message[:60]}")


if __name__ == "__main__":
    main()
