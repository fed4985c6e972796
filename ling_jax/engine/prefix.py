"""The prefix cache's index: prompt and output pages shared by reference count, KDA state snapshots at
page boundaries, both evicted least recently used first.

Pages are named by a hash chain over their tokens (page i's key hashes page i-1's key and its own K
token ids), so a key names the whole prefix up to the end of its page. A page in the index holds the
MLA latents of those K positions; it is never written again (later tokens go to later pages), so any
request whose prompt starts with the same tokens may read it. The recurrent KDA layers cannot share
anything but whole states: a snapshot is the KDA state and conv windows of every layer after the
prefix ending at a page boundary, kept in a device store of a fixed number of rows (what
`--prefix-cache-gb` buys). A hit is the deepest boundary that has both every page and a snapshot;
the request then restores the snapshot and prefills only the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def page_keys(prompt: Sequence[int] | np.ndarray, page_size: int) -> list[bytes]:
    """The chain keys of the prompt's full pages, in order."""
    ids = np.asarray(prompt, np.int64)
    keys, prev = [], b""
    for i in range(len(ids) // page_size):
        prev = hashlib.blake2b(prev + ids[i * page_size:(i + 1) * page_size].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclasses.dataclass
class Hit:
    """What a request reuses: `length` prompt tokens, in `pages` (shared), from snapshot row `row`."""

    length: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None

    def __bool__(self) -> bool:
        """A miss (nothing reused) is false."""
        return self.length > 0


class PrefixIndex:
    """Host bookkeeping of cached pages and snapshots (module doc).

    `refs[page]`: running requests reading an indexed page; pages with none are evictable. Snapshot
    rows are the device store's rows; the index never holds a snapshot deeper than its pages, and a
    row an admitted request has yet to restore (`pinned`) is not reused.
    """

    def __init__(self, page_size: int, snapshot_rows: int):
        self.page_size = page_size
        self.pages: OrderedDict[bytes, int] = OrderedDict()  # key -> page, least recently used first
        self.depth: dict[bytes, int] = {}  # key -> its page's index in the prefix (0, 1, ...)
        self.refs: dict[int, int] = {}  # indexed page -> running readers
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # key -> store row
        self.free_rows = list(range(snapshot_rows - 1, -1, -1))
        self.pinned: dict[int, int] = {}  # store row -> admitted requests yet to restore it
        self.counters = {"prefix_hits": 0, "prefix_misses": 0, "prefix_cached_tokens": 0,
                         "prefix_page_evictions": 0, "prefix_snapshot_evictions": 0, "prefix_output_snapshots": 0}

    def lookup(self, prompt: np.ndarray) -> Hit:
        """The deepest reusable prefix of `prompt`: a boundary below its last token with every page
        and a snapshot (the last token is always prefilled: its logits give the first new token).
        Marks what it returns as recently used; the caller `acquire`s it, and `count`s it once the
        request is admitted (a request waiting for pages looks up again)."""
        keys = page_keys(prompt[:len(prompt) - 1], self.page_size)
        best = 0
        for i, key in enumerate(keys):
            if key not in self.pages:
                break
            if key in self.snapshots:
                best = i + 1
        if best == 0:
            return Hit()
        for key in reversed(keys[:best]):  # a page is used more recently than those after it: leaves go first
            self.pages.move_to_end(key)
        self.snapshots.move_to_end(keys[best - 1])
        return Hit(best * self.page_size, [self.pages[k] for k in keys[:best]], self.snapshots[keys[best - 1]])

    def count(self, hit: Hit) -> None:
        """Counts an admitted request's lookup: a hit (and its cached tokens) or a miss."""
        if hit.length:
            self.counters["prefix_hits"] += 1
            self.counters["prefix_cached_tokens"] += hit.length
        else:
            self.counters["prefix_misses"] += 1

    def acquire(self, hit: Hit) -> None:
        """A request reads `hit`: its pages and its snapshot row stay until `release` / `restored`."""
        for p in hit.pages:
            self.refs[p] += 1
        if hit.row is not None:
            self.pinned[hit.row] = self.pinned.get(hit.row, 0) + 1

    def restored(self, row: int) -> None:
        """A request has copied snapshot `row` (or gave up on it): the row may be reused."""
        self.pinned[row] -= 1
        if not self.pinned[row]:
            del self.pinned[row]

    def release(self, pages: list[int]) -> list[int]:
        """A request stops reading `pages`: returns those not in the index (the caller frees them)."""
        private = []
        for p in pages:
            if p in self.refs:
                self.refs[p] -= 1
            else:
                private.append(p)
        return private

    def add_pages(self, keys: list[bytes], pages: list[int]) -> list[int]:
        """Indexes a request's full pages (key i names page i); a key already indexed keeps its page (the
        request's copy stays private). Returns the pages now indexed (the request holds a reference)."""
        shared = []
        for i, (key, page) in enumerate(zip(keys, pages, strict=False)):
            if key in self.pages or page in self.refs:
                continue
            self.pages[key], self.depth[key], self.refs[page] = page, i, 1
            shared.append(page)
        for key in reversed(keys):  # as in `lookup`: a prefix's later pages are evicted before its earlier
            if key in self.pages:
                self.pages.move_to_end(key)
        return shared

    def snapshot_row(self, key: bytes) -> int | None:
        """A store row for a snapshot after the prefix `key` (a key of the index's pages): None if it has
        one already; the least recently used snapshot gives its row where none is free."""
        if key in self.snapshots or key not in self.pages:
            return None
        row = self.take_row()
        if row is not None:
            self.snapshots[key] = row
        return row

    def take_row(self) -> int | None:
        """A store row for a snapshot whose prefix is not known yet (a decode step's, `put_snapshot` or
        `free_row` later): a free row, or the least recently used unpinned snapshot's; None if none."""
        if not self.free_rows:
            old = next((k for k, r in self.snapshots.items() if r not in self.pinned), None)
            if old is None:
                return None
            self.free_rows.append(self.snapshots.pop(old))
            self.counters["prefix_snapshot_evictions"] += 1
        return self.free_rows.pop()

    def free_row(self, row: int) -> None:
        """Gives back a row from `take_row` that holds no snapshot to keep."""
        self.free_rows.append(row)

    def put_snapshot(self, key: bytes, row: int) -> bool:
        """Indexes row `row` (from `take_row`) as the snapshot after the prefix `key`; False (the row given
        back) where `key` has one already or is not an indexed page's."""
        if key in self.snapshots or key not in self.pages:
            self.free_rows.append(row)
            return False
        self.snapshots[key] = row
        return True

    def drop_snapshot(self, key: bytes) -> None:
        """Removes the snapshot after `key` (a shallower one its request has passed), unless an admitted
        request is yet to restore it."""
        row = self.snapshots.get(key)
        if row is not None and row not in self.pinned:
            del self.snapshots[key]
            self.free_rows.append(row)

    def evictable(self) -> int:
        return sum(1 for p in self.pages.values() if self.refs[p] == 0)

    def evict(self, n: int) -> list[int]:
        """Up to n pages no running request reads, least recently used first, out of the index (with the
        snapshots at or past them: a prefix missing a page cannot be reused)."""
        freed = []
        for key, page in list(self.pages.items()):
            if len(freed) == n:
                break
            if self.refs[page]:
                continue
            del self.pages[key], self.refs[page], self.depth[key]
            freed.append(page)
            self.counters["prefix_page_evictions"] += 1
        if freed:
            for key in [k for k in self.snapshots if k not in self.pages]:
                self.free_rows.append(self.snapshots.pop(key))
        return freed
