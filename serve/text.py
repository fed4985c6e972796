"""Text for `ling-serve`: a `tokenizer.json` with its chat template, and a request's output as text.

`TextCodec` encodes prompts, decodes outputs (special tokens skipped) and renders chat messages
with the checkpoint's chat template (`tokenizer_config.json`'s `chat_template`, or a
`chat_template.jinja` file beside it) the way Hugging Face transformers does: a sandboxed jinja2
environment with `trim_blocks` / `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter,
`raise_exception(message)` and `strftime_now(format)`, and the template variables `messages`,
`add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...).

`OutputText` turns a request's new tokens into text as they arrive: incremental detokenization
(a token that ends inside a UTF-8 character adds its text with the next one), stop strings (the
text ends before the first match), and how much of the text a stream may send already (the
characters that could still begin a stop string are held back).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: no template, a template error, or the template's own
    `raise_exception`."""


def _token_content(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class TextCodec:
    """A `tokenizers.Tokenizer` with the chat template and special tokens of its tokenizer_config.json.

    `encode(text)` adds the tokenizer's own special tokens (its post-processor's, e.g. a bos) as a
    completion prompt does; `encode(text, special=False)` does not (a rendered chat template
    carries its own). `decode` skips special tokens. `token_text(id)` is one token decoded alone
    (special tokens kept): the token strings of logprobs.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._template: Any = None

    @classmethod
    def from_files(cls, tokenizer_json: str | Path, config_dirs: Iterable[str | Path] = ()) -> TextCodec:
        """The tokenizer at `tokenizer_json`; its chat template and special tokens from the first of
        (the tokenizer's directory, *config_dirs) holding a tokenizer_config.json or a
        chat_template.jinja. ValueError naming the file that cannot be read."""
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None
        template, special = None, {}
        for d in [path.parent, *map(Path, config_dirs)]:
            cfg_path, jinja_path = d / "tokenizer_config.json", d / "chat_template.jinja"
            if not (cfg_path.is_file() or jinja_path.is_file()):
                continue
            if cfg_path.is_file():
                try:
                    cfg = json.loads(cfg_path.read_text())
                except (OSError, ValueError) as e:
                    raise ValueError(f"{cfg_path}: not readable JSON ({e})") from None
                if not isinstance(cfg, dict):
                    raise ValueError(f"{cfg_path}: expected a JSON object")
                template = cfg.get("chat_template")
                if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
                    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                    template = named.get("default")
                special = {k: v for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                           if (v := _token_content(cfg.get(k))) is not None}
            if jinja_path.is_file():
                template = jinja_path.read_text()
            if template is not None and not isinstance(template, str):
                raise ValueError(f"{cfg_path}: chat_template must be a string")
            break
        return cls(tokenizer, chat_template=template, special_tokens=special)

    # --- tokens ------------------------------------------------------------------------------
    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode_stream(self, prefix: Sequence[int]) -> Any:
        """A `tokenizers.decoders.DecodeStream` primed with `prefix` (its text is not returned again)."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(prefix), skip_special_tokens=True)

    # --- chat --------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (dicts with "role" and string "content"); ChatTemplateError
        without a template or where rendering fails."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (no chat_template in a tokenizer_config.json "
                                    "or chat_template.jinja beside the tokenizer or in the checkpoint); use "
                                    "/v1/completions")
        import jinja2
        import jinja2.sandbox

        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None


class OutputText:
    """One request's new tokens as text (`codec` None: no text, every token adds "").

    `add(token_id)` takes the next token and returns where its text starts in `text` (its
    text_offset); a token in `stop_ids` (the engine stops after it) adds no text. Once a stop
    string matches, `text` ends before it and `stopped` is set; later tokens must not be added.
    `finish()` adds the text of trailing tokens that end inside a character. `take(final)` returns
    the text not yet taken that a stream may send: all of it when `final`, else all but the last
    (longest stop string - 1) characters, which could begin a match.
    """

    def __init__(self, codec: TextCodec | None, prompt_ids: Sequence[int], stops: Sequence[str] = (),
                 stop_ids: Iterable[int] = ()):
        self.codec = codec
        self.stops = [s for s in stops if s]
        self.stop_ids = frozenset(stop_ids)
        self.text = ""
        self.stopped = False
        self._stream = None if codec is None else codec.decode_stream(prompt_ids)
        self._hold = max(map(len, self.stops), default=1) - 1
        self._taken = 0
        self._pending: list[int] = []  # tokens since the last text: inside a character so far

    def add(self, token_id: int) -> int:
        if self.stopped:
            raise RuntimeError("OutputText.add after a stop string matched")
        start = len(self.text)
        if self._stream is None or token_id in self.stop_ids:
            return start
        piece = self._stream.step(self.codec.tokenizer, token_id)
        self._pending = [*self._pending, token_id] if piece is None else []
        self._append(piece or "")
        return min(start, len(self.text))

    def finish(self) -> None:
        if self._pending and not self.stopped:
            self._append(self.codec.decode(self._pending))
        self._pending = []

    def _append(self, piece: str) -> None:
        if not piece:
            return
        start = len(self.text)
        self.text += piece
        window = max(0, start - self._hold)
        hits = [i for s in self.stops if (i := self.text.find(s, window)) >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    def take(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else max(self._taken, len(self.text) - self._hold)
        out, self._taken = self.text[self._taken:end], end
        return out
