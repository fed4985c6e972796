"""ling-serve's HTTP API against the engine, driven by the `openai`
client and raw HTTP: completions, chat, streaming, logprobs / echo (lm-evaluation-harness's
scoring request), return_token_ids, stop strings, errors, the API key, disconnects, draining,
metrics."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import jax
import numpy as np
import openai
import pytest

import ling_jax
from serve.server import drain
from tests.serve.harness import CHAT_TEMPLATE, make_engine, serve

pytest_plugins = ["tests.serve.fixtures"]  # the fixtures: model, tokenizer, servers

PROMPT = [5, 17, 42, 99, 7]


def want(model, prompt, n, **kw) -> list[int]:
    cfg, params = model  # the scanned decode step, as the double's: one compilation for both
    return ling_jax.generate(cfg, params, [prompt], max_new_tokens=n, unroll_layers=False, **kw)[0]


def logprobs_of(model, ids) -> np.ndarray:
    """[len(ids) - 1] log-probabilities of ids[1:] under the model (an independent forward pass; padded
    on the right to 32 tokens, which leaves real tokens' logits as they are, to compile once)."""
    cfg, params = model
    padded = np.zeros((1, 32), np.int32)
    padded[0, : len(ids)] = ids
    logits = ling_jax.forward(cfg, params, padded)[0, : len(ids)]
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return lp[np.arange(len(ids) - 1), ids[1:]]


def post(url: str, path: str, body: Any, **kw) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(url + path, content=content, headers=headers, timeout=kw.pop("timeout", 120), **kw)


def sse(url: str, path: str, body: dict) -> list[dict]:
    """The data events of a streamed request (asserted to end with [DONE])."""
    events = []
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def streamed_ids(events: list[dict], index: int = 0) -> list[int]:
    """The token_ids of choice `index` over a stream's chunks, in order."""
    return [t for e in events for c in e["choices"] if c["index"] == index for t in c["token_ids"]]


def assert_error(r: httpx.Response, status: int, param: str | None = "", kind: str = "invalid_request_error") -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] == kind
    if param != "":
        assert err["param"] == param, err
    return err["message"]


# --- completions ------------------------------------------------------------------------------
def test_completion_openai_client(server, model, codec):
    out = want(model, PROMPT, 12)
    r = server.openai().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.text == codec.decode(out)
    assert c.finish_reason == ("stop" if out[-1] == 1 else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, len(out), 5 + len(out))
    # a text prompt is encoded with the tokenizer
    text = codec.decode(PROMPT)
    r2 = server.openai().completions.create(model="tiny", prompt=text, max_tokens=12, temperature=0)
    assert r2.choices[0].text == codec.decode(want(model, codec.encode(text), 12))


def test_completion_stream_openai_client(server, codec, model):
    out = want(model, PROMPT, 12, stop_tokens=())
    stream = server.openai().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == codec.decode(out)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


