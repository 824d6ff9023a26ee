"""Prefix caching: the full KV pages a request leaves behind, found again by their tokens.

When a request lets go of its pages (it finished, was aborted or retracted), each page that is
full of tokens whose KV the worker has computed becomes a cached block, keyed by its tokens and
by the block before it, so a key names the whole prefix up to and including that page (a chain
of exact keys, no hashes: nothing can collide). A new request whose prompt starts with cached
blocks borrows their pages, is granted them as its first pages, and prefills only the rest.
This is vLLM's automatic prefix caching at page granularity (SGLang's radix tree, with pages
for nodes); it pays where prompts share beginnings: a system prompt, or a chat's history.

Blocks nobody borrows stay until their pages are wanted: the scheduler counts them as free and
takes them back, least recently used first, when the free list runs short. Borrowed blocks are
never evicted. Pages are bookkeeping here as everywhere in the scheduler; the KV itself stays
where the worker wrote it, and the worker never learns that a page was shared.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

_ROOT = -1  # the parent of a prompt's first block


@dataclass(eq=False)
class CachedBlock:
    id: int
    key: tuple[int, tuple[int, ...]]  # (parent block id, this page's tokens)
    page: int
    refs: int = 0  # running requests that borrow it


class PrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._by_key: dict[tuple[int, tuple[int, ...]], CachedBlock] = {}
        self._unused: OrderedDict[int, CachedBlock] = OrderedDict()  # refs == 0, oldest first
        self._next_id = 0
        self.hit_tokens = 0  # admitted requests' tokens served from the cache, since start
        self.admitted_tokens = 0  # admitted requests' tokens, since start

    @property
    def num_blocks(self) -> int:
        return len(self._by_key)

    @property
    def num_evictable(self) -> int:
        return len(self._unused)

    def _key(self, parent: int, tokens: list[int], index: int) -> tuple[int, tuple[int, ...]]:
        ps = self.page_size
        return parent, tuple(tokens[index * ps:(index + 1) * ps])

    def match(self, tokens: list[int], max_tokens: int) -> list[CachedBlock]:
        """The cached blocks that start `tokens`, covering at most max_tokens of them (the
        caller keeps at least one token to compute: its logits give the first sample)."""
        blocks: list[CachedBlock] = []
        parent = _ROOT
        for i in range(max(0, max_tokens) // self.page_size):
            block = self._by_key.get(self._key(parent, tokens, i))
            if block is None:
                break
            blocks.append(block)
            parent = block.id
        return blocks

    def borrow(self, blocks: list[CachedBlock]) -> None:
        for block in blocks:
            if block.refs == 0:
                del self._unused[block.id]
            block.refs += 1

    def give_back(self, blocks: list[CachedBlock]) -> None:
        for block in blocks:
            block.refs -= 1
            assert block.refs >= 0, f"cached block {block.id} given back more often than borrowed"
            if block.refs == 0:
                self._unused[block.id] = block  # the most recently used end

    def release(self, tokens: list[int], pages: list[int], num_computed: int,
                borrowed: list[CachedBlock]) -> list[int]:
        """A request lets go of `pages` (its page i holds tokens[i * page_size ...]); the first
        len(borrowed) are the blocks it borrowed. Its full pages among the first num_computed
        tokens become cached blocks (or, where the same tokens are cached already, are
        returned); the rest are returned too. Returns the pages for the free list."""
        assert [b.page for b in borrowed] == pages[:len(borrowed)], "borrowed pages come first"
        free: list[int] = []
        chain = list(borrowed)
        full = min(num_computed, len(tokens)) // self.page_size
        for i in range(len(borrowed), len(pages)):
            page = pages[i]
            if i >= full:
                free.append(page)
                continue
            key = self._key(chain[-1].id if chain else _ROOT, tokens, i)
            block = self._by_key.get(key)
            if block is None:
                block = CachedBlock(self._next_id, key, page)
                self._next_id += 1
                self._by_key[key] = block
            else:  # another request cached these tokens first: keep one copy
                free.append(page)
            chain.append(block)
        for block in borrowed:
            block.refs -= 1
            assert block.refs >= 0, f"cached block {block.id} given back more often than borrowed"
        # Unborrowed blocks of the chain become the most recently used, its deepest evicted
        # first: a block is only found through its parent, so parents should outlive children.
        for block in reversed(chain):
            if block.refs == 0:
                self._unused[block.id] = block
                self._unused.move_to_end(block.id)
        return free

    def evict(self, n: int) -> list[int]:
        """Take back up to n unborrowed blocks, least recently used first; their pages.
        A block whose parent goes is never matched again and leaves in its turn."""
        pages = []
        while len(pages) < n and self._unused:
            _, block = self._unused.popitem(last=False)
            del self._by_key[block.key]
            pages.append(block.page)
        return pages
