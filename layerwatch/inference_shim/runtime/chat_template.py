"""Chat templates compiled and rendered in a bounded worker process.

A checkpoint's chat template is data from whoever made the checkpoint (a GGUF file, a
tokenizer_config.json), and Jinja's sandbox keeps it from Python's internals but not from time and
memory: Jinja folds constant expressions while it compiles (`{{ 'x' * 4000000000 }}` allocated 12 GB
before any render), and a render may loop for as long as it likes (two nested `range(99999)` loops).
Neither can be stopped from inside the thread that runs it. So every compile and render happens in a
worker process (this file, run by its path with the standard library and jinja2 only) whose address
space is capped at MEMORY_BYTES and whose CPU time is capped per request; the caller waits for it at
most COMPILE_SECONDS or RENDER_SECONDS, then kills it and starts another. A template past a bound is
a `TemplateLimitError`, a jinja2 `TemplateError`, so the callers that answer a refusing template
(a 400, one line and exit 2) answer this one the same way.

Workers are shared by every tokenizer of the process (at most MAX_WORKERS, started on first use and
kept), and keep each template they compiled, keyed by its text.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2.exceptions import TemplateError

if TYPE_CHECKING:
    from jinja2 import Environment, Template

# The bounds of a template's work. A real template renders a conversation in milliseconds and
# compiles in tens of them; these leave room for a loaded machine and none for a hostile template.
COMPILE_SECONDS = 10.0
RENDER_SECONDS = 2.0
MEMORY_BYTES = 1 << 30  # the worker's address space, the interpreter and jinja2 included (about 40 MB)
MAX_TEXT_CHARS = 1 << 24  # a rendered prompt: far beyond any model's context, far below the memory cap
MAX_WORKERS = 2  # renders at once; the rest wait, within their own deadline
START_SECONDS = 30.0  # a worker's start (an interpreter and jinja2), not counted in a request's deadline
CACHED_TEMPLATES = 32  # compiled templates a worker keeps


class TemplateLimitError(TemplateError):
    """A chat template that needed more time or memory than its bounds to compile or render;
    `problem` says which, as a predicate ("took more than 2 s")."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"the chat template {problem}")
        self.problem = problem


def all_busy() -> TemplateLimitError:
    """The error of a render that waited its whole bound for a worker."""
    return TemplateLimitError(
        f"could not be run: every worker stayed busy for {RENDER_SECONDS:g} s (other renders at their bounds)"
    )


def check_compiles(source: str) -> None:
    """Compile `source` in a worker: jinja2's TemplateSyntaxError for a template that is not valid
    Jinja, TemplateLimitError for one past the bounds (a parser recursing too deeply included)."""
    _pool().ask({"source": source}, COMPILE_SECONDS)


def render(source: str, variables: dict[str, Any]) -> str:
    """The template rendered with `variables` (plain JSON values), within the bounds."""
    return _pool().ask({"source": source, "variables": variables}, RENDER_SECONDS)["text"]


# --- the caller's side ---------------------------------------------------------------------------


