"""serve.text: chat templates rendered as transformers renders them, and a request's output as
text (incremental decoding, stop strings, what a stream may send)."""

from __future__ import annotations

import json
import shutil

import pytest

from serve.text import ChatTemplateError, OutputText, TextCodec
from tests.serve.harness import CHAT_TEMPLATE

pytest_plugins = ["tests.serve.fixtures"]  # the fixtures: model, tokenizer, servers


def stream(out: OutputText, ids: list[int]) -> list[str]:
    """What a stream sends after each token (take(final=False)), stopping at a stop string."""
    sent = []
    for t in ids:
        out.add(t)
        sent.append(out.take(final=False))
        if out.stopped:
            break
    return sent


def test_output_text_is_the_decoded_text(codec):
    ids = codec.encode("kalo mine héllo ✓ ruta")
    out = OutputText(codec, codec.encode("ling"))
    offsets = [out.add(t) for t in ids]
    out.finish()
    assert out.text == codec.decode(ids) and not out.stopped
    assert offsets == sorted(offsets) and offsets[0] == 0
    for t, start, end in zip(ids, offsets, [*offsets[1:], len(out.text)], strict=True):
        if "\ufffd" not in codec.token_text(t):  # a token inside a character adds its text with the next
            assert out.text[start:end] in (codec.token_text(t), "")


def test_stop_string_across_tokens_is_never_sent(codec):
    text = "kalo mine ruta"
    ids = codec.encode(text)
    assert len(ids) > 4  # "mine" spans tokens or starts mid-stream
    out = OutputText(codec, [], stops=["zzz", "mine"])
    sent = stream(out, ids)
    assert out.stopped and out.text == "kalo "
    assert "".join(sent) == "kalo " and all("m" not in s for s in sent)


def test_no_match_sends_everything_by_the_end(codec):
    ids = codec.encode("kalo mine ruta")
    out = OutputText(codec, [], stops=["ruta!"])
    sent = stream(out, ids)
    assert len("".join(sent)) == len(out.text) - 4  # the last 4 characters could begin "ruta!"
    out.finish()
    assert "".join(sent) + out.take(final=True) == "kalo mine ruta" and not out.stopped


def test_stop_tokens_add_no_text_and_partial_characters_end_as_decode_does(codec):
    ids = codec.encode("kalo")
    out = OutputText(codec, [], stop_ids=[1])
    for t in [*ids, 1]:
        out.add(t)
    assert out.text == "kalo"
    check = codec.encode("✓")
    assert len(check) > 1  # bytes of one character over several tokens
    out = OutputText(codec, [])
    out.add(check[0])
    assert out.text == ""
    out.finish()
    assert out.text == codec.decode(check[:1]) == "\ufffd"


def test_without_tokenizer_no_text():
    out = OutputText(None, [1, 2])
    assert [out.add(t) for t in (5, 6)] == [0, 0] and out.take(final=True) == ""


def test_render_chat_as_transformers(codec):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert codec.render_chat(msgs) == "<bos><|user|>hi<eos><|assistant|>yo<eos><|assistant|>"
    assert codec.render_chat(msgs, add_generation_prompt=False) == "<bos><|user|>hi<eos><|assistant|>yo<eos>"
    with pytest.raises(ChatTemplateError, match="unknown role: tool"):
        codec.render_chat([{"role": "tool", "content": "x"}])
    # whitespace control, loop controls and tojson as transformers sets them up
    t = TextCodec(codec.tokenizer, chat_template=(
        "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{{ m | tojson }};{% endfor %}{{ strftime_now('%Y') | length }}"), special_tokens={})
    assert t.render_chat([{"role": "user", "content": "é"}] * 3) == '{"role": "user", "content": "é"};' * 2 + "4"
    with pytest.raises(ChatTemplateError, match="no chat template"):
        TextCodec(codec.tokenizer).render_chat(msgs)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        TextCodec(codec.tokenizer, chat_template="{% for %}").render_chat(msgs)
    with pytest.raises(ChatTemplateError, match="failed"):
        TextCodec(codec.tokenizer, chat_template="{{ messages[5]['x'] }}").render_chat(msgs)


def test_from_files(tokenizer_dir, tmp_path):
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    shutil.copy(tokenizer_dir / "tokenizer.json", tok)
    assert TextCodec.from_files(tok).chat_template is None
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<bos>"}, "chat_template": [{"name": "tool_use", "template": "T"},
                                                             {"name": "default", "template": CHAT_TEMPLATE}]}))
    c = TextCodec.from_files(tok, [ckpt])  # found in the checkpoint; the named "default" template
    assert c.chat_template == CHAT_TEMPLATE and c.special_tokens == {"bos_token": "<bos>"}
    (tok.parent / "chat_template.jinja").write_text("J")  # beside the tokenizer: first, the .jinja file wins
    assert TextCodec.from_files(tok, [ckpt]).chat_template == "J"
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        TextCodec.from_files(tmp_path / "missing.json")
    (tok.parent / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not readable JSON"):
        TextCodec.from_files(tok)
