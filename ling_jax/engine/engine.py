"""`Engine`: continuous batching over a paged latent cache, driven by one loop thread.

A fixed number of slots (`max_batch`) share a compiled decode step. Requests wait in a queue and
are admitted into free slots between steps; a slot's prompt is prefilled in chunks (at most
`prefill_chunk` tokens per chunk, the chunks of up to `prefill_rows` prompts in one call, and
`token_budget` prompt tokens per loop iteration, so a long prompt never stalls the running requests
for its whole prefill); then the slot decodes with the others, `decode_steps` steps per host round
trip while no request waits to start (one while any does, or where a row nears `max_len`). Decode
calls are pipelined: the next call is dispatched (its input tokens the previous call's outputs, on the
device) before the host reads the previous call's tokens, and a prompt's first token, which its last
prefill chunk leaves on the device, is read only after the decode call that takes it there is
dispatched (except where the call returns prompt log-probabilities, a request asks for no new token,
or with speculation) and, where a decode call was in flight when its prefill call was dispatched,
only with the tokens of the call after that one: the host then waits only on calls with a prefill and
a decode call queued behind them; so delivering tokens, admitting and building page tables overlap the
device's work (a decode call holds nothing that the host must read
back while it runs: static step counts, greedy or sampled by the host's choice, the prefix cache's
output snapshots taken by scatters that drop what is not taken; `device.decode_steps`);
a request that ends within a call wastes the rest of it and at most the call after it (the steps past
its `max_tokens` write the unshared rest of its last page or page 0: nothing reads them). A decode
call runs the first slots up to the smallest of `decode_buckets` (default: `max_batch` alone) that
holds every decoding slot, so at low concurrency a step costs what that batch costs.
A request leaves as soon as it finishes (a stop token, `max_tokens`, cancellation) and its slot and
pages go to the next.

Memory: the MLA latents live in a pool of pages of `page_size` tokens; a request holds the pages its
tokens fill (ceil(tokens / page_size)), taken as it grows. Admission reserves the pages a request
may come to need (prompt + max_tokens), so a running request never waits for a page. KDA state and
conv windows are per slot.

Prefix cache (`prefix_cache=True`, `engine.prefix`): prompt pages stay in an index after their
request ends, shared by reference count, and KDA snapshots are taken at page boundaries of prompts
(the last one below each prompt's last token, and every `snapshot_pages` pages of long prompts) into
a device store of `prefix_cache_gb`; a request whose prompt starts with a cached prefix restores the
deepest snapshot with all its pages and prefills only the rest (`RequestHandle.cached_tokens`).
Unused cached pages are evicted, least recently used first, when the pool runs short. With
`cache_outputs` (plain decoding) the decode calls extend this to the new tokens: where a row's
positions reach a page boundary within its max_tokens, the call copies the row's KDA state after that
boundary into a store row (at most `device.SNAPSHOTS_PER_STEP` rows per step), and once the call's
tokens are read its full pages are indexed under the prompt-and-output tokens with that snapshot (the
request's previous output snapshot dropped), so the next turn of a conversation (its prompt the last
prompt, the reply and new tokens) reuses the reply as well. A request whose prompt + max_tokens ends
on a page boundary takes one step more (it feeds its last token); if that step's call is still in
flight when the request ends, its pages wait for it, and a waiting prompt that continues that reply
is admitted a round later, once the snapshot is indexed.

Speculative decoding (`speculative_tokens=k`, a model with an MTP layer): each loop iteration runs
one speculative call over every slot instead of the decode calls (`device.speculative_step`: k MTP
drafts, one verify of k + 1 positions reading the slots' pages, each row committing its accepted
drafts and one token of the main model's), and delivers each row's 1 to k + 1 tokens (a stop token or
`max_tokens` cuts them short) before the next call: the tokens are `generate(..., speculative_tokens=k)`'s
(greedy: the plain tokens; seeded sampling: the same draws). The MTP layer's latent rows live in a pool
of pages read through the main page table (`device` module doc), filled by the prompt's chunks; a row
may write k + 1 positions per call, so a slot's pages run k positions ahead of its tokens and
admission reserves prompt + max_tokens + k. Shared prefix pages hold their MTP rows too (they depend
on the page's prefix alone) and snapshots the main hidden state at their boundary, so a prefix hit
needs nothing recomputed.

Compiled shapes: prefill calls of one prompt's chunk in powers of two up to `prefill_chunk` (at least
16) and, with `prefill_rows` > 1, of `prefill_rows` prompts' chunks of `prefill_chunk` / 4 and
`prefill_chunk` tokens (prompt log-probabilities in calls of one prompt only), decode calls per
decode bucket of 1 and of `decode_steps` steps, greedy and sampled (with speculation: the speculative
call, greedy and sampled, instead), each with and without log-probabilities; `warmup()` compiles them
all, and serving never compiles afterwards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.cache import nbytes, paged_cache_shapes
from ling_jax.config import LingConfig
from ling_jax.decode.sampling import row_keys
from ling_jax.decode.step import fuse_for_decode
from ling_jax.decode.verify import has_mtp
from ling_jax.engine import device
from ling_jax.engine.prefix import PrefixIndex, page_keys
from ling_jax.engine.request import QueueFull, RequestHandle, SamplingParams, TokenOutput
from ling_jax.kernels import Kernels, select
from ling_jax.params import Params

MIN_CHUNK = 16  # the smallest prefill chunk bucket


@dataclasses.dataclass
class _Slot:
    """A running request: its handle, prompt, where its prefill stands, its pages and sampling state."""

    handle: RequestHandle
    prompt: np.ndarray  # int32 [T]
    key: np.ndarray  # uint32 key data
    stop: frozenset[int]
    reserved: int  # pages held back for it at admission (its worst case)
    pages: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache
    length: int = 0  # tokens in the cache
    emitted: int = 0  # new tokens delivered
    dispatched: int = 0  # new tokens delivered or being computed by the decode call in flight
    last: int = 0  # the last new token (the next decode step's input)
    order: int = 0  # admission order
    restore: int | None = None  # the prefix cache's snapshot row to start the prompt's prefill from
    srow: int | None = None  # the staging row that carries its prompt between chunks, while it has one
    keys: list[bytes] = dataclasses.field(default_factory=list)  # the prompt's full pages' keys
    fresh: list[int] = dataclasses.field(default_factory=list)  # speculation: the tokens its last call accepted
    out_snaps: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (boundary, store row) in flight
    out_key: bytes | None = None  # the key of its deepest output snapshot in the index
    # its first token not yet read: (its prefill call's outputs, row, decode calls dispatched before that call)
    first: tuple[Any, int, int] | None = None

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


class PagePool:
    """Host bookkeeping of the latent pages: page 0 is kept back (free slots' tables point to it)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, 0, -1))
        self.reserved = 0  # pages promised to admitted requests and not yet taken

    @property
    def used(self) -> int:
        return self.num_pages - 1 - len(self.free)

    def take(self, n: int) -> list[int]:
        pages, self.free = self.free[len(self.free) - n:], self.free[:len(self.free) - n]
        return pages[::-1]

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))


