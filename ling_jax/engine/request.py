"""What a caller hands the engine and gets back: sampling parameters, request handles, token outputs.

Host-side only (no JAX). `Engine.submit(prompt_ids, sampling)` returns a `RequestHandle`; the
engine's loop thread pushes `TokenOutput`s into it and finishes it once. The handle is read
either blocking (`for out in handle`) or from asyncio (`async for out in handle`, as the HTTP
server does); both end after the last token, with `handle.finish_reason` set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Literal

MAX_LOGPROBS = 5  # top-n alternatives a request may ask for, per token (OpenAI's completions limit)
FinishReason = Literal["stop", "length", "cancelled", "error"]


class QueueFull(RuntimeError):
    """The engine's waiting queue is full: the request was not admitted (HTTP 503)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `max_tokens`: new tokens at most (0 only with `prompt_logprobs`: score the prompt, generate
    nothing). Greedy when `temperature == 0`; else top-k (0 = off) and top-p filtered sampling from
    the request's own key, made from `seed` (None: a seed drawn at submission) and its prompt, so a
    request's tokens do not depend on what else is in the batch. It stops after a token of
    `stop_token_ids` or, unless `ignore_eos`, of the config's eos ids (the stop token is included).
    `logprobs`: report each new token's log-probability and the `logprobs` most likely alternatives
    (0..MAX_LOGPROBS); `prompt_logprobs`: the same for every prompt token but the first.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def check(self, vocab_size: int) -> None:
        """ValueError naming the first field whose value is out of range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 0")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens=0 generates nothing: it needs prompt_logprobs (echo scoring)")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed={self.seed!r} must be a 64-bit integer or None")
        if not all(_is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={list(self.stop_token_ids)!r} must be token ids in [0, {vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be true or false")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name}={n!r} must be an integer in [0, {MAX_LOGPROBS}] or None")


@dataclasses.dataclass(frozen=True)
class TokenOutput:
    """One token of a request: its id, and where asked for (`SamplingParams.logprobs` /
    `prompt_logprobs`) its log-probability under the model (float32, of the unfiltered,
    untempered distribution) and the `n` most likely tokens as (id, log-probability) pairs."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


_ids = itertools.count()
_DONE = object()


class RequestHandle:
    """One submitted request: iterate it for its new tokens (blocking or async).

    Attributes the engine sets: `prompt_logprobs` (a `TokenOutput` per prompt token, the first
    without a log-probability; set before the first new token arrives, or before the end when
    `max_tokens == 0`), `cached_tokens` (prompt tokens served from the prefix cache),
    `finish_reason` (once finished), `error` (the message where it is "error"), and the times
    `submitted`, `first_token_at` and `finished_at` (`time.perf_counter()`).
    """

    def __init__(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str | None = None):
        self.id = request_id or f"req-{next(_ids)}"
        self.prompt_ids = tuple(prompt_ids)
        self.sampling = sampling
        self.prompt_logprobs: list[TokenOutput] | None = None
        self.cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.tokens: list[int] = []  # every new token so far
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._async: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # --- the engine's side -------------------------------------------------------------------
    def push(self, out: TokenOutput) -> None:
        """A new token (engine thread)."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(out.token_id)
        self._deliver(out)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """The request is over (engine thread); later calls are ignored."""
        with self._lock:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error, self.finished_at = reason, error, time.perf_counter()
        self._deliver(_DONE)
        self._done.set()

    def _deliver(self, item: object) -> None:
        with self._lock:
            self._queue.put(item)
            for loop, q in self._async:
                loop.call_soon_threadsafe(q.put_nowait, item)

    # --- the caller's side -------------------------------------------------------------------
    def __iter__(self) -> Iterator[TokenOutput]:
        """The new tokens, blocking until each arrives; ends when the request finishes."""
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            yield item

    async def __aiter__(self) -> AsyncIterator[TokenOutput]:
        """The new tokens from asyncio (without blocking the event loop). Use one kind of reading per
        handle: tokens read here are not also returned by `__iter__`'s queue order."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            backlog = []
            while True:  # whatever arrived before this reader registered
                try:
                    backlog.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._async.append((asyncio.get_running_loop(), q))
        for item in backlog:
            q.put_nowait(item)
        while True:
            item = await q.get()
            if item is _DONE:
                return
            yield item

    def result(self, timeout: float | None = None) -> list[int]:
        """Waits for the request to finish and returns all of its new tokens (any number of times, from
        any thread; it reads nothing off the iterators' queues)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.id}: not finished within {timeout} s")
        return list(self.tokens)
