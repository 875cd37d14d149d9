"""A prefix cache across requests and turns, in the KV rows no running sequence holds.

When a sequence finishes, the KV of its tokens (prompt and output, all but the last token,
which was never fed) stays as an entry in the row it ends up in once the running sequences
are compacted into rows 0..N-1 (the engine swaps a finished row with the one moving into
it, instead of overwriting it). Admissions take the lowest free rows: an entry there moves
to a spare row, else gives way. A new prompt whose tokens start with an entry's copies those
columns into its own row (or finds them there already) and its prefill computes only the
rest: the n samples of a prompt sent as n requests, a conversation's next turn, a shared
system prompt. Running sequences' rows are sources too (read, never moved): a prompt can start
from a system prompt another request is still being answered after.

Exact: an entry holds the KV the target computed for exactly those tokens at those
positions under the weights it serves now: a weight update (and ``/flush_cache``) empties
the cache, and entries carry their weight version besides. The last prompt token is always
computed (its logits sample the first token). Outputs equal outputs without the cache;
logprobs to within float rounding (a prefix computed in another batch shape). Plain
Python: testable without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

RowCopy = Callable[[int, int, int], None]  # (src_row, dst_row, columns)
RowSwap = Callable[[int, int, int], None]  # (row_a, row_b, columns): exchanged


@dataclass
class Entry:
    row: int
    tokens: list[int]  # the tokens whose KV is in columns 0..len - 1 of ``row``
    version: str  # the weight version that computed it


@dataclass(frozen=True)
class PrefixStats:
    entries: int
    tokens: int  # held in entries
    hits: int  # prefills that reused an entry
    hit_tokens: int  # prompt tokens not computed thanks to the cache
    lookups: int


def salted(version: str, salt: str | None) -> str:
    """The key of KV computed under ``version`` for a request salted with ``salt`` (vLLM's
    ``cache_salt``): requests share cached prefixes only under the same salt."""
    return version if salt is None else f"{version}\x00{salt}"


class PrefixCache:
    def __init__(self, copy_row: RowCopy, min_tokens: int = 1,
                 swap_rows: RowSwap | None = None) -> None:
        self.copy_row = copy_row  # KV columns of one row into another (all layers)
        self.swap_rows = swap_rows  # exchanges two rows' columns: resolves copy cycles
        self.min_tokens = min_tokens  # shorter shared prefixes are computed again
        self.entries: dict[int, Entry] = {}  # by row
        self.hits = self.hit_tokens = self.lookups = 0

    def clear(self) -> None:
        """Forget every entry (new weights, ``/flush_cache``)."""
        self.entries.clear()

    # ---- admission ---------------------------------------------------------------------
    def admit(
        self, claims: Sequence[tuple[int, Sequence[int] | None]], version: str | Sequence[str],
        spare: Sequence[int], running: Sequence[Entry] = (),
    ) -> list[int]:
        """One step's admissions, (row, prompt) each (prompt None: a sibling, whose KV comes
        from its leader's row after the forward). Returns per claim how many columns of its
        prompt's KV its row holds now: the longest entry prefix, at most ``len(prompt) -
        1``, found there or copied in. Entries in admitted rows move to ``spare`` rows
        (free, not admitted) while there are some, else are dropped once read; every copy
        out of a row runs before the copy into it. Copies in a cycle (admitted rows holding
        each other's entries) are resolved by exchanging rows (``swap_rows``; without it the
        first of the cycle computes its prompt instead). ``version``: the key entries must
        carry, one for all claims or one per claim (``salted``). ``running``: the rows of running
        sequences as read-only sources, each with the tokens whose KV it holds (a system prompt
        or a conversation that is still being answered)."""
        rows = {row for row, _ in claims}
        keys = [version] * len(claims) if isinstance(version, str) else list(version)
        found = [*self.entries.values(), *running]
        best: list[tuple[Entry | None, int]] = [
            (None, 0) if p is None else self._longest(p, key, found)
            for (_, p), key in zip(claims, keys, strict=True)]
        for _, p in claims:
            self.lookups += p is not None
        in_place = {row for (row, _), (e, _) in zip(claims, best, strict=True)
                    if e is not None and e.row == row}
        for entry in [e for e in self.entries.values() if e.row in rows - in_place]:
            dest = next((r for r in reversed(spare) if r not in self.entries), None)
            if dest is not None:
                self.copy_row(entry.row, dest, len(entry.tokens))
                del self.entries[entry.row]
                entry.row = dest
                self.entries[dest] = entry
        got = [n for _, n in best]
        pending = [(i, e.row, row) for i, ((row, _), (e, _)) in enumerate(
            zip(claims, best, strict=True)) if e is not None and e.row != row]
        while pending:
            sources = [src for _, src, _ in pending]
            ready = [c for c in pending if sources.count(c[2]) == 0]
            if not ready:  # a cycle: its first exchanges rows (or, without, computes)
                i, src, dst = pending.pop(0)
                if self.swap_rows is None:
                    got[i] = 0
                else:  # the others read from where what each row held went
                    self.swap_rows(src, dst, max(got))
                    moved = {src: dst, dst: src}
                    pending = [(j, moved.get(s, s), d) for j, s, d in pending]
            for i, src, dst in ready:
                self.copy_row(src, dst, got[i])
                pending.remove((i, src, dst))
        self.hits += sum(n > 0 for n in got)
        self.hit_tokens += sum(got)
        for row in rows:
            self.entries.pop(row, None)  # running sequences hold them now
        return got

    def cached_len(self, prompt: Sequence[int], version: str,
                   running: Sequence[Entry] = ()) -> int:
        """How many of ``prompt``'s tokens an admission now would find cached (``admit``'s
        count, before any admission of the step moves entries)."""
        return self._longest(prompt, version, [*self.entries.values(), *running])[1]

    def _longest(self, prompt: Sequence[int], version: str,
                 sources: Sequence[Entry]) -> tuple[Entry | None, int]:
        """The source sharing the longest prefix with ``prompt`` (at most len - 1 tokens, at
        least ``min_tokens``) and that length; (None, 0) when none does."""
        best, best_len = None, 0
        limit = len(prompt) - 1
        for entry in sources:
            if entry.version != version:
                continue
            n = common_prefix(entry.tokens, prompt, limit)
            if n > best_len:
                best, best_len = entry, n
        if best_len < self.min_tokens:
            return None, 0
        return best, best_len

    # ---- release -----------------------------------------------------------------------
    def keep(self, tokens: list[int], row: int, version: str) -> None:
        """Keep the KV of ``tokens`` (columns 0..len - 1 of ``row``, a row no sequence holds
        now) as an entry; an entry it extends (a conversation's earlier turn) gives way. A
        sequence whose tokens an entry already starts with, or shorter than
        ``min_tokens``, is not kept."""
        if len(tokens) < self.min_tokens:
            return
        for entry in list(self.entries.values()):
            if entry.version != version:
                continue
            n = common_prefix(entry.tokens, tokens, len(tokens))
            if n == len(tokens):
                return
            if n == len(entry.tokens):
                del self.entries[entry.row]
        self.entries[row] = Entry(row, list(tokens), version)

    def stats(self) -> PrefixStats:
        return PrefixStats(len(self.entries), sum(len(e.tokens) for e in self.entries.values()),
                           self.hits, self.hit_tokens, self.lookups)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``: compared in blocks
    of ``_BLOCK`` tokens, so the work follows the common part, not the lengths (a prefill
    step compares every new prompt with every cached and running sequence)."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n:
        j = min(n, i + _BLOCK)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n


_BLOCK = 64
