"""A test double of `ling_jax.engine.Engine`: the same surface, real model tokens, no batching.

Each admitted request runs alone in one of `max_batch` worker threads: `ling_jax.generate` makes
its tokens (the scanned decode step: faster to compile), `ling_jax.forward` over prompt + output
its log-probabilities where asked, and the worker then hands the tokens to the handle one at a
time, `token_delay` seconds apart (so tests can act mid-stream), stopping early when cancelled.
The prefix cache is a set of page-aligned prompt prefixes: `cached_tokens` is the longest whole
number of pages of a prompt seen before (at most all but its last token).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ling_jax
from ling_jax.engine.request import QueueFull, RequestHandle, SamplingParams, TokenOutput


def _bucket(n: int) -> int:
    return max(32, 1 << (n - 1).bit_length())


class FakeEngine:
    def __init__(self, config: Any, params: Any, *, max_batch: int = 8, max_len: int = 2048, page_size: int = 64,
                 mesh: Any = None, speculative_tokens: int = 0, prefix_cache: bool = False,
                 prefix_cache_gb: float = 1.0, max_waiting: int = 256, token_delay: float = 0.0):
        self.config, self.params = config, params
        self.max_batch, self.max_len, self.page_size, self.max_waiting = max_batch, max_len, page_size, max_waiting
        self.prefix_cache, self.token_delay = prefix_cache, token_delay
        self._cond = threading.Condition()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: set[RequestHandle] = set()
        self._prefixes: set[tuple[int, ...]] = set()
        self._totals = collections.Counter()
        self._workers: list[threading.Thread] = []
        self._closed = self._stopping = False

    # --- the surface -----------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> RequestHandle:
        vocab = self.config.vocab_size
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the prompt has token id {bad[0]!r} outside [0, vocab_size={vocab})")
        sampling.check(vocab)
        if len(prompt) + sampling.max_tokens > self.max_len:
            raise ValueError(f"the prompt's {len(prompt)} tokens + max_tokens={sampling.max_tokens} exceed "
                             f"max_len={self.max_len}")
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=random.getrandbits(63))
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_waiting={self.max_waiting})")
            handle = RequestHandle(prompt, sampling)
            self._waiting.append(handle)
            self._cond.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            if handle in self._waiting:
                self._waiting.remove(handle)
        handle.finish("cancelled")

    def stats(self) -> dict[str, float | int]:
        with self._cond:
            pages = sum(math.ceil((len(h.prompt_ids) + len(h.tokens)) / self.page_size) for h in self._running)
            out = {"running": len(self._running), "waiting": len(self._waiting), "pages_used": pages,
                   "pages_total": self.max_batch * math.ceil(self.max_len / self.page_size),
                   "prompt_tokens_total": self._totals["prompt"], "generation_tokens_total": self._totals["new"],
                   "requests_total": self._totals["requests"]}
            if self.prefix_cache:
                out |= {"prefix_hits": self._totals["hits"], "prefix_misses": self._totals["misses"]}
        return out

    def start(self) -> None:
        for i in range(self.max_batch):
            t = threading.Thread(target=self._work, name=f"fake-engine-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def shutdown(self, grace_s: float) -> None:
        with self._cond:
            self._closed = True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._cond:
                if not self._running and not self._waiting:
                    break
            time.sleep(0.01)
        with self._cond:
            left = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._stopping = True
            self._cond.notify_all()
        for h in left:
            h.finish("cancelled")
        for t in self._workers:
            t.join()

    # --- the workers -----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                handle = self._waiting.popleft()
                self._running.add(handle)
            try:
                self._run(handle)
            except Exception as e:  # a worker that failed a request serves the next one
                handle.finish("error", f"{type(e).__name__}: {e}")
            finally:
                with self._cond:
                    self._running.discard(handle)
                    self._totals["requests"] += 1

    def _logprobs(self, ids: list[int], n: int) -> list[TokenOutput]:
        """TokenOutputs of ids[1:] (each under the logits of the position before), top-n alternatives."""
        padded = np.zeros((1, _bucket(len(ids))), np.int32)
        padded[0, : len(ids)] = ids
        logits = ling_jax.forward(self.config, self.params, jnp.asarray(padded))
        lp = np.asarray(jax.nn.log_softmax(logits[0, : len(ids) - 1].astype(jnp.float32), axis=-1))
        outs = []
        for i, t in enumerate(ids[1:]):
            top = np.argsort(-lp[i], kind="stable")[:n]
            outs.append(TokenOutput(t, float(lp[i, t]), tuple((int(a), float(lp[i, a])) for a in top)))
        return outs

    def _run(self, h: RequestHandle) -> None:
        sp, prompt = h.sampling, list(h.prompt_ids)
        with self._cond:
            self._totals["prompt"] += len(prompt)
            if self.prefix_cache:
                pages = [tuple(prompt[:k]) for k in range(self.page_size, len(prompt), self.page_size)]
                h.cached_tokens = max((len(p) for p in pages if p in self._prefixes), default=0)
                self._totals["hits" if h.cached_tokens else "misses"] += 1
                self._prefixes.update(pages)
        stop = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else tuple(self.config.eos_token_id))
        new: list[int] = []
        if sp.max_tokens > 0:
            (new,) = ling_jax.generate(self.config, self.params, [prompt], max_new_tokens=sp.max_tokens,
                                       temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=sp.seed,
                                       stop_tokens=stop, unroll_layers=False)
        n = max(sp.logprobs or 0, sp.prompt_logprobs or 0)
        outs = self._logprobs(prompt + new, n) if sp.logprobs is not None or sp.prompt_logprobs is not None else []
        if sp.prompt_logprobs is not None:
            n_top = sp.prompt_logprobs
            h.prompt_logprobs = [TokenOutput(prompt[0])] + [
                dataclasses.replace(o, top_logprobs=o.top_logprobs[:n_top]) for o in outs[: len(prompt) - 1]]
        for i, t in enumerate(new):
            time.sleep(self.token_delay)
            if h.finished:
                return
            if sp.logprobs is not None:
                o = outs[len(prompt) - 1 + i]
                h.push(dataclasses.replace(o, top_logprobs=o.top_logprobs[: sp.logprobs]))
            else:
                h.push(TokenOutput(t))
            with self._cond:
                self._totals["new"] += 1
        h.finish("stop" if new and new[-1] in stop else "length")