def test_return_token_ids_streamed_and_not(server, model):
    out = want(model, PROMPT, 10, stop_tokens=())
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = post(server.url, "/v1/completions", body).json()
    assert r["choices"][0]["token_ids"] == out and r["choices"][0]["prompt_token_ids"] == PROMPT
    events = sse(server.url, "/v1/completions", body | {"stream": True})
    assert all("token_ids" in e["choices"][0] for e in events)
    assert streamed_ids(events) == out
    assert events[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    # chat: the same in its format
    body = {"messages": [{"role": "user", "content": "kalo mi"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = post(server.url, "/v1/chat/completions", body).json()
    assert r["choices"][0]["token_ids"] == want(model, r["prompt_token_ids"], 6, stop_tokens=())
    events = sse(server.url, "/v1/chat/completions", body | {"stream": True})
    assert events[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert streamed_ids(events) == r["choices"][0]["token_ids"]


def test_batch_of_prompts(server, model, codec):
    prompts = [PROMPT, [9, 8, 7], codec.decode([60, 61])]
    body = {"prompt": prompts[:2], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = post(server.url, "/v1/completions", body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for c, p in zip(r["choices"], prompts, strict=False):
        assert c["token_ids"] == want(model, p, 5, stop_tokens=())
    assert r["usage"]["prompt_tokens"] == 8 and r["usage"]["completion_tokens"] == 10
    events = sse(server.url, "/v1/completions", body | {"stream": True})
    for i in range(2):
        assert streamed_ids(events, i) == r["choices"][i]["token_ids"]
    r = post(server.url, "/v1/completions", body | {"prompt": [prompts[2], prompts[2]]}).json()
    assert r["choices"][0]["text"] == r["choices"][1]["text"] == codec.decode(r["choices"][0]["token_ids"])


def test_logprobs_and_echo(server, model, codec):
    r = post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                             "ignore_eos": True, "return_token_ids": True}).json()
    c = r["choices"][0]
    lp, out = c["logprobs"], c["token_ids"]
    np.testing.assert_allclose(lp["token_logprobs"], logprobs_of(model, PROMPT + out)[len(PROMPT) - 1:], atol=1e-4)
    assert lp["tokens"] == [codec.token_text(t) for t in out]
    for tok, top, value in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert 1 <= len(top) <= 2 and top[tok] == value == max(top.values())  # greedy: the chosen token is the top one
    offs = lp["text_offset"]
    assert offs[0] == 0 and offs == sorted(offs) and offs[-1] <= len(c["text"])
    # echo: the prompt's text and log-probabilities first
    r = post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1,
                                             "echo": True, "ignore_eos": True, "return_token_ids": True}).json()
    c = r["choices"][0]
    assert c["text"] == codec.decode(PROMPT) + codec.decode(c["token_ids"])
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], logprobs_of(model, PROMPT + c["token_ids"]), atol=1e-4)
    assert lp["text_offset"][len(PROMPT)] == len(codec.decode(PROMPT))
    # echo streamed: the first chunk carries the prompt
    events = sse(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True,
                                                 "ignore_eos": True, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events) == c["text"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(server, model, max_tokens):
    """lm-evaluation-harness local-completions' scoring request (its _create_payload for generate=False
    sends max_tokens 1; 0 scores the prompt only), read as its parse_logprobs reads it."""
    context, continuation = [5, 17, 42], [99, 7, 311]
    body = {"model": "tiny", "prompt": [context + continuation], "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = post(server.url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == 6 + max_tokens
    ctxlen = len(context)
    stop = None if max_tokens == 0 else -1  # parse_logprobs drops the generated token
    score = sum(lp["token_logprobs"][ctxlen:stop] if stop else lp["token_logprobs"][ctxlen:])
    expect = logprobs_of(model, context + continuation)[ctxlen - 1:].sum()
    np.testing.assert_allclose(score, expect, rtol=1e-5, atol=1e-4)
    tops = lp["top_logprobs"][ctxlen:6]
    greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:6], tops, strict=True))
    cfg, params = model
    padded = np.zeros((1, 32), np.int32)
    padded[0, :6] = context + continuation
    argmax = np.asarray(ling_jax.forward(cfg, params, padded)[0]).argmax(-1)
    assert greedy == all(argmax[i - 1] == (context + continuation)[i] for i in range(ctxlen, 6))


def test_stop_strings(server, model, codec):
    out = want(model, PROMPT, 16, stop_tokens=())
    full = codec.decode(out)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    base = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for body in (base | {"stop": stop}, base | {"stop": ["zzzz-never", stop]}):
        r = post(server.url, "/v1/completions", body).json()
        c = r["choices"][0]
        assert c["text"] == full[: full.index(stop)] and c["finish_reason"] == "stop"
        assert c["token_ids"] == out[: len(c["token_ids"])] and len(c["token_ids"]) < 16
        assert r["usage"]["completion_tokens"] == len(c["token_ids"])
        events = sse(server.url, "/v1/completions", body | {"stream": True})
        assert "".join(e["choices"][0]["text"] for e in events) == c["text"]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    server.wait_idle(5.0)  # the engine's request was cancelled at the match


def test_stop_token_ids(server, model, codec):
    out = want(model, PROMPT, 12, stop_tokens=())
    r = post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True, "stop_token_ids": [out[4]],
                                             "return_token_ids": True}).json()
    c = r["choices"][0]
    k = out.index(out[4])
    assert c["token_ids"] == out[: k + 1] and c["finish_reason"] == "stop"
    assert c["text"] == codec.decode(out[:k])  # the stop token's text is left out


def test_sampling_seed(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 7,
            "ignore_eos": True, "return_token_ids": True}
    a, b = (post(server.url, "/v1/completions", body).json()["choices"][0]["token_ids"] for _ in range(2))
    c = post(server.url, "/v1/completions", body | {"seed": 8}).json()["choices"][0]["token_ids"]
    assert a == b != c


