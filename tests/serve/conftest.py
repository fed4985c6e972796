"""Fixtures of the server tests: the tiny model, a trained BPE tokenizer with a chat template, the
engine under test, and servers started in-process (uvicorn in a thread on a free localhost port).

`ENGINE` is the engine class every server test runs on: the test double until
`ling_jax.engine.Engine` lands, then that (one line)."""

from __future__ import annotations

import contextlib
import functools
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ling_jax.config import LingConfig
from ling_jax.params import init_params
from serve.app import create_app
from serve.server import HTTPServer, bind
from serve.text import TextCodec
from tests.serve.fake_engine import FakeEngine

ENGINE = FakeEngine

SPECIAL = ["<pad>", "<eos>", "<bos>", "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0.. (eos 1: the config's)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def model() -> tuple[LingConfig, Any]:
    cfg = LingConfig.preset("debug")
    return cfg, init_params(cfg, seed=0)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """tokenizer.json: a byte-level BPE trained to the debug model's 512 ids, and a tokenizer_config.json
    with the chat template and special tokens."""
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "ling", "jax", "the", "and", "is"]
    corpus = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(30))
              + " héllo wörld ✓." for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == 512
    d = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": {"content": "<eos>", "special": True}, "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE}))
    return d


@pytest.fixture(scope="session")
def codec(tokenizer_dir) -> TextCodec:
    return TextCodec.from_files(tokenizer_dir / "tokenizer.json")


def engine_factory(token_delay: float = 0.0) -> Any:
    """The class under test as `(config, params, **options) -> engine` (`token_delay`: the double's
    pause before each token; a real engine runs at its own pace)."""
    return functools.partial(ENGINE, token_delay=token_delay) if ENGINE is FakeEngine else ENGINE


def make_engine(model: tuple[LingConfig, Any], *, token_delay: float = 0.0, **kw: Any) -> Any:
    """A started engine of the class under test."""
    cfg, params = model
    engine = engine_factory(token_delay)(cfg, params, **kw)
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


@pytest.fixture(scope="module")
def server(model, codec) -> Iterator[Served]:
    """The main test server: tokenizer + chat template, max_len 256, pages of 4 tokens, prefix cache."""
    engine = make_engine(model, max_batch=4, max_len=256, page_size=4, prefix_cache=True)
    with serve(engine, codec=codec, model_name="tiny") as s:
        yield s
    engine.shutdown(0.0)
