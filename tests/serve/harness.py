"""Helpers of the server tests: the engine under test, and servers started in-process (uvicorn in a
thread on a free localhost port); the chat template of the test tokenizer (tests/serve/fixtures.py).

Every server test runs on `ling_jax.engine.Engine`; those that need a slow engine (disconnects, full
queues) pace it: `Paced` sleeps before each decode round of one token."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

from ling_jax.config import LingConfig
from ling_jax.engine import Engine
from serve.app import create_app
from serve.server import HTTPServer, bind

SPECIAL = ["<pad>", "<eos>", "<bos>", "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0.. (eos 1: the config's)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class Paced(Engine):
    """The engine, `token_delay` seconds slower per new token (one token per decode round)."""

    def __init__(self, *args: Any, token_delay: float, **kw: Any):
        super().__init__(*args, **kw | {"decode_steps": 1})
        self.token_delay = token_delay

    def _decode_round(self) -> None:
        time.sleep(self.token_delay)
        super()._decode_round()


def engine_factory(token_delay: float = 0.0) -> Any:
    """`(config, params, **options) -> engine`: the engine, `Paced` given a `token_delay`."""
    return functools.partial(Paced, token_delay=token_delay) if token_delay else Engine


def make_engine(model: tuple[LingConfig, Any], *, token_delay: float = 0.0, warmup: bool = False,
                **kw: Any) -> Any:
    """A started engine (`warmup`: compiled first, so that timing tests measure serving, not compiling)."""
    cfg, params = model
    engine = engine_factory(token_delay)(cfg, params, **kw)
    if warmup:
        engine.warmup()
    engine.start()
    return engine


class Served:
    """A running server: its base `url` ("http://127.0.0.1:PORT"), engine and ServerState."""

    def __init__(self, url: str, engine: Any, state: Any):
        self.url, self.engine, self.state = url, engine, state

    def openai(self, api_key: str = "none") -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request."""
        deadline = time.monotonic() + timeout
        while (s := self.engine.stats())["running"] or s["waiting"]:
            assert time.monotonic() < deadline, f"engine still busy: {s}"
            time.sleep(0.01)


@contextlib.contextmanager
def serve(engine: Any, **app_kw: Any) -> Iterator[Served]:
    """`create_app(engine, **app_kw)` served on a free localhost port for the with-block."""
    app = create_app(engine, **app_kw)
    http = HTTPServer(app, bind("127.0.0.1", 0), log_level="warning")
    http.start()
    try:
        yield Served(f"http://127.0.0.1:{http.port}", engine, app.state.server)
    finally:
        http.stop()