# --- chat -------------------------------------------------------------------------------------
def test_chat_openai_client(server, model, codec):
    messages = [{"role": "system", "content": "ling"}, {"role": "user", "content": "kalo mi ne"}]
    prompt = codec.encode("<bos><|system|>ling<eos><|user|>kalo mi ne<eos><|assistant|>", special=False)
    out = want(model, prompt, 8)
    r = server.openai().chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8,
                                                temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == codec.decode(out)
    assert r.usage.prompt_tokens == len(prompt)
    stream = server.openai().chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                     stream=True)
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == codec.decode(out)
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # content as a list of text parts renders the same
    parts = [{"role": "system", "content": [{"type": "text", "text": "li"}, {"type": "text", "text": "ng"}]},
             messages[1]]
    r2 = post(server.url, "/v1/chat/completions", {"messages": parts, "max_tokens": 8, "temperature": 0}).json()
    assert r2["choices"][0]["message"]["content"] == codec.decode(out)


def test_chat_logprobs(server, model):
    r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"}], "max_tokens": 4,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 3,
                                                  "ignore_eos": True, "return_token_ids": True}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    lps = logprobs_of(model, r["prompt_token_ids"] + r["choices"][0]["token_ids"])[-4:]
    for entry, value in zip(content, lps, strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 3
        assert entry["bytes"] == list(entry["token"].encode())
        np.testing.assert_allclose(entry["logprob"], value, atol=1e-4)
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy
    r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"}], "max_tokens": 2,
                                                  "temperature": 0}).json()
    assert r["choices"][0]["logprobs"] is None


# --- errors -------------------------------------------------------------------------------------
BAD = [
    ("/v1/completions", {"prompt": [1, 2, 512]}, "prompt", "outside"),
    ("/v1/completions", {"prompt": [1, -3]}, "prompt", "outside"),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 255}, "prompt", "max_len"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "ten"}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": "hot"}, "temperature", "number"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": -1}, "temperature", "temperature=-1"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 0}, "top_p", "top_p=0"),
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": [600]}, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2], "n": 2}, "n", "n=2"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 6}, "logprobs", "logprobs=6"),
    ("/v1/completions", {"prompt": [1, 2], "stop": [""]}, "stop", "empty"),
    ("/v1/completions", {"prompt": [1, 2], "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ("/v1/completions", {"prompt": [1, 2], "stream": "yes"}, "stream", "boolean"),
    ("/v1/completions", {"prompt": [True]}, "prompt", "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt"),
    ("/v1/completions", "{\"prompt\": [1, 2", None, "not valid JSON"),
    ("/v1/completions", "[1, 2]", None, "JSON object"),
    ("/v1/chat/completions", {"messages": []}, "messages", "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages", "unknown role: tool"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 9},
     "top_logprobs", "top_logprobs=9"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens", "max_tokens=0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, "messages",
     "max_len"),
]


@pytest.mark.parametrize("path, body, param, msg", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_400_and_serving_goes_on(server, path, body, param, msg):
    r = post(server.url, path, body)
    assert msg in assert_error(r, 400, param)
    ok = post(server.url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    server.wait_idle()


def test_unknown_model_and_route(server):
    assert "does not exist" in assert_error(post(server.url, "/v1/completions", {"model": "gpt", "prompt": [1]}),
                                            404, "model")
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)


def test_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="outside"):
        server.openai().completions.create(model="tiny", prompt=[1, 600], max_tokens=2)


def test_without_tokenizer(model):
    engine = make_engine(model, max_batch=2, max_len=128)
    with serve(engine, model_name="ids") as s:
        r = post(s.url, "/v1/completions", {"prompt": [[4, 5, 6]], "max_tokens": 4, "temperature": 0, "logprobs": 1,
                                            "ignore_eos": True}).json()
        c = r["choices"][0]
        assert c["text"] == "" and c["token_ids"] == want(model, [4, 5, 6], 4, stop_tokens=())
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        assert "need a tokenizer" in assert_error(post(s.url, "/v1/completions", {"prompt": "hello"}), 400, "prompt")
        assert "tokenizer" in assert_error(post(s.url, "/v1/completions", {"prompt": [1], "stop": "x"}), 400, "stop")
        msgs = {"messages": [{"role": "user", "content": "hi"}]}
        assert "tokenizer" in assert_error(post(s.url, "/v1/chat/completions", msgs), 400, "messages")
    engine.shutdown(0.0)


