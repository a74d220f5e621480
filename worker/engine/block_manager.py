"""Paged KV cache bookkeeping: which block holds which tokens, with prefix caching (pure, no torch).

A block that nobody references goes back to the free list but keeps its prefix hash, so a later prompt with
the same prefix can take it back until the block is handed out for something else (oldest freed first).
Hashes are registered only for blocks that are full *and* computed, so a hit never reads K/V that a chunked
prefill has not written yet, and whose tokens are all known: with async scheduling a block may be computed from a
token the host has not read yet (UNKNOWN_TOKEN), and its hash waits until that token is filled in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

from tidal.worker.engine.sequence import UNKNOWN_TOKEN, Sequence


class Block(NamedTuple):
    """One block's bookkeeping as it stands (a snapshot: `BlockManager.blocks`)."""

    block_id: int
    ref_count: int
    prefix_hash: int | None
    # The tokens the hash was computed from, compared on a hit so a hash collision can never mix sequences.
    token_ids: tuple[int, ...]


class BlockView:
    """The manager's blocks, read-only, as `Block` snapshots by id."""

    def __init__(self, manager: BlockManager) -> None:
        self._manager = manager

    def __len__(self) -> int:
        return self._manager.num_blocks

    def __getitem__(self, block_id: int) -> Block:
        if not 0 <= block_id < len(self):
            raise IndexError(f"block {block_id} is not in [0, {len(self)})")
        m = self._manager
        return Block(block_id, m._ref_counts[block_id], m._prefix_hashes[block_id], m._block_tokens[block_id])

    def __iter__(self) -> Iterator[Block]:
        return (self[b] for b in range(len(self)))


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Per block, in lists of plain values rather than an object each: the garbage collector tracks every
        # object that can hold references, and a full collection walks them all while no step runs. An FP8 cache
        # on an H200 has 113k blocks of an 8B model, which as objects would each add to every full collection.
        self._ref_counts = [0] * num_blocks
        self._prefix_hashes: list[int | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...]] = [()] * num_blocks
        # Unreferenced blocks in the order they were freed; values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # prefix hash -> block id
        self.num_usable = num_blocks  # blocks [num_usable, num_blocks) have no memory now (set_num_usable)
        self.num_prefix_hit_tokens = 0  # since start

    # ----- queries -----
    @property
    def blocks(self) -> BlockView:
        return BlockView(self)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_usable

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether blocks for all of `seq`'s tokens (prefix hits included) can be had now."""
        hits = self._prefix_hits(seq)
        num_revived = sum(1 for b in hits if self._ref_counts[b] == 0)
        num_new = self.num_blocks_for(seq.num_tokens) - len(hits)
        return num_new + num_revived <= len(self._free)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the cache can grow to hold `num_new_tokens` more computed tokens of a running `seq`."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= len(self._free)

    def can_fork(self, parent: Sequence) -> bool:
        """Whether `fork(parent, ...)` has the block it may need now."""
        return parent.num_computed_tokens % self.block_size == 0 or len(self._free) >= 1

    # ----- changes -----
    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` the K/V of `parent`'s computed tokens without computing them again (n samples of one prompt).
        Full blocks are shared (one more reference each); they never change again. A partly filled last block would
        be written by the next token of each, so the child gets a fresh block for it, copy-on-write done at once since
        that write always follows: -> (source, destination) whose K/V the caller copies, or None when the computed
        tokens end on a block boundary. The child's tokens must be the parent's already."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.seq_id} already holds blocks")
        num_full = parent.num_computed_tokens // self.block_size
        shared = parent.block_table[:num_full]
        for block_id in shared:
            self._take(block_id)
        child.block_table = shared
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        if parent.num_computed_tokens % self.block_size == 0:
            return None
        copy = self._take_fresh()
        child.block_table.append(copy)
        return parent.block_table[num_full], copy

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting `seq` blocks for all its tokens; prefix hits become already-computed tokens."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._prefix_hits(seq)
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        seq.block_hashes = [self._prefix_hashes[b] for b in hits]  # type: ignore[misc]
        seq.num_computed_tokens = len(hits) * self.block_size
        self.num_prefix_hit_tokens += seq.num_computed_tokens
        for _ in range(self.num_blocks_for(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_fresh())

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow a running `seq`'s blocks to hold `num_new_tokens` more computed tokens."""
        if not self.try_append(seq, num_new_tokens):
            raise RuntimeError("out of KV cache blocks (the scheduler should have checked)")

    def try_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """`append` if the cache has the blocks; -> whether it had (nothing changes when not)."""
        table = seq.block_table
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if needed <= 0:  # the usual decode step: the token fits the last block
            return True
        if needed > len(self._free):
            return False
        for _ in range(needed):
            table.append(self._take_fresh())
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the prefix hashes of `seq`'s blocks that became full and computed and hold only known tokens
        (a later commit picks up a block skipped for an unknown token)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if UNKNOWN_TOKEN in tokens:
                return  # hashes chain: no later block can be registered before this one
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            if h in self._cached:
                continue  # another block already holds these tokens; keep the first
            block_id = seq.block_table[i]
            self._prefix_hashes[block_id] = h
            self._block_tokens[block_id] = tokens
            self._cached[h] = block_id

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; the tail goes on the free list first so it is evicted before the prefix."""
        ref_counts = self._ref_counts
        for block_id in reversed(seq.block_table):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (the KV it points at was dropped, or computed with other weights).
        Blocks in use stay in use. -> how many cached blocks were forgotten."""
        num_forgotten = len(self._cached)
        self._cached.clear()
        self._prefix_hashes = [None] * self.num_blocks
        self._block_tokens = [()] * self.num_blocks
        return num_forgotten

    def set_num_usable(self, num_usable: int) -> None:
        """Hand out only blocks [0, num_usable): the others have no memory behind them now (a wake maps the KV
        cache's first share before the rest). Blocks taken out must be unused; they lose any cached prefix."""
        if not 1 <= num_usable <= self.num_blocks:
            raise ValueError(f"num_usable must be in [1, {self.num_blocks}], got {num_usable}")
        if len(self._free) == self.num_usable and not self._cached:
            # The usual case (a wake: nothing runs, the prefix cache was reset): no per-block checks needed.
            self._free = OrderedDict.fromkeys(range(num_usable))
            self.num_usable = num_usable
            return
        dropped = range(num_usable, self.num_usable)
        busy = [b for b in dropped if self._ref_counts[b] > 0]
        if busy:
            raise RuntimeError(f"{len(busy)} blocks to take out of use are held by sequences (first: {busy[0]})")
        for block_id in dropped:
            del self._free[block_id]
            self._forget_prefix(block_id)
        for block_id in range(self.num_usable, num_usable):
            self._free[block_id] = None
        self.num_usable = num_usable

    # ----- internals -----
    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks equal to `seq`'s leading full blocks. The last token is never a hit: its logits are
        needed, so at least one token must be computed. None for a sequence that needs every prompt position's
        logits (prompt logprobs): a cached block has no logits."""
        if not self.enable_prefix_caching or seq.params.needs_prompt_logits:
            return []
        hits: list[int] = []
        parent: int | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is None or self._block_tokens[block_id] != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def _take(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _take_fresh(self) -> int:
        if not self._free:
            raise RuntimeError("out of KV cache blocks (the scheduler should have checked)")
        block_id, _ = self._free.popitem(last=False)
        self._forget_prefix(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _forget_prefix(self, block_id: int) -> None:
        """The block's contents are about to change (or lose their memory): its prefix can no longer be a hit."""
        prefix_hash = self._prefix_hashes[block_id]
        if prefix_hash is not None and self._cached.get(prefix_hash) == block_id:
            del self._cached[prefix_hash]
        self._prefix_hashes[block_id] = None
        self._block_tokens[block_id] = ()
