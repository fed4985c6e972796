"""The OpenAI request bodies `ling-serve` accepts (pydantic models) and its OpenAI-style errors.

Bodies are validated strictly (a string where a number belongs is an error, not converted);
fields OpenAI defines that the server does not use (`user`, `suffix`, ...) are ignored, and those
whose non-default values it cannot honour (`n` > 1, penalties, `logit_bias`) are refused by the
routes with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "server_error",
                    "service_unavailable"]


class APIError(Exception):
    """An error the server answers with `status` and the OpenAI body
    `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: ErrorType | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type: ErrorType = type or ("invalid_request_error" if status < 500 else
                                        "service_unavailable" if status == 503 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    """What completions and chat share: sampling, stopping, streaming and the vLLM extensions
    (`top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids`)."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False


class CompletionRequest(_Common):
    """`POST /v1/completions`. `prompt`: a text, a list of token ids, or a list of either (one choice
    each, `index` in order). `logprobs`: top-n (0..5) per token; `echo`: the prompt (text and, with
    `logprobs`, its tokens' log-probabilities) comes before the new text."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; fields other than `role` and `content` (e.g. `name`) reach the chat template as given."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(_Common):
    """`POST /v1/chat/completions`. `max_completion_tokens` (or the older `max_tokens`; neither: up to
    the server's max_len); `logprobs: true` with `top_logprobs` (0..5) alternatives per token."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
