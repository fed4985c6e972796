"""`ling-serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Loads a checkpoint (HF directory or Orbax, as ling-generate), starts `ling_jax.engine.Engine`
(compiling its steps first), then serves `serve.app`'s routes with uvicorn on `--host:--port`
(127.0.0.1 by default; `--port 0` picks a free port) and prints one line
"ling-serve: serving NAME on http://HOST:PORT" once it listens.

SIGTERM or Ctrl-C drains: new requests get 503, requests in flight may finish for up to
`--shutdown-grace` seconds (then the engine cancels the rest), and the process exits 0; a second
signal exits at once (1). Usage errors exit 2 and runtime failures (a checkpoint that does not
load, a port in use) exit 1, each with one line on stderr. `--help` and the checks of paths and
values run before JAX is imported.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PROG = "ling-serve"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="HF directory (config.json + safetensors) or Orbax checkpoint")
    ap.add_argument("--tokenizer", help="tokenizer.json (its tokenizer_config.json beside it or in the checkpoint "
                    "gives the chat template); without it prompts and outputs are token ids")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="params/activation dtype")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000, help="0 = a free port (printed)")
    ap.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    ap.add_argument("--max-len", type=int, default=2048, help="prompt + new tokens of one request, at most")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per latent-cache page")
    ap.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond which new ones get 503")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="the largest prompt chunk prefilled in one call")
    ap.add_argument("--prefill-rows", type=int, default=1, help="the most prompts one prefill call runs a chunk of")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps per call while no request waits")
    ap.add_argument("--decode-buckets", type=_int_list, default=(), metavar="N,N,...",
                    help="also compile decode calls over the first N slots only (e.g. 1,16): at low concurrency a "
                         "step costs that batch's step, for one more compile per bucket")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="compile every serving shape before listening (--no-warmup: as requests need them)")
    ap.add_argument("--compile-threads", type=int, default=1,
                    help="--warmup: compile the shapes ahead of time in this many threads at once (1: one by one)")
    ap.add_argument("--mesh", default="", help="device mesh as axis=size pairs, e.g. 'expert=8' (as ling-generate)")
    ap.add_argument("--fp8-weights", action="store_true",
                    help="keep the layer weights of an FP8 Orbax checkpoint in FP8 on the device")
    ap.add_argument("--speculative-tokens", type=int, default=0, help="MTP draft tokens per step (0 = off)")
    ap.add_argument("--prefix-cache", action="store_true", help="reuse the cache of shared prompt prefixes")
    ap.add_argument("--prefix-cache-gb", type=float, default=1.0, help="device memory of the prefix cache")
    ap.add_argument("--prefix-cache-outputs", action=argparse.BooleanOptionalAction, default=True,
                    help="cache generated tokens too (snapshots taken by decode steps at page boundaries), so a "
                         "conversation's next turn reuses the reply")
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on every route but /health (default: $LING_API_KEY)")
    ap.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                    "checkpoint directory's name)")
    ap.add_argument("--shutdown-grace", type=float, default=30.0,
                    help="seconds requests in flight may take to finish after SIGTERM")
    return ap


def _fail(msg: str, code: int) -> int:
    print(f"{_PROG}: {msg}", file=sys.stderr, flush=True)
    return code


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one). OSError where it cannot be bound."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class HTTPServer:
    """uvicorn serving an ASGI app on a bound socket from a thread of its own (so the caller's
    thread keeps its signal handlers). `start()` returns once it accepts connections."""

    def __init__(self, app: Any, sock: socket.socket, log_level: str = "info"):
        import uvicorn

        self.sock = sock
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="ling-serve-http",
                                       daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()


def drain(state: Any, engine: Any, grace_s: float, settle_s: float = 5.0) -> None:
    """Stops admitting (routes answer 503), lets the engine finish what it holds for up to `grace_s`
    (it cancels the rest), then waits up to `settle_s` for the responses to end."""
    state.draining = True
    engine.shutdown(grace_s)
    deadline = time.monotonic() + settle_s
    while state.inflight and time.monotonic() < deadline:
        time.sleep(0.02)


def _default_engine() -> Callable[..., Any]:
    from ling_jax.engine import Engine

    return Engine


def main(argv: list[str] | None = None, *, engine_cls: Callable[..., Any] | None = None) -> int:
    """The command; `engine_cls` (default `ling_jax.engine.Engine`) builds the engine from
    (config, params, **options)."""
    args = _parser().parse_args(argv)
    path = Path(args.checkpoint)
    if not path.is_dir():
        return _fail(f"--checkpoint {path}: " + ("not a directory" if path.exists() else "no such directory"), 2)
    for name, value, low in (("--port", args.port, 0), ("--max-batch", args.max_batch, 1),
                             ("--max-len", args.max_len, 2), ("--page-size", args.page_size, 1),
                             ("--max-waiting", args.max_waiting, 0), ("--prefill-chunk", args.prefill_chunk, 1),
                             ("--prefill-rows", args.prefill_rows, 1),
                             ("--decode-steps", args.decode_steps, 1), ("--compile-threads", args.compile_threads, 1),
                             ("--speculative-tokens", args.speculative_tokens, 0)):
        if value < low:
            return _fail(f"{name} {value}: must be >= {low}", 2)
    if any(not 1 <= n <= args.max_batch for n in args.decode_buckets):
        return _fail(f"--decode-buckets {','.join(map(str, args.decode_buckets))}: each must be in 1 .. "
                     f"--max-batch {args.max_batch}", 2)
    if args.decode_buckets and args.speculative_tokens:
        return _fail("--decode-buckets apply to plain decoding; a speculative step runs every slot", 2)
    if args.port > 65535:
        return _fail(f"--port {args.port}: must be <= 65535", 2)
    if not args.prefix_cache_gb > 0:
        return _fail(f"--prefix-cache-gb {args.prefix_cache_gb}: must be > 0", 2)
    if not args.shutdown_grace >= 0:
        return _fail(f"--shutdown-grace {args.shutdown_grace}: must be >= 0", 2)
    api_key = args.api_key if args.api_key is not None else os.environ.get("LING_API_KEY") or None
    if api_key is not None and not api_key.strip():
        return _fail("--api-key is empty", 2)
    codec = None
    if args.tokenizer:
        from serve.text import TextCodec

        try:
            codec = TextCodec.from_files(args.tokenizer, [path])
        except ValueError as e:
            return _fail(f"--tokenizer {e}", 2)
    from ling_jax.sharding import parse_mesh

    try:
        sizes = parse_mesh(args.mesh)
    except ValueError as e:
        return _fail(str(e), 2)
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}", 1)

    import jax

    import ling_jax
    from ling_jax.checkpoint.safetensors_io import CheckpointError
    from ling_jax.config import ConfigError
    from serve.app import create_app
    from serve.generate import load_any

    try:
        engine_cls = engine_cls or _default_engine()
    except ImportError as e:
        sock.close()
        return _fail(f"the serving engine cannot be imported: {e}", 1)
    try:
        mesh = ling_jax.make_mesh(**sizes) if sizes else None
        cfg, params = load_any(path, args.dtype, args.fp8_weights, mesh)
        engine = engine_cls(
            cfg, params, max_batch=args.max_batch, max_len=args.max_len, page_size=args.page_size, mesh=mesh,
            speculative_tokens=args.speculative_tokens, prefix_cache=args.prefix_cache,
            prefix_cache_gb=args.prefix_cache_gb, cache_outputs=args.prefix_cache_outputs,
            max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk,
            prefill_rows=args.prefill_rows, decode_steps=args.decode_steps, decode_buckets=args.decode_buckets)
        if args.warmup:
            print(f"{_PROG}: compiling the serving shapes", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            engine.warmup(progress=lambda done, total, name, s: print(
                f"{_PROG}: compiled {name} ({done}/{total}) in {s:.1f} s", file=sys.stderr, flush=True),
                compile_threads=args.compile_threads)
            print(f"{_PROG}: compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        engine.start()
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        sock.close()
        return _fail(str(e), 1)
    except jax.errors.JaxRuntimeError as e:
        sock.close()
        return _fail(f"the device failed: {str(e).splitlines()[0]}", 1)

    name = args.served_model_name or path.resolve().name
    app = create_app(engine, codec=codec, model_name=name, api_key=api_key)
    http = HTTPServer(app, sock)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            print(f"{_PROG}: second signal: exiting now", file=sys.stderr, flush=True)
            os._exit(1)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            http.start()
        except RuntimeError as e:
            engine.shutdown(0.0)
            return _fail(str(e), 1)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"{_PROG}: serving {name} on http://{host}:{http.port}", flush=True)
        while not stop.wait(0.5):
            if not http.thread.is_alive():
                engine.shutdown(0.0)
                return _fail("the HTTP server stopped", 1)
        print(f"{_PROG}: draining (up to {args.shutdown_grace:g} s for requests in flight)", flush=True)
        drain(app.state.server, engine, args.shutdown_grace)
        http.stop()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    print(f"{_PROG}: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
