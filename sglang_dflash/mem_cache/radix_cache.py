"""RadixCache: a radix tree over token ids that maps cached prefixes to their KV slots (SGLang's
RadixAttention, page size 1). A slot indexes the target's and the draft's KV pools alike, so a cached
prefix serves both. Running requests lock the nodes they read (reference counts up to the root);
unlocked leaves are evicted, least recently used first, when the pool needs room."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import torch

from sglang_dflash.mem_cache.memory_pool import TokenToKVPoolAllocator


class TreeNode:
    """An edge of the tree: `key` tokens and their `value` slots, below `parent`."""

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, last_access: int = 0):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0  # running requests whose prefix passes through this node
        self.last_access = last_access

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


def common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    """Prefix -> slots. `disable` turns it into a cache that never matches (the scheduler then inserts
    nothing). Every operation is one tick of the LRU clock."""

    def __init__(self, allocator: TokenToKVPoolAllocator, disable: bool = False):
        self.allocator = allocator
        self.disable = disable
        self.empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        self.root = TreeNode([], self.empty, None)
        self.clock = 0
        self.evictable_size = 0  # tokens in nodes no request locks
        self.protected_size = 0  # tokens in locked nodes

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def reset(self) -> None:
        """Frees every cached slot; only while no request holds a lock."""
        for node in self.nodes():
            self.allocator.free(node.value)
        self.root.children = {}
        self.evictable_size = self.protected_size = 0

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- lookup and insertion ----
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The slots of the longest cached prefix of `key` and the node it ends at (an edge the match ends
        inside is split there); the matched nodes become the most recently used."""
        if self.disable:
            return self.empty, self.root
        self.clock += 1
        node, i, values = self.root, 0, []
        while i < len(key) and (child := node.children.get(key[i])) is not None:
            n = common_len(child.key, key[i:])
            if n < len(child.key):
                child = self.split(child, n)
            child.last_access = self.clock
            values.append(child.value)
            node, i = child, i + n
        return (torch.cat(values) if values else self.empty), node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Caches key -> value (one slot per token). Returns how many leading tokens were cached already:
        their slots in `value` stay the caller's; the tree owns the rest from now on."""
        self.clock += 1
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                node.children[key[i]] = TreeNode(list(key[i:]), value[i:].clone(), node, self.clock)
                self.evictable_size += len(key) - i
                return i
            n = common_len(child.key, key[i:])
            if n < len(child.key):
                child = self.split(child, n)
            child.last_access = self.clock
            node, i = child, i + n
        return i

    def split(self, node: TreeNode, n: int) -> TreeNode:
        """Cuts `node`'s edge after n tokens and returns the new upper part; `node` keeps the lower part, so
        a request that locked it still holds the same prefix."""
        upper = TreeNode(node.key[:n], node.value[:n], node.parent, node.last_access)
        upper.lock_ref = node.lock_ref
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
        node.parent, node.key, node.value = upper, node.key[n:], node.value[n:]
        return upper

    # ---- reference counts ----
    def lock(self, node: TreeNode) -> None:
        """Protects the prefix ending at `node` from eviction (one more request reads it)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    # ---- eviction ----
    def evict(self, num_tokens: int) -> int:
        """Frees at least num_tokens slots (or all evictable ones): whole unlocked leaves, least recently
        used first. Returns the number of slots freed."""
        leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            self.allocator.free(node.value)
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            parent = node.parent
            del parent.children[node.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed


class EvictingAllocator:
    """The token slot pool as the scheduler sees it: free slots plus the radix cache's evictable ones,
    evicted on demand. available_size() == size means every slot is free or cached unreferenced."""

    def __init__(self, allocator: TokenToKVPoolAllocator, cache: RadixCache):
        self.allocator = allocator
        self.cache = cache
        self.size = allocator.size

    def available_size(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots, evicting cache leaves when the free list is short; None when even that is not enough."""
        if n > self.available_size():
            return None
        short = n - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)
