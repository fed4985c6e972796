"""What every command-line tool (`ling-convert`, `ling-export`, `ling-generate`, `ling-train`,
`ling-demo`) shares: exit codes, the one error line, and the checks of paths given on a command line.

Exit codes: 0 success; 2 a usage error — the command line asks for what cannot be done as given (a
bad flag value, also one the input cannot take; a path on it that is missing, of the wrong kind or
already taken; a bad `--config` file); 1 a runtime failure — the work itself failed (a corrupt or
unreadable input, a device or disk error); 130 / 143 Ctrl-C / SIGTERM. A failing command writes one
line `<prog>: error: <what>` to stderr, never only a traceback.

Nothing here imports JAX: `--help` and usage errors never start a backend.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

EXIT_FAILURE, EXIT_USAGE = 1, 2


class UsageError(ValueError):
    """A request that cannot be run as given (a value or path of the caller's): commands exit 2 on it."""


class OutputExistsError(UsageError, FileExistsError):
    """The output path holds something the write must not replace."""


def exit_code(e: BaseException) -> int:
    """2 for a usage error, 1 for any other failure."""
    return EXIT_USAGE if isinstance(e, UsageError) else EXIT_FAILURE


def fail(prog: str, message: str, code: int) -> int:
    """Writes the command's one error line to stderr; returns `code` (the exit status)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def device_failed(prog: str, e: BaseException) -> int:
    """The error line of a device failure (e.g. out of device memory: the first line of XLA's message
    says what); exit 1."""
    return fail(prog, f"the device failed: {str(e).splitlines()[0]}", EXIT_FAILURE)


def existing_dir(flag: str, value: str | Path) -> Path:
    """`value` as a Path; UsageError naming `flag` unless it is an existing directory."""
    p = Path(value)
    if not p.is_dir():
        raise UsageError(f"{flag} {p}: " + ("not a directory" if p.exists() else "no such directory"))
    return p


def existing_file(flag: str, value: str | Path) -> Path:
    """`value` as a Path; UsageError naming `flag` unless it is an existing file."""
    p = Path(value)
    if not p.is_file():
        raise UsageError(f"{flag} {p}: " + ("not a file" if p.exists() else "no such file"))
    return p


def cpu_only() -> None:
    """Host-side tools never need an accelerator: keep JAX (imported by orbax) off it."""
    import os

    if "JAX_PLATFORMS" not in os.environ:
        import jax

        jax.config.update("jax_platforms", "cpu")


def limit_malloc_arenas(n: int = 2) -> None:
    """Caps glibc's malloc arenas (process-wide, so only the command-line tools call it).

    Tensorstore writes from many I/O threads; with glibc's default of up to 8 arenas per core,
    each keeps freed tensor-sized blocks resident, and the peak RSS then grows with the number of
    tensors. With 2 arenas the peak stays a small multiple of the largest tensor (BENCHMARKS.md,
    "Checkpoint conversion").
    No-op where `mallopt` is unavailable.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, n)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def run_command(prog: str, job: Callable[[], str], interrupted: str) -> int:
    """Runs a checkpoint command's job on the CPU with capped malloc arenas.

    `job` returns the line to report on success (exit 0). A ValueError (UsageError, CheckpointError,
    ConfigError) or OSError becomes one error line and exit 2 (usage) or 1 (failure); Ctrl-C exits
    130 with `interrupted` said.
    """
    cpu_only()
    limit_malloc_arenas()
    try:
        done = job()
    except (ValueError, OSError) as e:
        return fail(prog, str(e), exit_code(e))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {interrupted}", file=sys.stderr)
        return 130
    print(f"{prog}: {done}", file=sys.stderr)
    return 0
