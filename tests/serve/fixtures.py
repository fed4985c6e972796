"""Fixtures of the server tests (a pytest plugin their modules name in `pytest_plugins`): the tiny
model, a byte-level BPE tokenizer trained to its vocabulary with a chat template, and the main
test server."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ling_jax.config import LingConfig
from ling_jax.params import init_params
from serve.text import TextCodec
from tests.serve.harness import CHAT_TEMPLATE, SPECIAL, Served, make_engine, serve


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


@pytest.fixture(scope="module")
def server(model, codec) -> Iterator[Served]:
    """The main test server: tokenizer + chat template, max_len 256, pages of 4 tokens, prefix cache."""
    engine = make_engine(model, max_batch=4, max_len=256, page_size=4, prefix_cache=True,
                         prefix_cache_gb=0.01)
    with serve(engine, codec=codec, model_name="tiny") as s:
        yield s
    engine.shutdown(0.0)