class _Worker:
    def __init__(self) -> None:
        # -P: the script's folder (layerwatch/inference_shim/runtime) is not put on sys.path, where its modules
        # could stand in for those jinja2 imports.
        self.process = subprocess.Popen(
            [sys.executable, "-P", str(Path(__file__))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._buffer = b""
        if self._read_line(time.monotonic() + START_SECONDS) != b"ready":
            self.kill()
            raise TemplateLimitError(f"could not be run: its worker did not start within {START_SECONDS:g} s")

    def ask(self, request: dict[str, Any], seconds: float) -> dict[str, Any]:
        """The worker's answer; TemplateLimitError (the worker killed) past `seconds` or if it died."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({**request, "seconds": seconds}).encode() + b"\n")
            self.process.stdin.flush()
        except OSError:
            self.kill()
            raise TemplateLimitError("could not be run: its worker died") from None
        line = self._read_line(time.monotonic() + seconds)
        if line is None:
            self.kill()
            raise TemplateLimitError(f"took more than {seconds:g} s")
        return json.loads(line)

    def _read_line(self, deadline: float) -> bytes | None:
        """The worker's next line; None past the deadline or when it ended (killed for its CPU time)."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        readable = select.poll()  # (not select.select: a server's descriptors go past its 1024)
        readable.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not readable.poll(remaining * 1000):
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


class _Pool:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self._idle: list[_Worker] = []
        self._started = 0
        self._available = threading.Condition()

    def ask(self, request: dict[str, Any], seconds: float) -> dict[str, Any]:
        worker = self._acquire(time.monotonic() + seconds)
        try:
            answer = worker.ask(request, seconds)
        except TemplateLimitError:
            self._release(None)
            raise
        self._release(worker)
        if "error" in answer:
            raise _error(answer)
        return answer

    def _acquire(self, deadline: float) -> _Worker:
        with self._available:
            while not self._idle and self._started >= MAX_WORKERS:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._available.wait(remaining):
                    raise all_busy()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return _Worker()
        except BaseException:
            self._release(None)
            raise

    def _release(self, worker: _Worker | None) -> None:
        """Give `worker` back, or, for one that was killed (None), its place."""
        with self._available:
            if worker is None:
                self._started -= 1
            else:
                self._idle.append(worker)
            self._available.notify()

    def close(self) -> None:
        with self._available:
            for worker in self._idle:
                worker.kill()
            self._idle.clear()


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():  # a forked child starts its own workers
            _POOL = _Pool()
            atexit.register(_POOL.close)
        return _POOL


def _error(answer: dict[str, Any]) -> TemplateError:
    from jinja2 import TemplateSyntaxError

    if answer["error"] == "syntax":
        error = TemplateSyntaxError(answer["message"], answer["lineno"])
        error.translated = True  # as jinja2 raises it from a compile: str() is the message alone
        return error
    if answer["error"] == "limit":
        return TemplateLimitError(answer["message"])
    return TemplateError(answer["message"])


# --- the worker's side ---------------------------------------------------------------------------


def _serve() -> None:
    """Answer one JSON request a line: compile a template (cached by its text), render it if asked."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, resource.getrlimit(resource.RLIMIT_AS)[1]))
    compiled: OrderedDict[str, Template] = OrderedDict()
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        _limit_cpu(request["seconds"])
        try:
            answer = _answer(compiled, request)
        except MemoryError:
            answer = {"error": "limit", "message": f"needed more than {MEMORY_BYTES >> 20} MiB"}
        print(json.dumps(answer), flush=True)


def _limit_cpu(seconds: float) -> None:
    # A backstop for a worker whose caller is gone (and so will not kill it): the kernel ends it
    # (SIGXCPU) once this request has used its seconds of CPU time, and a second more.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


def _answer(compiled: OrderedDict[str, Template], request: dict[str, Any]) -> dict[str, Any]:
    from jinja2 import TemplateSyntaxError

    source = request["source"]
    try:
        if source not in compiled:
            compiled[source] = environment().from_string(source)
            if len(compiled) > CACHED_TEMPLATES:
                compiled.popitem(last=False)
        compiled.move_to_end(source)
        if "variables" not in request:
            return {}
        text = compiled[source].render(**request["variables"])
    except TemplateSyntaxError as exc:
        return {"error": "syntax", "message": exc.message or str(exc), "lineno": exc.lineno}
    except RecursionError:  # Jinja's parser and renderer recurse once per nested expression
        return {"error": "limit", "message": "is nested too deeply for Jinja"}
    except TemplateError as exc:  # raise_exception, a sandbox refusal, an undefined value
        return {"error": "template", "message": str(exc)}
    except MemoryError:
        raise
    except Exception as exc:  # a template's own Python error (a str + int, a method on None)
        return {"error": "template", "message": f"{type(exc).__name__}: {exc}"}
    if len(text) > MAX_TEXT_CHARS:
        return {"error": "limit", "message": f"wrote more than {MAX_TEXT_CHARS} characters"}
    return {"text": text}


@functools.cache
def environment() -> Environment:
    """The Jinja environment of transformers' `apply_chat_template`: sandboxed (a checkpoint's template
    is data, not trusted code), trim_blocks and lstrip_blocks, loop controls, the `{% generation %}`
    tag (here a no-op: it only marks assistant text for training masks), a `tojson` that does not
    escape HTML and takes json.dumps's arguments, and the globals `raise_exception`, `strftime_now`,
    `dict` and `namespace` (the last two refusing what could reach Python internals). The worker
    compiles and renders in it; the caller only parses templates in it (`Environment.parse` folds
    nothing), to read what they take."""
    import jinja2
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Namespace's signature: `namespace(self=...)` must work
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot store underscore-prefixed attributes, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(), namespace=TemplateNamespace
    )
    return env


if __name__ == "__main__":
    _serve()
