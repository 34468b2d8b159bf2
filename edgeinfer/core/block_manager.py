"""BlockManager: the only allocator of KV cache blocks, with copy-free prefix sharing. Pure Python.

Owned and written by the scheduler alone; the model actor gets block tables and copy orders
through StepPlan messages. Calls that allocate *return* what the caller needs (an Allocation,
an AppendResult, or None when there are not enough blocks, in which case nothing changed).

Invariant. Every block id in ``range(num_blocks)`` is in exactly one state:
free (refcount 0, no hash, in the ``_free`` FIFO), cached (refcount 0, hashed, in the
``_evictable`` LRU, oldest first) or used (refcount = the number of block tables holding it,
hashed or not). ``_hash_to_block`` and ``_block_hash`` are inverse maps over hashed blocks. A
block gets a hash only once it is full *and* computed (``commit``), and nothing writes a full
block again: appends write a sequence's partial last block, which is copied first when another
sequence shares it (only ``fork`` shares partial blocks). So a hashed block's bytes never change
and any sequence with the same prefix may read it. The hash of block j chains the hash of block
j - 1 with block j's token ids, starting from a hash of ``namespace`` (the model and KV dtypes),
so equal hashes mean equal prefixes for the same model and format. New blocks come from the free
FIFO first, then by evicting the least recently freed cached block; a sequence frees its blocks
last to first so its tail is evicted before the prefix that other requests may still reuse.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Allocation:
    block_ids: tuple[int, ...]  # the sequence's block table
    num_cached_tokens: int  # leading tokens whose KV is already in the pool (prefix hits)


@dataclass(frozen=True)
class CopyOnWrite:
    src_block_id: int  # shared block, left to the other sequences
    dst_block_id: int  # this sequence's private copy; the model copies src -> dst before writing


@dataclass(frozen=True)
class AppendResult:
    block_ids: tuple[int, ...]  # the sequence's block table after the append
    copy: CopyOnWrite | None = None


@dataclass
class _Seq:
    block_ids: list[int]
    num_tokens: int  # token slots reserved
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its committed full blocks


class BlockManager:
    """Allocates ``num_blocks`` blocks of ``block_size`` token slots to sequences."""

    def __init__(self, num_blocks: int, block_size: int, namespace: str = "") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._root = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refcount = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._seqs: dict[Hashable, _Seq] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- counters --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unused blocks that still hold a reusable prefix (evicted when free blocks run out)."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        return self.num_free + self.num_cached

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def block_table(self, seq_id: Hashable) -> tuple[int, ...]:
        return tuple(self._get(seq_id).block_ids)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Pool slots (block_id * block_size + offset) of token positions ``start:end``."""
        ids, bs = self._get(seq_id).block_ids, self.block_size
        return [ids[t // bs] * bs + t % bs for t in range(start, end)]

    # ---- allocation ------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        """Whether a new sequence of ``num_tokens`` fits with ``reserve`` blocks left (watermark)."""
        return -(-num_tokens // self.block_size) + reserve <= self.num_available

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], use_cache: bool = True) -> Allocation | None:
        """Give a new sequence blocks for all its tokens, reusing cached prefix blocks unless
        ``use_cache`` is False (it needs every position computed: prompt logprobs)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not token_ids:
            raise ValueError("allocate needs at least one token")
        bs, num_tokens = self.block_size, len(token_ids)
        hits: list[int] = []
        hashes: list[bytes] = []
        # The last token must be computed (its logits are needed), so its block is never a hit.
        for j in range((num_tokens - 1) // bs if use_cache else 0):
            h = self._hash(hashes[-1] if hashes else self._root, token_ids[j * bs:(j + 1) * bs])
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
        num_new = -(-num_tokens // bs) - len(hits)
        num_revived = sum(1 for b in hits if self._refcount[b] == 0)
        if num_new > self.num_available - num_revived:
            return None
        for b in hits:
            if self._refcount[b] == 0:
                del self._evictable[b]
            self._refcount[b] += 1
        block_ids = hits + [self._take_block() for _ in range(num_new)]
        self._seqs[seq_id] = _Seq(block_ids, num_tokens, hashes)
        self.num_queried_tokens += num_tokens if use_cache else 0
        self.num_hit_tokens += len(hits) * bs
        return Allocation(tuple(block_ids), len(hits) * bs)

    def can_append(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        return self._append_need(self._get(seq_id), num_new_tokens) <= self.num_available

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> AppendResult | None:
        """Reserve slots for ``num_new_tokens`` more tokens; copy-on-write a shared partial block."""
        seq = self._get(seq_id)
        if self._append_need(seq, num_new_tokens) > self.num_available:
            return None
        copy = None
        if self._last_block_shared(seq):
            src = seq.block_ids[-1]
            dst = self._take_block()
            self._refcount[src] -= 1  # still >= 1: another sequence holds it
            seq.block_ids[-1] = dst
            copy = CopyOnWrite(src, dst)
        seq.num_tokens += num_new_tokens
        while len(seq.block_ids) * self.block_size < seq.num_tokens:
            seq.block_ids.append(self._take_block())
        return AppendResult(tuple(seq.block_ids), copy)

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Record that the first ``num_computed_tokens`` of ``token_ids`` are in the pool: their
        full blocks become shareable prefix blocks. Call after each step that computed tokens."""
        seq = self._get(seq_id)
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids), seq.num_tokens) // bs
        for j in range(len(seq.hashes), num_full):
            h = self._hash(seq.hashes[-1] if seq.hashes else self._root, token_ids[j * bs:(j + 1) * bs])
            seq.hashes.append(h)
            block = seq.block_ids[j]
            # Another block may already hold this prefix (computed concurrently): keep that one.
            if self._block_hash[block] is None and h not in self._hash_to_block:
                self._block_hash[block] = h
                self._hash_to_block[h] = block

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> tuple[int, ...]:
        """Share all the parent's blocks with a new child (n > 1, beam search); returns its table."""
        if child_seq_id in self._seqs:
            raise ValueError(f"sequence {child_seq_id!r} already has blocks")
        parent = self._get(parent_seq_id)
        for b in parent.block_ids:
            self._refcount[b] += 1
        self._seqs[child_seq_id] = _Seq(list(parent.block_ids), parent.num_tokens, list(parent.hashes))
        return tuple(parent.block_ids)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks (finished, aborted or preempted)."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for b in reversed(seq.block_ids):
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if self._block_hash[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None  # most recently used end

    def check_invariants(self) -> None:
        """Assert the module invariant (tests and debugging)."""
        counts = [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(seq.block_ids) == -(-seq.num_tokens // self.block_size)
            for b in seq.block_ids:
                counts[b] += 1
        assert counts == self._refcount, "refcounts differ from block-table membership"
        free, cached = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & cached
        for b in range(self.num_blocks):
            used = self._refcount[b] > 0
            assert used + (b in free) + (b in cached) == 1, f"block {b} is in more or fewer than one state"
            assert (b in cached) <= (self._block_hash[b] is not None)
            assert (b in free) <= (self._block_hash[b] is None)
        assert {self._hash_to_block[h] for h in self._hash_to_block} == {
            b for b in range(self.num_blocks) if self._block_hash[b] is not None}
        assert all(self._block_hash[b] == h for h, b in self._hash_to_block.items())

    # ---- internals -------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no blocks") from None

    def _hash(self, parent: bytes, token_ids: Sequence[int]) -> bytes:
        return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)  # least recently used cached block
            del self._hash_to_block[self._block_hash[block]]
            self._block_hash[block] = None
        self._refcount[block] = 1
        return block

    def _last_block_shared(self, seq: _Seq) -> bool:
        partial = seq.num_tokens % self.block_size != 0
        return partial and self._refcount[seq.block_ids[-1]] > 1

    def _append_need(self, seq: _Seq, num_new_tokens: int) -> int:
        blocks = -(-(seq.num_tokens + num_new_tokens) // self.block_size) - len(seq.block_ids)
        return blocks + self._last_block_shared(seq)
