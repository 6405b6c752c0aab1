"""The KV block pool, host side: which blocks hold whose KV, how many sequences hold each, and the prefix index.

A block holds the KV of `block_size` consecutive positions of a sequence. Sequences hold blocks by reference
(`acquire` / `release`); a block that no sequence holds is either free or *cached*: it still holds the KV of a
registered full block and can be found again by content (`match`), until it is evicted (least recently released
first) to make room. Block 0 is the null block: never handed out, it takes the writes of padding positions.

The prefix index is exact: a full block is registered under (its predecessor's identity, its token ids), where a
block's identity is (block id, incarnation) and the incarnation changes whenever the block is reused, so a
registration can never point at KV that was overwritten (no hash that could collide: the key is the content itself).
A block is registered only once every position of it has been written.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

#: the block that padding positions write to; never held by a sequence
NULL_BLOCK = 0

Identity = tuple[int, int]  #: a block's (id, incarnation): what its successors' keys name
BlockKey = tuple  #: (predecessor identity or None, token ids)
#: how far a sequence's blocks are registered: (the pool's epoch then, blocks registered, the identity the next
#: block chains to)
ChainPoint = tuple[int, int, "Identity | None"]


class BlockPool:
    """Reference-counted KV blocks with an exact prefix index and LRU eviction of unreferenced cached blocks.

    Invariants (property-tested): every block but the null block is exactly one of free, cached (unreferenced,
    registered) or held (``refs > 0``); a block's `refs` equals the number of holders that acquired it and have not
    released it; the index maps each key to one registered block whose key it is.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need num_blocks >= 2 (one is the null block) and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        self.refs = [0] * num_blocks
        self.incarnation = [0] * num_blocks
        self.key: list[BlockKey | None] = [None] * num_blocks
        self.index: dict[BlockKey, int] = {}
        self._free: deque[int] = deque(range(1, num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.evictions = 0
        self.epoch = 0  #: flushes so far: a sequence admitted before the last one registers nothing more

    # ------------------------------------------------------------------------------------------ counts
    @property
    def available(self) -> int:
        """Blocks a sequence can get now: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        return len(self._cached)

    @property
    def held(self) -> int:
        return self.num_blocks - 1 - self.available

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    # ------------------------------------------------------------------------------------------ prefix index
    def match(self, tokens: Sequence[int], limit: int, known: Sequence[Identity] = ()) -> list[int]:
        """The registered blocks holding the KV of the leading full blocks of `tokens`, within its first `limit`
        tokens (nothing is acquired). `known`: the identities an earlier match of the same tokens found; those still
        registered as they were are taken without looking their tokens up (a sequence that waits is matched again
        at every prefill pass)."""
        if not self.prefix_cache:
            return []
        bs, found, parent = self.block_size, [], None
        for block, incarnation in known[:limit // bs]:
            if self.incarnation[block] != incarnation or self.key[block] is None:  # unregistered since
                break
            found.append(block)
            parent = block, incarnation
        for start in range(len(found) * bs, limit - bs + 1, bs):
            block = self.index.get((parent, tuple(tokens[start:start + bs])))
            if block is None:
                break
            found.append(block)
            parent = self.identity(block)
        return found

    def match_partial(self, tokens: Sequence[int], parent: int | None, start: int, limit: int) -> tuple[int, int]:
        """A cached partial block continuing the chain after `parent` (the last block `match` found, None for the
        first) with the longest run of ``tokens[start:limit]`` a released sequence left in it: (block, tokens
        it holds), or (0, 0). Only unreferenced blocks qualify: the caller takes it over (`take`) and writes on."""
        if not self.prefix_cache:
            return NULL_BLOCK, 0
        ident = None if parent is None else self.identity(parent)
        for n in range(min(self.block_size - 1, limit - start), 0, -1):
            block = self.index.get((ident, tuple(tokens[start:start + n])))
            if block is not None and self.refs[block] == 0:
                return block, n
        return NULL_BLOCK, 0

    def identity(self, block: int) -> Identity:
        """What a registered block's successors are keyed under: (block, incarnation)."""
        return block, self.incarnation[block]

    def chain_after(self, matched: Sequence[int]) -> ChainPoint:
        """Where a sequence's chain stands once `match` found `matched` (its first blocks, registered already)."""
        return self.epoch, len(matched), self.identity(matched[-1]) if matched else None

    def register(self, blocks: Sequence[int], tokens: Sequence[int], written: int, partial: bool = False,
                 start: ChainPoint | None = None) -> ChainPoint:
        """Register the full blocks among the first `written` positions of a sequence holding `blocks` for
        `tokens`; with `partial` (a sequence ending), also its last, partly written block, which a continuation
        of the same tokens can take over (`match_partial`). A block whose content is registered already (another
        sequence's identical block) stays unregistered, and the chain continues through the registered one.
        `start`: where an earlier call (or `chain_after`) left this sequence's chain, None for nothing registered
        yet; returns where this call leaves it. The work is the blocks after `start` (a turn's release registers
        that turn's blocks, not the conversation's). A sequence whose chain began before a `clear` registers
        nothing: its KV was computed with the weights the flush dropped."""
        epoch, first, parent = start if start is not None else (self.epoch, 0, None)
        if not self.prefix_cache or epoch != self.epoch:
            return epoch, first, parent
        bs = self.block_size
        full = min(written // bs, len(blocks))
        for i in range(first, full):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            block = self.index.get(key)
            if block is None:
                block = blocks[i]
                if self.key[block] is not None:  # registered under another chain: leave it, stop here
                    return epoch, i, parent
                self.index[key], self.key[block] = block, key
            parent = self.identity(block)
        if partial and full < len(blocks) and written % bs and full == written // bs:
            block, key = blocks[full], (parent, tuple(tokens[full * bs:written]))
            if self.key[block] is None and self.refs[block] == 1 and key not in self.index:
                self.index[key], self.key[block] = block, key
        return epoch, max(first, full), parent

    def take(self, block: int) -> None:
        """Hold a cached partial block (from `match_partial`) to write on: it leaves the index and the LRU."""
        del self._cached[block]
        del self.index[self.key[block]]
        self.key[block] = None
        self.incarnation[block] += 1
        self.refs[block] = 1

    def forget(self, blocks: Sequence[int]) -> None:
        """Unregister `blocks` (their KV is not what their key says, e.g. the pass that wrote it failed)."""
        for block in blocks:
            self._unregister(block)

    def clear(self) -> None:
        """Unregister every block (new weights: no cached KV may be reused); cached blocks become free, and the
        sequences holding blocks now register none later (`register`)."""
        for block in list(self.index.values()):
            self._unregister(block)
        self.epoch += 1

    # ------------------------------------------------------------------------------------------ holding
    def acquire(self, blocks: Sequence[int]) -> None:
        """Hold `blocks` (found by `match`) once more each."""
        for block in blocks:
            if self.refs[block] == 0:
                del self._cached[block]
            self.refs[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks, held once each (evicting cached blocks as needed), or None when fewer are available."""
        if n > self.available:
            return None
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)  # the least recently released
                del self.index[self.key[block]]
                self.key[block] = None
                self.evictions += 1
            self.incarnation[block] += 1
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold of each of `blocks`. A block no longer held stays cached if registered (the last block
        of a sequence is released first, so it is evicted before the ones it follows), else it is free."""
        for block in reversed(blocks):
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} is not held")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.key[block] is not None:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def _unregister(self, block: int) -> None:
        key = self.key[block]
        if key is None:
            return
        del self.index[key]
        self.key[block] = None
        self.incarnation[block] += 1  # keys registered after it (its successors) can no longer match
        if block in self._cached:
            del self._cached[block]
            self._free.append(block)
