"""BlockManager: exact block ids on a tiny pool, prefix sharing, eviction, copy-on-write, no leaks."""

import random

import pytest

from edgeinfer.core.block_manager import AppendResult, BlockManager, CopyOnWrite


def make() -> BlockManager:
    return BlockManager(num_blocks=8, block_size=4, namespace="test-model:int8/int8")


def test_allocate_and_free_exact_ids():
    bm = make()
    a = bm.allocate("a", list(range(10)))
    assert a.block_ids == (0, 1, 2) and a.num_cached_tokens == 0
    b = bm.allocate("b", list(range(100, 105)))
    assert b.block_ids == (3, 4)
    assert (bm.num_free, bm.num_used, bm.num_cached) == (3, 5, 0)
    bm.free("a")  # freed last block first: free FIFO is now 5, 6, 7, 2, 1, 0
    c = bm.allocate("c", list(range(200, 216)))
    assert c.block_ids == (5, 6, 7, 2)
    assert bm.allocate("d", list(range(300, 309))) is None  # 3 blocks needed, 2 free: no change
    assert (bm.num_free, bm.num_used) == (2, 6)
    assert bm.allocate("d", list(range(300, 305))).block_ids == (1, 0)
    assert bm.slot_mapping("d", 2, 6) == [6, 7, 0, 1]
    bm.check_invariants()


def test_can_allocate_watermark():
    bm = make()
    assert bm.can_allocate(32) and not bm.can_allocate(33)
    assert bm.can_allocate(24, reserve=2) and not bm.can_allocate(25, reserve=2)


def test_append_slots_grows_at_block_boundaries():
    bm = make()
    bm.allocate("a", [1, 2, 3])
    assert bm.append_slots("a") == AppendResult((0,), None)  # 4th token fits block 0
    assert bm.append_slots("a") == AppendResult((0, 1), None)  # 5th opens block 1
    assert bm.append_slots("a", 4) == AppendResult((0, 1, 2), None)  # 9 tokens
    bm.allocate("b", list(range(20)))  # blocks 3..7: pool full
    assert not bm.can_append("a", 4) and bm.can_append("a", 3)
    assert bm.append_slots("a", 4) is None
    assert bm.block_table("a") == (0, 1, 2)


def test_prefix_hit_reuses_physical_blocks():
    bm = make()
    prompt = list(range(10))
    bm.allocate("a", prompt)
    bm.commit("a", prompt, 10)  # blocks 0 and 1 are full and computed
    b = bm.allocate("b", prompt[:8] + [77, 78, 79])
    assert b.block_ids == (0, 1, 3) and b.num_cached_tokens == 8
    # The last token is always computed, so an exact 8-token prompt reuses only block 0.
    c = bm.allocate("c", prompt[:8])
    assert c.block_ids == (0, 4) and c.num_cached_tokens == 4
    assert bm.prefix_hit_rate == pytest.approx((8 + 4) / (10 + 11 + 8))
    for seq_id in ("a", "b", "c"):
        bm.free(seq_id)
    assert (bm.num_cached, bm.num_used) == (2, 0)  # blocks 0, 1 keep their prefix
    d = bm.allocate("d", prompt)
    assert d.block_ids[:2] == (0, 1) and d.num_cached_tokens == 8 and bm.num_cached == 0
    bm.check_invariants()


def test_namespace_separates_prefixes():
    prompt = list(range(9))
    one, other = BlockManager(8, 4, "m:int8/int8"), BlockManager(8, 4, "m:fp16/fp16")
    one.allocate("a", prompt)
    one.commit("a", prompt, 9)
    assert one._hash(one._root, prompt[:4]) != other._hash(other._root, prompt[:4])


