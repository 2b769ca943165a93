"""The host side of the paged KV cache: which page ids are free, which are in use and by
how many sequences, and (automatic prefix caching, vLLM's) which tokens a full page holds.

A full page is keyed by the hash of the tokens it holds and of everything before them
(``page_keys``: sha-256 chained over the pages, so equal keys mean equal prefixes and a
collision is not a practical concern). A sequence registers each page once it is full;
a new request looks up the keys of its prompt's full pages and shares the longest run
found (``lookup``), prefilling only the rest. A page whose last user leaves keeps its key
and stays cached, evictable, until the pool needs a page (least recently released
first); a page without a key goes straight back to the free list.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def page_keys(tokens: Sequence[int], page_size: int, pages: int, parent: bytes = b"") -> list[bytes]:
    """The keys of the first ``pages`` full pages of ``tokens``: page ``i``'s is the hash
    of page ``i - 1``'s key (``parent`` for the first: the key of the pages before
    ``tokens``, if any) and its own ``page_size`` tokens."""
    keys = []
    ids = np.asarray(tokens[:pages * page_size], np.int64)
    for i in range(pages):
        parent = hashlib.sha256(parent + ids[i * page_size:(i + 1) * page_size].tobytes()).digest()
        keys.append(parent)
    return keys


class PagePool:
    """Page ids ``1 .. pages - 1`` (0 is the null page), reference-counted; with
    ``caching``, full pages keep their key after their last user (above)."""

    def __init__(self, pages: int, caching: bool = True):
        if pages < 2:
            raise ValueError(f"a paged KV cache needs at least 2 pages (one is the null page), got {pages}")
        self.total, self.caching = pages - 1, caching
        self._free = list(range(pages - 1, 0, -1))  # pop() hands out the lowest first
        self._users: dict[int, int] = {}  # page -> sequences holding it (pages in use only)
        self._key_of: dict[int, bytes] = {}  # page -> its key (registered pages)
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages no one holds, oldest first

    @property
    def free(self) -> int:
        """Pages ``take`` can hand out: free ones and cached ones no one holds."""
        return len(self._free) + len(self._idle)

    @property
    def cached(self) -> int:
        """Pages holding a key (in use or idle)."""
        return len(self._key_of)

    def take(self, count: int) -> list[int]:
        """``count`` pages for one new user each, free ones first, then the least recently
        released cached ones (their keys forgotten)."""
        if count > self.free:
            raise ValueError(f"{count} pages asked for, {self.free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._users[page] = 1
            pages.append(page)
        return pages

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of ``keys`` cached, each now held by one more user."""
        pages = []
        for key in keys if self.caching else ():
            page = self._page_of.get(key)
            if page is None:
                break
            if page in self._idle:
                del self._idle[page]
            self._users[page] = self._users.get(page, 0) + 1
            pages.append(page)
        return pages

    def cached_run(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are cached (nothing taken)."""
        count = 0
        for key in keys if self.caching else ():
            if key not in self._page_of:
                break
            count += 1
        return count

    def register(self, page: int, key: bytes) -> None:
        """``page`` (in use) holds the tokens ``key`` stands for. A key already held by
        another page keeps that one (this page stays unkeyed: freed, it is just free)."""
        if self.caching and key not in self._page_of and page not in self._key_of:
            self._page_of[key], self._key_of[page] = page, key

    def release(self, pages: Sequence[int]) -> None:
        """One user fewer for each of ``pages``; a page left with none is cached (keyed)
        or free."""
        for page in reversed(pages):  # the tail first: it is the least likely to be shared
            left = self._users[page] - 1
            if left:
                self._users[page] = left
                continue
            del self._users[page]
            if page in self._key_of:
                self._idle[page] = None
            else:
                self._free.append(page)