def test_chat_without_template(model, codec):
    from serve.text import TextCodec

    engine = make_engine(model, max_batch=1, max_len=128)
    with serve(engine, codec=TextCodec(codec.tokenizer)) as s:
        r = post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert "no chat template" in assert_error(r, 400, "messages")
        assert post(s.url, "/v1/completions", {"prompt": "kalo", "max_tokens": 2}).status_code == 200
    engine.shutdown(0.0)
    assert CHAT_TEMPLATE  # the main server's template is the one with a template


def test_api_key(server, model):
    with serve(server.engine, codec=None, model_name="k", api_key="s3cret") as s:
        assert httpx.get(s.url + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for path in ("/v1/models", "/metrics"):
                r = httpx.get(s.url + path, headers=headers)
                assert_error(r, 401, None, "authentication_error")
            assert_error(post(s.url, "/v1/completions", {"prompt": [1]}, headers=headers), 401, None,
                         "authentication_error")
        ok = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "k"
        r = s.openai(api_key="s3cret").completions.create(model="k", prompt=[1, 2], max_tokens=2)
        assert r.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            s.openai(api_key="nope").completions.create(model="k", prompt=[1, 2], max_tokens=2)


def test_models_health_metrics_cached_tokens(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = httpx.get(server.url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == 256
    long = list(range(10, 24))  # 3 whole pages of 4 tokens before its last token
    body = {"prompt": long, "max_tokens": 2, "temperature": 0}
    first = post(server.url, "/v1/completions", body).json()["usage"]
    second = post(server.url, "/v1/completions", body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 12
    text = httpx.get(server.url + "/metrics").text
    for name in ("ling_requests_total{finish_reason=", "ling_time_to_first_token_seconds_bucket",
                 "ling_time_per_output_token_seconds_bucket", "ling_e2e_request_latency_seconds_count",
                 "ling_engine_running ", "ling_engine_waiting ", "ling_engine_pages_used ",
                 "ling_engine_pages_total 256",
                 "ling_engine_prompt_tokens_total ", "ling_engine_generation_tokens_total ",
                 "ling_engine_prefix_hits ", "ling_engine_prefix_misses "):
        assert name in text, name
    count = float(text.split("ling_e2e_request_latency_seconds_count ")[1].split()[0])
    post(server.url, "/v1/completions", body)
    text = httpx.get(server.url + "/metrics").text
    assert float(text.split("ling_e2e_request_latency_seconds_count ")[1].split()[0]) == count + 1


# --- disconnects, a full queue, draining ----------------------------------------------------------
@pytest.fixture
def slow(model, codec):
    """A server whose engine takes 0.3 s per token (compiled before serving), 1 slot."""
    engine = make_engine(model, token_delay=0.3, max_batch=1, max_len=256, max_waiting=1, prefill_chunk=16,
                         warmup=True)
    cancelled = []
    cancel = engine.cancel

    def spy(handle):
        cancelled.append(handle)
        cancel(handle)

    engine.cancel = spy
    with serve(engine, codec=codec) as s:
        s.cancelled = cancelled
        yield s
    engine.shutdown(0.0)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_disconnect_mid_stream_frees_the_slot(slow, path, body):
    body = body | {"max_tokens": 16, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as client, client.stream("POST", slow.url + path, json=body) as r:
        for line in r.iter_lines():  # until the first new text
            c = json.loads(line[6:])["choices"][0] if line.startswith("data: ") else {}
            if c.get("text") or c.get("delta", {}).get("content"):
                break
        assert slow.engine.stats()["running"] == 1
    t0 = time.monotonic()
    slow.wait_idle(timeout=3.0)  # the 16 tokens would take 4.8 s
    assert time.monotonic() - t0 < 3.0
    (handle,) = slow.cancelled
    assert handle.finish_reason == "cancelled" and len(handle.tokens) < 16
    assert post(slow.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}).status_code == 200


def test_disconnect_while_waiting_for_a_plain_response(slow):
    def request():
        with pytest.raises(httpx.ReadTimeout):
            post(slow.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True}, timeout=1.0)

    request()
    slow.wait_idle(timeout=3.0)
    assert slow.cancelled and slow.cancelled[0].finish_reason == "cancelled"


def test_full_queue_is_503(slow):
    streams = []

    def hold():  # occupies the slot, then the queue
        streams.append(sse(slow.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True,
                                                          "stream": True}))

    a = threading.Thread(target=hold)
    a.start()
    while slow.engine.stats()["running"] < 1:
        time.sleep(0.01)
    b = threading.Thread(target=hold)
    b.start()
    while slow.engine.stats()["waiting"] < 1:
        time.sleep(0.01)
    r = post(slow.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert "busy" in assert_error(r, 503, None, "service_unavailable")
    a.join()
    b.join()
    assert [e[-1]["choices"][0]["finish_reason"] for e in streams] == ["length", "length"]


def test_drain_finishes_requests_in_flight_and_refuses_new_ones(slow):
    events = []
    t = threading.Thread(target=lambda: events.extend(sse(slow.url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True, "return_token_ids": True})))
    t.start()
    while slow.engine.stats()["running"] < 1:
        time.sleep(0.01)
    d = threading.Thread(target=drain, args=(slow.state, slow.engine, 30.0))
    d.start()
    while not slow.state.draining:
        time.sleep(0.01)
    assert_error(post(slow.url, "/v1/completions", {"prompt": [1], "max_tokens": 1}), 503, None,
                 "service_unavailable")
    assert httpx.get(slow.url + "/health").status_code == 503
    assert httpx.get(slow.url + "/metrics").status_code == 200
    d.join(timeout=20)
    t.join(timeout=20)
    assert not d.is_alive()
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert streamed_ids(events) and slow.state.inflight == 0


def test_drain_grace_cancels_the_rest(slow):
    events = []
    t = threading.Thread(target=lambda: events.extend(sse(slow.url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True})))
    t.start()
    while slow.engine.stats()["running"] < 1:
        time.sleep(0.01)
    drain(slow.state, slow.engine, 0.3)
    t.join(timeout=10)
    assert events[-1]["error"]["type"] == "service_unavailable"  # the stream's last event: the cancel


# --- speculative decoding ----------------------------------------------------------------------------
@pytest.mark.heavy  # (default suite kept well under 20 min on 2 cores)
def test_speculative_engine_serves_generates_tokens(model, codec):
    """A server on the engine with 2 MTP drafts per call (what `ling-serve --speculative-tokens 2`
    builds): greedy completions, whole and streamed, give `generate`'s tokens, a seeded sampled one
    `generate(..., speculative_tokens=2, seed=...)`'s, the log-probabilities are the model's, and
    /metrics exports the speculation counters."""
    engine = make_engine(model, max_batch=2, max_len=128, page_size=4, prefill_chunk=16, speculative_tokens=2)
    try:
        with serve(engine, codec=codec, model_name="tiny") as s:
            body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            out = want(model, PROMPT, 10, stop_tokens=())
            assert post(s.url, "/v1/completions", body).json()["choices"][0]["token_ids"] == out
            assert streamed_ids(sse(s.url, "/v1/completions", body | {"stream": True})) == out
            sampled = post(s.url, "/v1/completions", body | {"temperature": 1.0, "seed": 5}).json()
            assert sampled["choices"][0]["token_ids"] == want(model, PROMPT, 10, stop_tokens=(), temperature=1.0,
                                                              seed=5, speculative_tokens=2)
            c = post(s.url, "/v1/completions", body | {"logprobs": 2}).json()["choices"][0]
            assert c["token_ids"] == out
            np.testing.assert_allclose(c["logprobs"]["token_logprobs"],
                                       logprobs_of(model, PROMPT + out)[len(PROMPT) - 1:], atol=1e-4)
            text = httpx.get(s.url + "/metrics").text
    finally:
        engine.shutdown(0.0)
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("ling_engine_")}
    assert values["ling_engine_spec_verify_calls"] >= 4 * 9 / 3
    assert values["ling_engine_spec_draft_tokens"] >= 2 * values["ling_engine_spec_verify_calls"]
    assert 0 <= values["ling_engine_spec_accepted_tokens"] <= values["ling_engine_spec_draft_tokens"]
    assert values["ling_engine_decode_steps_total"] == values["ling_engine_spec_verify_calls"]
    assert 0 < values["ling_engine_decode_row_steps_total"] <= values["ling_engine_decode_slot_steps_total"]