def test_eviction_is_lru_and_spares_used_blocks():
    bm = make()
    p1, p2 = list(range(9)), list(range(50, 59))
    for seq_id, p in (("a", p1), ("b", p2)):
        bm.allocate(seq_id, p)
        bm.commit(seq_id, p, 9)
    assert bm.block_table("a") == (0, 1, 2) and bm.block_table("b") == (3, 4, 5)
    bm.free("a")  # cached: 1, 0 (LRU order; 2 was never full so it is free)
    assert (bm.num_free, bm.num_cached, bm.num_used) == (3, 2, 3)
    e = bm.allocate("e", list(range(100, 116)))  # 4 blocks: free 6, 7, 2, then evict 1
    assert e.block_ids == (6, 7, 2, 1)
    assert bm.allocate("f", list(range(200, 205))) is None  # would need a block that is in use
    hit = bm.allocate("g", p2[:8] + [1])  # b's blocks are in use and shared, never evicted
    assert hit.block_ids == (3, 4, 0) and hit.num_cached_tokens == 8
    assert bm.block_table("b") == (3, 4, 5)
    bm.check_invariants()


def test_fork_and_copy_on_write():
    bm = make()
    bm.allocate("a", [1, 2, 3, 4, 5, 6])  # blocks 0 (full), 1 (2 of 4 slots)
    assert bm.fork("a", "b") == (0, 1)
    assert bm.append_slots("b") == AppendResult((0, 2), CopyOnWrite(1, 2))
    assert bm.append_slots("a") == AppendResult((0, 1), None)  # block 1 is a's alone now
    bm.free("a")
    assert bm.block_table("b") == (0, 2) and bm.num_used == 2
    bm.check_invariants()


class _FakePool:
    """Token ids stand in for K/V: a block's slots hold the token written there (-1: never)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.slots = [[-1] * block_size for _ in range(num_blocks)]
        self.block_size = block_size

    def write(self, table, start, tokens):
        for t, tok in enumerate(tokens, start):
            self.slots[table[t // self.block_size]][t % self.block_size] = tok

    def read(self, table, num_tokens):
        return [self.slots[table[t // self.block_size]][t % self.block_size] for t in range(num_tokens)]


def test_random_operations_never_leak_or_corrupt():
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=24, block_size=4, namespace="m")
    pool = _FakePool(24, 4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    seqs: dict[int, list[int]] = {}
    next_id = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.3 or not seqs:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            tokens = tokens or [0]
            alloc = bm.allocate(next_id, tokens)
            if alloc is not None:
                # Cached prefix blocks must already hold exactly these tokens.
                assert pool.read(alloc.block_ids, alloc.num_cached_tokens) == tokens[:alloc.num_cached_tokens]
                pool.write(alloc.block_ids, alloc.num_cached_tokens, tokens[alloc.num_cached_tokens:])
                bm.commit(next_id, tokens, len(tokens))
                seqs[next_id] = tokens
            next_id += 1
        elif op < 0.6:
            seq_id = rng.choice(list(seqs))
            result = bm.append_slots(seq_id)
            if result is not None:
                if result.copy is not None:
                    pool.slots[result.copy.dst_block_id] = list(pool.slots[result.copy.src_block_id])
                token = rng.randrange(50)
                pool.write(result.block_ids, len(seqs[seq_id]), [token])
                seqs[seq_id].append(token)
                bm.commit(seq_id, seqs[seq_id], len(seqs[seq_id]))
        elif op < 0.7:
            parent = rng.choice(list(seqs))
            bm.fork(parent, next_id)
            seqs[next_id] = list(seqs[parent])
            next_id += 1
        else:
            seq_id = rng.choice(list(seqs))
            bm.free(seq_id)
            del seqs[seq_id]
        if step % 50 == 0:
            bm.check_invariants()
            for seq_id, tokens in seqs.items():
                assert pool.read(bm.block_table(seq_id), len(tokens)) == tokens
    assert bm.prefix_hit_rate > 0
    for seq_id in list(seqs):
        bm.free(seq_id)
    bm.check_invariants()
    assert bm.num_used == 0 and bm.num_free + bm.num_cached == 24