class Engine:
    """Continuous batching over a paged latent cache (module doc). `submit` and `cancel` may be called
    from any thread; tokens arrive through the `RequestHandle`s.

    `config`, `params`: the model (params as loaded: float or FP8-resident, placed on `mesh` if
    given). `max_batch`: slots; `max_len`: the most tokens a request may hold (prompt + max_tokens);
    `page_size`: tokens per page; `num_pages`: the pool's size (default: enough for every slot at
    `max_len`); `prefill_chunk`: the largest prefill chunk; `prefill_rows`: the most prompts one
    prefill call runs a chunk of (each holds a staging row of KDA state while in its prompt);
    `token_budget`: prompt tokens prefilled per loop iteration (default `prefill_rows *
    prefill_chunk`); `decode_steps`: decode steps per call while nothing waits; `decode_buckets`: the
    slot counts a decode call is compiled for (default: `max_batch` only): a call runs the first slots
    up to the smallest bucket that holds every decoding slot (requests take the lowest free slot), so
    at low concurrency a step costs what a small batch costs, for one more compiled call per bucket
    (plain decoding; with speculation every call runs all slots); `max_waiting`:
    queued requests beyond which `submit` raises `QueueFull`; `mesh`: the mesh
    every call runs under (`jax.set_mesh`); `unroll_layers`: the decode step's layers unrolled;
    `unroll_prefill`: the prefill calls' layers unrolled too (`device.prefill_chunk`; longer compiles);
    `prefix_cache`, `prefix_cache_gb`, `snapshot_pages`, `cache_outputs`: the prefix cache (module doc;
    `cache_outputs`: decode steps snapshot at page boundaries too, so a prompt that continues a
    request's output reuses it);
    `speculative_tokens`: k MTP drafts per speculative call (0: plain decoding; k > 0 needs an MTP
    layer, else ValueError).

    `forced_drafts` (a test hook, as `speculative_loop`'s): request id -> int32 [N]; that request's
    draft for output index j is forced_drafts[id][min(j, N - 1)] instead of the MTP layer's (while any
    running request has an entry, the others' drafts are token 0).
    """

    def __init__(self, config: LingConfig, params: Params, *, max_batch: int = 8, max_len: int = 2048,
                 page_size: int = 64, num_pages: int | None = None, prefill_chunk: int = 512,
                 prefill_rows: int = 1, token_budget: int | None = None, decode_steps: int = 8,
                 decode_buckets: Sequence[int] | None = None, max_waiting: int = 256, mesh: Any = None,
                 unroll_layers: bool = True, unroll_prefill: bool = False, speculative_tokens: int = 0,
                 prefix_cache: bool = False, prefix_cache_gb: float = 1.0, snapshot_pages: int = 32,
                 cache_outputs: bool = True):
        for name, v, least in (("max_batch", max_batch, 1), ("max_len", max_len, 2), ("page_size", page_size, 1),
                               ("prefill_chunk", prefill_chunk, 1), ("prefill_rows", prefill_rows, 1),
                               ("decode_steps", decode_steps, 1),
                               ("max_waiting", max_waiting, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name}={v!r} must be an integer >= {least}")
        if prefill_rows > max_batch:
            raise ValueError(f"prefill_rows={prefill_rows} exceeds max_batch={max_batch}: no more prompts than "
                             f"slots can be in their prefill")
        if max_len > config.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds max_position_embeddings={config.max_position_embeddings}")
        if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 0:
            raise ValueError(f"speculative_tokens={speculative_tokens!r} must be an integer >= 0 (0 = off)")
        if speculative_tokens and not has_mtp(config, params):
            raise ValueError(f"speculative_tokens={speculative_tokens} drafts with the MTP layer, and this model has "
                             f"none (num_nextn_predict_layers={config.num_nextn_predict_layers})")
        buckets = sorted({max_batch, *(decode_buckets or ())})
        if any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= max_batch for b in buckets):
            raise ValueError(f"decode_buckets={decode_buckets!r} must be integers in 1 .. max_batch={max_batch}")
        if speculative_tokens and len(buckets) > 1:
            raise ValueError("decode_buckets apply to plain decoding: a speculative call runs every slot")
        self.decode_buckets = buckets
        if isinstance(snapshot_pages, bool) or not isinstance(snapshot_pages, int) or snapshot_pages < 1:
            raise ValueError(f"snapshot_pages={snapshot_pages!r} must be an integer >= 1")
        self.config, self.max_batch, self.max_len, self.page_size = config, max_batch, max_len, page_size
        self.spec = speculative_tokens
        self.max_pages = -(-(max_len + self.spec) // page_size)  # a verify writes k positions past the tokens
        self.num_pages = num_pages if num_pages is not None else max_batch * self.max_pages + 1
        if self.num_pages < self.max_pages + 1:
            raise ValueError(f"num_pages={self.num_pages} holds no request of max_len={max_len} "
                             f"(needs {self.max_pages} pages + 1 kept back)")
        self.chunks = sorted({min(max(MIN_CHUNK, 1 << i), prefill_chunk)
                              for i in range(prefill_chunk.bit_length() + 1)})
        self.prefill_rows = prefill_rows
        self._key_shape = np.shape(jax.random.key_data(jax.random.key(0)))
        # the compiled prefill calls (prompts, chunk): one prompt in every chunk bucket; several in two
        self.prefill_shapes = [(1, c) for c in self.chunks] + [
            (prefill_rows, c) for c in sorted({max(MIN_CHUNK, prefill_chunk // 4), prefill_chunk}) if prefill_rows > 1]
        self.token_budget = token_budget or prefill_rows * self.chunks[-1]
        self.decode_steps, self.max_waiting, self.mesh = decode_steps, max_waiting, mesh
        self.unroll_prefill = bool(unroll_prefill)
        self.eos = frozenset(config.eos_token_id)
        dtype = self.dtype = params["embed"].dtype
        with self._mesh():
            self.k_prefill: Kernels = select(config, dtype=dtype, inference=True)
            self.k_decode: Kernels = select(config, dtype=dtype, decode=True, unroll=unroll_layers)
            self.k_verify = self.k_decode if unroll_layers else None  # the verify's row form (`device` doc)
            self.params = jax.jit(fuse_for_decode, static_argnums=(0, 1))(config, self.k_decode, params)
            shapes = paged_cache_shapes(config, max_batch, self.num_pages, page_size, dtype)
            staging = paged_cache_shapes(config, prefill_rows, 1, page_size, dtype)
            self.cache = device.empty(shapes, tokens=True)
            self.staging = device.empty(staging, self._hidden(prefill_rows))
            self._free_srows = list(range(prefill_rows - 1, -1, -1))
            self.drafting: device.Drafting | None = None
            if self.spec:
                width = config.kv_lora_rank + config.qk_rope_head_dim
                self.drafting = _committed(jax.jit(lambda: device.place_drafting({
                    "pages": jnp.zeros((self.num_pages, page_size, width), dtype),
                    "hidden": jnp.zeros((max_batch, self.spec + 1, config.hidden_size), dtype)}))())
        self.cache_bytes = nbytes(shapes) + (nbytes(self.drafting) if self.drafting is not None else 0)
        self.forced_drafts: dict[str, np.ndarray] = {}
        self.snapshot_pages = snapshot_pages
        self.prefix: PrefixIndex | None = None
        self.prefix_bytes = 0
        if prefix_cache:
            one_row = paged_cache_shapes(config, 1, 1, page_size, dtype)
            row_bytes = nbytes(_kda_leaves(one_row)) + nbytes(self._hidden(1))
            rows = int(prefix_cache_gb * 1e9 // row_bytes)
            if rows < 1:
                raise ValueError(f"prefix_cache_gb={prefix_cache_gb} holds no KDA snapshot ({row_bytes} bytes each)")
            store = paged_cache_shapes(config, rows, 1, page_size, dtype)
            with self._mesh():
                self.store = device.empty(store, self._hidden(rows), store=True)
            self.prefix = PrefixIndex(page_size, rows)
            self.prefix_bytes = rows * row_bytes
        self.pool = PagePool(self.num_pages)
        self.slots: list[_Slot | None] = [None] * max_batch
        self.waiting: deque[RequestHandle] = deque()
        self._pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # request id -> (prompt, key)
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._admitting = True
        self._drain_deadline: float | None = None
        self._admitted = 0
        # the decode call running: (outputs, rows, steps, log-probabilities, output snapshots (slot, boundary,
        # step, store row))
        self._flight: tuple[Any, list[tuple[int, _Slot]], int, bool, list[tuple[int, int, int, int]]] | None = None
        self.cache_outputs = cache_outputs and self.prefix is not None and not self.spec
        self._draining: list[_Slot] = []  # ended requests whose pages wait for a call in flight's snapshot
        self.counters = {"requests_total": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0,
                         "prefill_chunks_total": 0, "prefill_calls_total": 0, "decode_calls_total": 0,
                         "decode_steps_total": 0, "decode_row_steps_total": 0, "decode_slot_steps_total": 0}
        if self.spec:
            self.counters.update(spec_verify_calls=0, spec_draft_tokens=0, spec_accepted_tokens=0)

    # ------------------------------------------------------------------------------------- public
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def submit(self, prompt_ids: Sequence[int] | np.ndarray, sampling: SamplingParams | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queues a request; its tokens arrive through the returned handle. ValueError on bad input (an
        empty prompt, a token id outside the vocabulary, prompt + max_tokens > max_len, a bad
        sampling value); QueueFull when `max_waiting` requests already wait; RuntimeError after
        `shutdown`."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        sampling.check(self.vocab_size)
        prompt = _token_ids(prompt_ids, self.vocab_size)
        if len(prompt) + sampling.max_tokens > self.max_len:
            raise ValueError(f"the prompt's {len(prompt)} tokens + max_tokens={sampling.max_tokens} exceed "
                             f"max_len={self.max_len}")
        seed = sampling.seed if sampling.seed is not None else int(np.random.default_rng().integers(2**63))
        key = _key_data(seed, prompt)
        handle = RequestHandle(prompt.tolist(), sampling, request_id)
        with self._lock:
            if not self._admitting:
                raise RuntimeError("the engine is shutting down: no new requests")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (max_waiting={self.max_waiting})")
            self.waiting.append(handle)
            self._pending[handle.id] = (prompt, key)
            self.counters["requests_total"] += 1
            self._wake.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Ends the request (its handle finishes "cancelled") and frees its slot and pages; a request
        already finished is left as it is."""
        with self._lock:
            if handle.finished:
                return
            self._cancelled.add(handle.id)
            self._wake.notify()

    def stats(self) -> dict[str, float]:
        """Gauges (running, waiting, pages; with the prefix cache its pages, snapshots and bytes) and
        counters (requests, tokens, calls; decode steps, and those times the rows decoding / the slots
        computed, whose ratio is the batch's occupancy; prefix hits, misses, cached tokens, evictions; with
        speculation the speculative calls, the drafts they verified (k per decoding row) and the drafts
        accepted)."""
        with self._lock:
            running = sum(s is not None for s in self.slots)
            out = {"running": running, "waiting": len(self.waiting), "pages_used": self.pool.used,
                   "pages_total": self.num_pages - 1, "page_size": self.page_size, **self.counters}
            if self.prefix is not None:
                out.update(self.prefix.counters, prefix_pages_cached=len(self.prefix.pages),
                           prefix_snapshots=len(self.prefix.snapshots), prefix_pool_bytes=self.prefix_bytes)
            return out

    def start(self) -> None:
        """Starts the loop thread (idempotent)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ling-engine", daemon=True)
                self._thread.start()

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stops admitting (`submit` raises RuntimeError), lets the requests in flight finish for up to
        `grace_s` seconds, cancels the rest (waiting ones included) and stops the loop thread."""
        with self._lock:
            self._admitting = False
            self._drain_deadline = time.monotonic() + grace_s
            self._wake.notify()
            thread = self._thread
        if thread is None:
            self._finish_all("cancelled")
            return
        thread.join()

    def warmup(self, *, logprobs: bool = True, sampling: bool = True,
               progress: Callable[[int, int, str, float], None] | None = None,
               compile_threads: int = 1) -> None:
        """Compiles every shape serving uses (each prefill call shape and decode call, or with speculation
        the speculative call, with and, unless `logprobs` is False, without log-probabilities; decode and
        speculative calls greedy and, unless `sampling` is False, sampled) on a scratch slot; nothing compiles after
        it. `logprobs=False` (a caller whose requests never ask for log-probabilities) halves the work,
        and so does `sampling=False` (requests at temperature 0 only); a request that asks for what was
        left out then compiles its shapes on first use.

        `compile_threads` > 1 lowers every shape first, compiles them ahead of time in that many threads
        at once (XLA's compilers release the GIL), then runs each once; 1 (the default) compiles each
        shape at its first run. `progress(done, total, name, seconds)` is called after each shape
        (compiled and run once; with several threads, the first report's seconds include the whole
        compilation)."""
        variants = (False, True) if logprobs else (False,)
        zeros_table, none = np.zeros((self.max_batch, self.max_pages), np.int32), np.zeros(self.max_batch, bool)

        def prefill(rows: int, c: int, lp: bool, lower: bool = False) -> Any:
            args = (self.config, self.k_prefill, lp, self.unroll_prefill, self.params, self.cache, self.staging,
                    self.drafting, *self._prefill_args(rows, c, []))
            if lower:
                return device.prefill_chunk.lower(*args)
            self.cache, self.staging, self.drafting, out = device.prefill_chunk(*args)
            return out

        def decode(rows: int, steps: int, sampled: bool, lp: bool, lower: bool = False) -> Any:
            if lower:
                return device.decode_steps.lower(
                    *self._decode_args(steps, lp, zeros_table[:rows], none[:rows], [], sampled))
            self.cache, out = self._decode(steps, lp, zeros_table[:rows], none[:rows], [], sampled)
            return out

        def speculate(sampled: bool, lp: bool, lower: bool = False) -> Any:
            if lower:
                return device.speculative_step.lower(*self._speculate_args(lp, zeros_table, [], sampled))
            return self._speculate(lp, zeros_table, [], sampled)

        def snapshot_round_trip(lower: bool = False) -> Any:  # the store is left as it was
            if lower:
                return None  # two copies: no compilation worth a thread
            self.staging = device.restore_snapshot(self.staging, self.store, np.int32(0), np.int32(0))
            self.store = device.save_snapshot(self.store, self.staging, np.int32(0), np.int32(0))
            return self.store

        lp_name = {False: "", True: ", log-probabilities"}
        shapes: list[tuple[str, Callable[..., Any]]] = [
            (f"prefill {rows} x {c}{lp_name[lp]}", functools.partial(prefill, rows, c, lp))
            for rows, c in self.prefill_shapes for lp in (variants if rows == 1 else (False,))]
        if self.spec:
            shapes += [(f"speculative step{', sampled' * sampled}{lp_name[lp]}",
                        functools.partial(speculate, sampled, lp))
                       for sampled in ((False, True) if sampling else (False,)) for lp in variants]
        else:
            shapes += [(f"decode {rows} slots, {n} step{'s' * (n > 1)}{', sampled' * sampled}{lp_name[lp]}",
                        functools.partial(decode, rows, n, sampled, lp))
                       for rows in self.decode_buckets for n in sorted({1, self.decode_steps})
                       for sampled in ((False, True) if sampling else (False,)) for lp in variants]
        if self.prefix is not None:
            shapes.append(("snapshot save and restore", snapshot_round_trip))
        threads = min(len(shapes), compile_threads)
        with self._mesh():
            t0 = time.perf_counter()
            if threads > 1:
                lowered = [lower(lower=True) for _, lower in shapes]  # tracing holds the GIL: one thread

                def compile_one(low: Any) -> None:
                    if low is not None:
                        low.compile()

                with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                    list(pool.map(compile_one, lowered))
            for done, (name, run) in enumerate(shapes, 1):
                jax.block_until_ready(run())
                if progress is not None:
                    progress(done, len(shapes), name, time.perf_counter() - t0)
                t0 = time.perf_counter()
        _key_data(0, np.zeros(1, np.int32))  # the requests' key derivation

    # ------------------------------------------------------------------------------------- loop
    def _mesh(self) -> Any:
        return jax.set_mesh(self.mesh) if self.mesh is not None else _nullcontext()

    def _run(self) -> None:
        with self._mesh():
            try:
                while self._iterate():
                    pass
            except Exception as e:  # a device or compiler failure: every request learns of it
                self._finish_all("error", f"{type(e).__name__}: {e}")
                raise

    def _iterate(self) -> bool:
        """One loop iteration: cancellations, admissions, prefill chunks, decode steps. False to stop."""
        with self._lock:
            self._apply_cancellations()
            draining = not self._admitting
            if draining:
                for h in self.waiting:
                    self._pending.pop(h.id, None)
                    h.finish("cancelled")
                self.waiting.clear()
                if time.monotonic() >= self._drain_deadline:
                    self._finish_all_locked("cancelled")
                if all(s is None for s in self.slots):
                    return False
            self._admit()
            if all(s is None for s in self.slots) and self._flight is None:
                self._wake.wait(timeout=0.1)
                return True
        self._prefill()
        self._decode_round()
        return True

    def _apply_cancellations(self) -> None:
        if not self._cancelled:
            return
        for h in [h for h in self.waiting if h.id in self._cancelled]:
            self.waiting.remove(h)
            self._pending.pop(h.id, None)
            h.finish("cancelled")
        for i, s in enumerate(self.slots):
            if s is not None and s.handle.id in self._cancelled:
                self._release(i, "cancelled")
        self._cancelled.clear()

    def _admit(self) -> None:
        """Free slots take waiting requests (in order) while the pool can promise their pages."""
        while self.waiting and None in self.slots:
            h = self.waiting[0]
            prompt, key = self._pending[h.id]
            if self._draining and self._continues(prompt):
                return  # the reply it continues has a snapshot in the call in flight: reuse it next round
            # prompt log-probabilities need the whole prompt run, so such a request reads no cached prefix
            reuse = self.prefix is not None and h.sampling.prompt_logprobs is None
            hit = self.prefix.lookup(prompt) if reuse else None
            tokens = len(prompt) + h.sampling.max_tokens + self.spec  # the most positions it writes
            need = -(-tokens // self.page_size) - (len(hit.pages) if hit else 0)
            if hit:
                self.prefix.acquire(hit)  # before counting what may be evicted
            evictable = self.prefix.evictable() if self.prefix is not None else 0
            if len(self.pool.free) + evictable - self.pool.reserved < need:
                if hit:
                    self.prefix.release(hit.pages)
                    self.prefix.restored(hit.row)
                return
            self.waiting.popleft()
            del self._pending[h.id]
            if reuse:
                self.prefix.count(hit)
            stop = frozenset(h.sampling.stop_token_ids) | (frozenset() if h.sampling.ignore_eos else self.eos)
            self.pool.reserved += need
            self._admitted += 1
            slot = _Slot(h, prompt, key, stop, need, order=self._admitted)
            if self.prefix is not None:
                slot.keys = page_keys(prompt, self.page_size)
                if hit:
                    slot.pages, slot.prefilled, slot.length = list(hit.pages), hit.length, hit.length
                    slot.restore, h.cached_tokens = hit.row, hit.length
            self.slots[self.slots.index(None)] = slot
            self.counters["prompt_tokens_total"] += len(prompt)

    def _continues(self, prompt: np.ndarray) -> bool:
        """Whether `prompt` continues the prompt and reply of a request whose pages wait for a snapshot."""
        for s in self._draining:
            n, m = len(s.prompt), len(s.handle.tokens)
            if len(prompt) > n + m and np.array_equal(prompt[:n], s.prompt) and \
                    np.array_equal(prompt[n:n + m], s.handle.tokens):
                return True
        return False

    def _pages_for(self, slot: _Slot, tokens: int) -> None:
        """Gives the slot pages for its first `tokens` positions (out of its reservation)."""
        need = -(-tokens // self.page_size) - len(slot.pages)
        if need > 0:
            with self._lock:
                if len(self.pool.free) < need:  # cached pages no request reads make room
                    self.pool.give_back(self.prefix.evict(need - len(self.pool.free)))
                slot.pages += self.pool.take(need)
                self.pool.reserved -= need
                slot.reserved -= need

    def _table(self, slot: _Slot) -> np.ndarray:
        row = np.zeros(self.max_pages, np.int32)
        row[:len(slot.pages)] = slot.pages
        return row

    def _prefill(self) -> None:
        """Prefill calls over the slots still in their prompt, up to the token budget: each call runs a
        chunk of each of up to `prefill_rows` prompts, taken in the order of admission; a prompt holds a
        staging row from its first chunk to its last (prompts wait for a free one), and a prompt that
        asks for its log-probabilities runs alone."""
        budget = self.token_budget
        while budget > 0:
            group = self._prefill_group(budget)
            if not group:
                return
            budget -= self._prefill_call(group)

    def _prefill_group(self, budget: int) -> list[tuple[int, _Slot, int]]:
        """The next prefill call's prompts: (slot index, slot, tokens of its chunk), within `budget`
        tokens; each has a staging row (with a cached prefix's snapshot restored into it)."""
        group: list[tuple[int, _Slot, int]] = []
        for i in sorted((i for i, s in enumerate(self.slots) if s is not None and not s.decoding),
                        key=lambda i: self.slots[i].order):
            s = self.slots[i]
            alone = s.handle.sampling.prompt_logprobs is not None
            if (alone and group) or (s.srow is None and not self._free_srows):
                continue
            if s.srow is None:
                s.srow = self._free_srows.pop()
            if s.restore is not None:  # a cached prefix: its KDA state into the staging row
                self.staging = device.restore_snapshot(self.staging, self.store, np.int32(s.restore),
                                                       np.int32(s.srow))
                with self._lock:
                    self.prefix.restored(s.restore)
                s.restore = None
            n = min(len(s.prompt) - s.prefilled, budget, self.chunks[-1], self._to_snapshot(s))
            group.append((i, s, n))
            budget -= n
            if alone or len(group) == self.prefill_rows or budget == 0:
                break
        return group

    def _prefill_args(self, rows: int, c: int, group: list[tuple[int, _Slot, int]]) -> list[np.ndarray]:
        """`device.prefill_chunk`'s arguments after the caches for a call of `rows` prompts of chunk `c`
        holding `group`'s chunks (the rest padding)."""
        table = np.zeros((rows, self.max_pages), np.int32)
        slot, srow = np.full(rows, self.max_batch, np.int32), np.full(rows, self.prefill_rows, np.int32)
        ids, targets = np.zeros((rows, c), np.int32), np.zeros((rows, c), np.int32)
        start, n_valid = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        keys = np.zeros((rows, *self._key_shape), np.uint32)
        temp, top_k, top_p = np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32)
        for r, (i, s, n) in enumerate(group):
            a = s.prefilled
            self._pages_for(s, a + n)
            table[r], slot[r], srow[r], start[r], n_valid[r], keys[r] = self._table(s), i, s.srow, a, n, s.key
            ids[r, :n] = s.prompt[a:a + n]
            nxt = s.prompt[a + 1:a + n + 1]
            targets[r, :len(nxt)] = nxt
            sp = s.handle.sampling
            temp[r], top_k[r], top_p[r] = sp.temperature, min(sp.top_k, self.vocab_size), sp.top_p
        return [table, slot, srow, ids, start, n_valid, targets, keys, temp, top_k, top_p]

    def _prefill_call(self, group: list[tuple[int, _Slot, int]]) -> int:
        """Runs one prefill call of `group` (`_prefill_group`) and delivers what it finished: the first
        token of each prompt it completed, prompt log-probabilities. Returns the tokens it prefilled."""
        rows, c = next((r, c) for r, c in self.prefill_shapes if r >= len(group) and c >= max(n for _, _, n in group))
        want_lp = any(s.handle.sampling.prompt_logprobs is not None for _, s, _ in group)
        self.cache, self.staging, self.drafting, out = device.prefill_chunk(
            self.config, self.k_prefill, want_lp, self.unroll_prefill, self.params, self.cache, self.staging,
            self.drafting, *self._prefill_args(rows, c, group))
        self.counters["prefill_calls_total"] += 1
        self.counters["prefill_chunks_total"] += len(group)
        starts = [s.prefilled for _, s, _ in group]
        for _, s, n in group:
            s.prefilled = s.length = s.prefilled + n
            if self.prefix is not None:
                self._cache_prefix(s)
        done = [(r, s) for r, (_, s, _) in enumerate(group) if s.decoding]
        if not want_lp and not self.spec and all(s.handle.sampling.max_tokens for _, s in done):
            for r, s in done:  # the first token is read after the next decode call is dispatched
                self._free_srows.append(s.srow)
                s.srow, s.first = None, (out, r, self.counters["decode_calls_total"])
                s.dispatched += 1
            return sum(n for _, _, n in group)
        out = jax.device_get(out)
        for r, ((i, s, n), a) in enumerate(zip(group, starts, strict=True)):
            row = {name: v[r] for name, v in out.items()}
            if want_lp:
                self._prompt_logprobs(s, a, n, row)
            if s.decoding:
                self._free_srows.append(s.srow)
                s.srow = None
                self._first_token(i, s, row)
        return sum(n for _, _, n in group)

    def _to_snapshot(self, s: _Slot) -> int:
        """Prompt tokens up to the slot's next snapshot point (a chunk ends there), or no limit."""
        if self.prefix is None:
            return len(s.prompt)
        k = self.page_size
        last = (len(s.prompt) - 1) // k * k  # the boundary below the prompt's last token
        every = self.snapshot_pages * k
        points = [p for p in (s.prefilled // every * every + every, last) if s.prefilled < p <= last]
        return min(points, default=len(s.prompt)) - s.prefilled

    def _cache_prefix(self, s: _Slot) -> None:
        """Indexes the slot's prompt pages prefilled so far and, at a snapshot point, snapshots the
        staging row's KDA state after them."""
        full = s.prefilled // self.page_size
        with self._lock:
            self.prefix.add_pages(s.keys[:full], s.pages[:full])
            last = (len(s.prompt) - 1) // self.page_size * self.page_size
            at_point = s.prefilled == last or s.prefilled % (self.snapshot_pages * self.page_size) == 0
            row = self.prefix.snapshot_row(s.keys[full - 1]) if full and at_point else None
        if row is not None:
            self.store = device.save_snapshot(self.store, self.staging, np.int32(s.srow), np.int32(row))

    def _prompt_logprobs(self, s: _Slot, start: int, n: int, out: dict[str, np.ndarray]) -> None:
        """Records the log-probabilities of prompt tokens start + 1 .. start + n (the next ones) and,
        at the prompt's start, the first token without one."""
        k = s.handle.sampling.prompt_logprobs
        got = s.handle.prompt_logprobs if s.handle.prompt_logprobs is not None else []
        if start == 0:
            got.append(TokenOutput(int(s.prompt[0])))
        for j in range(min(n, len(s.prompt) - 1 - start)):
            got.append(TokenOutput(int(s.prompt[start + 1 + j]), float(out["prompt_logprob"][j]),
                                   _top(out["prompt_top_ids"][j], out["prompt_top_logprobs"][j], k)))
        s.handle.prompt_logprobs = got

    def _first_token(self, i: int, s: _Slot, out: dict[str, Any]) -> None:
        if s.handle.sampling.max_tokens == 0:  # scoring only
            self._release(i, "length")
            return
        s.dispatched += 1
        self._emit(i, s, int(out["token"]), float(out["logprob"]), out["top_ids"], out["top_logprobs"])

    def _first_tokens(self, before: int | None) -> None:
        """Delivers the first tokens that prefill calls dispatched before decode call number `before` (counted
        from 1: the call in flight; None: all) left on the device (`_Slot.first`); the decode calls dispatched
        since read them there, so the device runs those while the host waits here."""
        read: dict[int, dict[str, np.ndarray]] = {}
        for i, s in enumerate(self.slots):
            if s is None or s.first is None or (before is not None and s.first[2] >= before):
                continue
            out, r, _ = s.first
            s.first = None
            if id(out) not in read:  # one read per prefill call, however many prompts it finished
                read[id(out)] = jax.device_get(out)
            row = read[id(out)]
            self._emit(i, s, int(row["token"][r]), float(row["logprob"][r]), row["top_ids"][r],
                       row["top_logprobs"][r])

    def _emit(self, i: int, s: _Slot, token: int, lp: float, top_ids: np.ndarray, top_lps: np.ndarray) -> bool:
        """Delivers one new token; releases the slot when the request is done. True while it runs."""
        k = s.handle.sampling.logprobs
        s.handle.push(TokenOutput(token, lp if k is not None else None,
                                  _top(top_ids, top_lps, k) if k is not None else None))
        s.emitted += 1
        s.last = token
        self.counters["generation_tokens_total"] += 1
        if token in s.stop:
            self._release(i, "stop")
        elif s.emitted >= s.handle.sampling.max_tokens:
            self._release(i, "length")
        return self.slots[i] is s

    def _decode_round(self) -> None:
        """Dispatches the next decode call for every slot past its prompt (several steps per call while
        no request waits to start), then reads the first tokens that prefill calls dispatched before the
        previous call left on the device (with no call in flight: all of them) and the previous call's
        tokens, while the device runs what was queued after them: the new call takes its inputs from the
        previous one's outputs and the prefills' on the device, so the host's work (delivering tokens,
        admitting, building page tables) overlaps the device's. With speculation: one speculative call
        instead (`_speculate_round`)."""
        if self.spec:
            self._speculate_round()
            return
        prev, self._flight = self._flight, None
        before = self.counters["decode_calls_total"] if prev else None  # prev is call number `before`
        active = [(i, s) for i, s in enumerate(self.slots)
                  if s is not None and s.decoding and self._steps_left(s) > 0]
        if active:
            busy = bool(self.waiting) or any(s is not None and not s.decoding for s in self.slots)
            # a call's steps stay within every row's page table (positions < max_pages * page_size)
            room = min(self.max_pages * self.page_size - s.length for _, s in active)
            steps = 1 if busy or room < self.decode_steps else self.decode_steps
            rows = next(b for b in self.decode_buckets if b > active[-1][0])
            table = np.zeros((rows, self.max_pages), np.int32)
            for i, s in active:  # steps past a row's max_tokens write its own last page or page 0, unread
                self._pages_for(s, min(s.length + steps, len(s.prompt) + s.handle.sampling.max_tokens))
                table[i] = self._table(s)
            follow = np.zeros(rows, bool)  # rows continuing from the call in flight or from their prefill
            for i, s in prev[1] if prev else ():
                if i < rows:  # a row past this call's bucket ended
                    follow[i] = self.slots[i] is s
            for i, s in active:
                follow[i] |= s.first is not None
            want_lp = any(s.handle.sampling.logprobs is not None for _, s in active)
            snaps = self._output_snapshots(active, steps) if self.cache_outputs else []
            self.cache, out = self._decode(steps, want_lp, table, follow, snaps)
            for _, s in active:
                s.length += steps
                s.dispatched += steps
            self._flight = (out, active, steps, want_lp, snaps)
            self._count_decode(steps, len(active), rows)
        self._first_tokens(before)
        if prev:
            self._deliver(*prev)

    def _count_decode(self, steps: int, active: int, rows: int) -> None:
        """Counts a decode (or speculative) call of `steps` steps over `rows` slots (its bucket), `active`
        of them decoding: row steps / slot steps is the batch's occupancy, what a step's cost buys."""
        self.counters["decode_calls_total"] += 1
        self.counters["decode_steps_total"] += steps
        self.counters["decode_row_steps_total"] += steps * active
        self.counters["decode_slot_steps_total"] += steps * rows

    def _steps_left(self, s: _Slot) -> int:
        """Decode steps slot s still dispatches: one per new token after the first, and with output
        snapshots one more where prompt + max_tokens ends on a page boundary (it feeds the last token,
        so that the boundary's snapshot can be taken)."""
        m = s.handle.sampling.max_tokens
        return m - s.dispatched + int(self.cache_outputs and (len(s.prompt) + m) % self.page_size == 0)

    def _output_snapshots(self, active: list[tuple[int, _Slot]], steps: int) -> list[tuple[int, int, int, int]]:
        """The output snapshots a decode call of `steps` steps takes (prefix cache): (slot, boundary, step,
        store row) for each row whose positions reach a page boundary within the call and within its max_tokens
        (the state after the boundary's last position, at step boundary - 1 - length), at most
        `SNAPSHOTS_PER_STEP` per step, each into a store row taken now (`_Slot.out_snaps`)."""
        k, per_step, snaps = self.page_size, [0] * steps, []
        for i, s in active:
            b = (s.length + steps) // k * k
            if not (s.length < b <= len(s.prompt) + s.handle.sampling.max_tokens):
                continue
            t = b - 1 - s.length
            if per_step[t] == device.SNAPSHOTS_PER_STEP:
                continue
            with self._lock:
                row = self.prefix.take_row()
            if row is None:
                break
            per_step[t] += 1
            s.out_snaps.append((b, row))
            snaps.append((i, b, t, row))
        return snaps

    def _index_output(self, s: _Slot, b: int, row: int, tokens: list[int]) -> None:
        """Indexes the pages of slot s's first `b` positions (a page boundary its decode call reached)
        and the snapshot its call took there in store row `row`; `tokens` holds its new tokens up to
        position b - 1 at least. Its previous output snapshot, now shallower, is dropped."""
        seq = np.concatenate([s.prompt, np.asarray(tokens[:b - len(s.prompt)], np.int32)])
        keys = page_keys(seq, self.page_size)
        s.out_snaps.remove((b, row))
        with self._lock:
            self.prefix.add_pages(keys, s.pages[:len(keys)])
            if self.prefix.put_snapshot(keys[-1], row):
                if s.out_key is not None:
                    self.prefix.drop_snapshot(s.out_key)
                s.out_key = keys[-1]
                self.prefix.counters["prefix_output_snapshots"] += 1

    def _deliver(self, out: Any, rows: list[tuple[int, _Slot]], steps: int, want_lp: bool,
                 snaps: list[tuple[int, int, int, int]]) -> None:
        """Delivers a decode call's tokens to the requests still in their slots; stops at each one's end.
        First indexes the call's output snapshots of the rows still running (their tokens are now known)."""
        out = jax.device_get(out)
        for i, b, t, row in snaps:
            s = next(s for j, s in rows if j == i)
            if (b, row) in s.out_snaps:  # else cancelled: `_give_back` freed its rows
                self._index_output(s, b, row, s.handle.tokens + out["tokens"][:t, i].tolist())
        for s in [s for s in self._draining if not s.out_snaps]:
            self._draining.remove(s)
            with self._lock:
                self._give_back(s)
        for i, s in rows:
            for t in range(steps):
                if self.slots[i] is not s:  # finished or cancelled: the rest of its tokens are dropped
                    break
                lp = (float(out["logprob"][t, i]), out["top_ids"][t, i], out["top_logprobs"][t, i]) if want_lp \
                    else (0.0, None, None)
                self._emit(i, s, int(out["tokens"][t, i]), *lp)

    def _decode(self, steps: int, want_lp: bool, table: np.ndarray, follow: np.ndarray,
                snaps: list[tuple[int, int, int, int]], sampled: bool | None = None) -> tuple[Any, Any]:
        """Dispatches `device.decode_steps` of `steps` steps (1 or `decode_steps`) over the first len(table)
        slots (a decode bucket), taking the output snapshots `snaps` ((slot, boundary, step, store row);
        prefix cache); `sampled`: its sampling form (default: sampled where a decoding slot among them
        samples, else greedy)."""
        cache, store, out = device.decode_steps(*self._decode_args(steps, want_lp, table, follow, snaps, sampled))
        if store is not None:
            self.store = store
        return cache, out

    def _decode_args(self, steps: int, want_lp: bool, table: np.ndarray, follow: np.ndarray,
                     snaps: list[tuple[int, int, int, int]], sampled: bool | None) -> tuple[Any, ...]:
        """`device.decode_steps`' arguments for `_decode`."""
        r = len(table)
        tokens, keys = np.zeros(r, np.int32), np.zeros((r, 2), np.uint32)
        index, temp = np.zeros(r, np.int32), np.zeros(r, np.float32)
        top_k, top_p = np.zeros(r, np.int32), np.ones(r, np.float32)
        for i, s in enumerate(self.slots[:r]):
            if s is not None and s.decoding:
                sp = s.handle.sampling
                tokens[i], keys[i], index[i] = s.last, s.key, s.dispatched
                temp[i], top_k[i], top_p[i] = sp.temperature, min(sp.top_k, self.vocab_size), sp.top_p
        store = rows_SM = dst_SM = None
        if self.cache_outputs:
            rows_SM = np.full((steps, device.SNAPSHOTS_PER_STEP), r, np.int32)
            dst_SM = np.zeros_like(rows_SM)
            for i, _, t, row in snaps:
                m = int(np.argmax(rows_SM[t] == r))
                rows_SM[t, m], dst_SM[t, m] = i, row
            store = self.store
        return (self.config, self.k_decode, steps, want_lp, bool((temp > 0).any()) if sampled is None else sampled,
                self.params, self.cache, table, tokens, follow, keys, index, temp, top_k, top_p, store, rows_SM, dst_SM)

    def _speculate_round(self) -> None:
        """One speculative call over every slot past its prompt, then each row's accepted tokens delivered
        (up to its stop token or `max_tokens`; the rest dropped with the request)."""
        active = [(i, s) for i, s in enumerate(self.slots) if s is not None and s.decoding]
        if not active:
            return
        table = np.zeros((self.max_batch, self.max_pages), np.int32)
        for i, s in active:
            self._pages_for(s, s.length + self.spec + 1)
            table[i] = self._table(s)
        want_lp = any(s.handle.sampling.logprobs is not None for _, s in active)
        out = jax.device_get(self._speculate(want_lp, table, active))
        self.counters["spec_verify_calls"] += 1
        self.counters["spec_draft_tokens"] += self.spec * len(active)
        self._count_decode(1, len(active), self.max_batch)
        for i, s in active:
            n = int(out["accepted"][i]) + 1
            self.counters["spec_accepted_tokens"] += n - 1
            s.length += n
            s.fresh = out["tokens"][i, :n].tolist()
            for t in range(n):
                lp = (float(out["logprob"][i, t]), out["top_ids"][i, t], out["top_logprobs"][i, t]) if want_lp \
                    else (0.0, None, None)
                if not self._emit(i, s, s.fresh[t], *lp):
                    break
            s.dispatched = s.emitted

    def _speculate(self, want_lp: bool, table: np.ndarray, active: list[tuple[int, _Slot]],
                   sampled: bool | None = None) -> Any:
        """Dispatches `device.speculative_step` for the `active` rows (the others change nothing):
        its outputs, on the device. `sampled`: its sampling form (default: sampled where an active row
        samples, else greedy)."""
        self.cache, self.drafting, out = device.speculative_step(
            *self._speculate_args(want_lp, table, active, sampled))
        return out

    def _speculate_args(self, want_lp: bool, table: np.ndarray, active: list[tuple[int, _Slot]],
                        sampled: bool | None = None) -> tuple[Any, ...]:
        """`device.speculative_step`'s arguments for `_speculate`."""
        b, t = self.max_batch, self.spec + 1
        tokens, m = np.zeros((b, t), np.int32), np.ones(b, np.int32)
        keys, index = np.zeros((b, 2), np.uint32), np.zeros(b, np.int32)
        temp, top_k, top_p = np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32)
        rows = np.zeros(b, bool)
        forced = np.zeros((b, self.spec), np.int32) if any(s.handle.id in self.forced_drafts for _, s in active) \
            else None
        for i, s in active:
            fresh, sp = s.fresh or [s.last], s.handle.sampling
            rows[i], tokens[i, :len(fresh)], m[i], keys[i], index[i] = True, fresh, len(fresh), s.key, s.emitted
            temp[i], top_k[i], top_p[i] = sp.temperature, min(sp.top_k, self.vocab_size), sp.top_p
            if forced is not None and s.handle.id in self.forced_drafts:
                f = self.forced_drafts[s.handle.id]
                forced[i] = f[np.minimum(s.emitted + np.arange(self.spec), len(f) - 1)]
        sampled = bool((temp > 0).any()) if sampled is None else sampled
        return (self.config, self.k_prefill, self.spec, want_lp, self.k_verify, sampled, self.params, self.cache,
                self.drafting, table, rows, tokens, m, keys, index, temp, top_k, top_p, forced)

    def _hidden(self, rows: int) -> dict[str, jax.Array]:
        """With speculation, a staging cache's or snapshot store's main hidden states ({"hidden" [rows, D]},
        zeros; `device` module doc); without, nothing."""
        return {"hidden": jnp.zeros((rows, self.config.hidden_size), self.dtype)} if self.spec else {}

    def _release(self, i: int, reason: str, error: str | None = None) -> None:
        """Ends slot i's request and gives back its pages and unused reservation."""
        s = self.slots[i]
        self.slots[i] = None
        if s is None:
            return
        if s.restore is not None:
            self.prefix.restored(s.restore)
        if s.srow is not None:
            self._free_srows.append(s.srow)
        if s.out_snaps and reason in ("stop", "length"):
            self._draining.append(s)  # its pages stay until the call in flight is read (`_deliver`)
        else:
            self._give_back(s)
        self.pool.reserved -= s.reserved
        s.handle.finish(reason, error)  # type: ignore[arg-type]

    def _finish_all(self, reason: str, error: str | None = None) -> None:
        with self._lock:
            self._finish_all_locked(reason, error)

    def _give_back(self, s: _Slot) -> None:
        """Returns an ended request's pages (those the prefix index does not hold) and its output
        snapshot rows not indexed (a decode call in flight may still write one: the device runs calls in
        order, so a later user of the row sees the later write)."""
        self.pool.give_back(self.prefix.release(s.pages) if self.prefix is not None else s.pages)
        for _, row in s.out_snaps:
            self.prefix.free_row(row)
        s.out_snaps.clear()

    def _finish_all_locked(self, reason: str, error: str | None = None) -> None:
        for h in self.waiting:
            self._pending.pop(h.id, None)
            h.finish(reason, error)  # type: ignore[arg-type]
        self.waiting.clear()
        for i in range(self.max_batch):
            self._release(i, reason, error)
        for s in self._draining:
            self._give_back(s)
        self._draining.clear()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _kda_leaves(cache: Any) -> list[Any]:
    """The KDA states and conv windows of a cache (a snapshot's contents)."""
    return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(cache["segments"]) if path[-1].key != "pages"]


def _committed(tree: Any) -> Any:
    """`tree` with every array committed to the device(s) it is on."""
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding), tree)


def _key_data(seed: int, prompt: np.ndarray) -> np.ndarray:
    """A request's sampling key as uint32 key data: `generate`'s key for the same seed and prompt."""
    return np.asarray(jax.random.key_data(row_keys([seed], [prompt]))[0], np.uint32)


def _top(ids: np.ndarray, lps: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    return tuple((int(a), float(b)) for a, b in zip(ids[:k], lps[:k], strict=True))


def _token_ids(prompt: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """The prompt as int32 [T]; ValueError for an empty prompt or an id outside [0, vocab_size)."""
    if isinstance(prompt, str | bytes):
        raise ValueError("prompt_ids must be token ids, not text")
    arr = np.asarray(prompt)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"prompt_ids must be a 1-D sequence of integer token ids, got {arr.dtype}{list(arr.shape)}")
    if arr.size == 0:
        raise ValueError("the prompt is empty")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} outside [0, vocab_size={vocab_size})")
    return arr.astype(np.int32)


