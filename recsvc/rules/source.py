"""Item attributes that follow their file: a running server picks up a rewritten attributes.json (a stock list
that changes hourly) without a restart or a retraining. The file's modification time and size are checked at
most once per ``check_every_s``; a file that fails to load keeps the previous attributes (and is logged)."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from recsvc.rules.attributes import ItemAttributes
from recsvc.rules.catalog import RuleCatalog
from tokenizer_rqvae.trie import CatalogTrie

log = logging.getLogger(__name__)


class AttributeSource:
    def __init__(self, path: str | Path, trie: CatalogTrie, check_every_s: float = 1.0) -> None:
        self.path, self.trie, self.check_every_s = Path(path), trie, check_every_s
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._catalog = RuleCatalog(ItemAttributes.load(self.path), trie)  # UserError at start: fail loudly
        self._checked = time.monotonic()
        self.reloads = 0

    def over(self, trie: CatalogTrie) -> AttributeSource:
        """The same file's source over another trie (a live catalog's), starting from the attributes held now
        (no re-read: a file that is bad at this moment does not stop the catalog from changing)."""
        other = object.__new__(AttributeSource)
        other.path, other.trie, other.check_every_s = self.path, trie, self.check_every_s
        other._lock = threading.Lock()
        with self._lock:
            other._stamp, other._checked, other.reloads = self._stamp, self._checked, self.reloads
            other._catalog = RuleCatalog(self._catalog.attrs, trie)
        return other

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def current(self) -> RuleCatalog:
        """The catalog of the file as it is now (re-read when it changed since the last check)."""
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return self._catalog
        with self._lock:
            if now - self._checked < self.check_every_s:
                return self._catalog
            self._checked = now
            stamp = self._stat()
            if stamp is not None and stamp != self._stamp:
                try:
                    self._catalog = RuleCatalog(ItemAttributes.load(self.path), self.trie)
                    self.reloads += 1
                    log.info("item attributes reloaded from %s (%d attributes)", self.path,
                             len(self._catalog.names))
                except Exception as exc:  # a half-written or bad file: keep serving the previous attributes
                    log.warning("item attributes in %s not reloaded: %s", self.path, exc)
                self._stamp = stamp
            return self._catalog
