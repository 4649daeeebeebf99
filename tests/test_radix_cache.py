"""The radix prefix cache. The tree against a brute-force model (every cached prefix -> the slot of its last
token) on random sequences: insert, match, split, lock, evict in LRU order. The engine, AR and DFLASH, plain
and overlap loop: greedy float32 outputs with the cache are the outputs without it, token for token, for
second turns (whose prompts hold the first answers), repeated prompts and requests admitted after evictions;
second turns compute a small part of their prompts, a fully cached prompt's first token comes fast; nothing
leaks. The server: cached_tokens in usage and meta_info, /flush_cache, /get_server_info and /metrics, and
eviction under KV pressure with every slot back afterwards."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from dflash_helpers import SMALL_POOL, ar_engine
from server_helpers import AUTH, KV_PRESSURE_TOKENS, ServerProcess, chat, dflash_args, shared_server

from sglang_dflash import Engine
from sglang_dflash.mem_cache.memory_pool import TokenToKVPoolAllocator
from sglang_dflash.mem_cache.radix_cache import RadixCache, TreeNode
from sglang_dflash.runtime.forward_batch import ForwardBatch, ForwardMode
from sglang_dflash.speculative.cost_model import CostModel
from sglang_dflash.speculative.dflash_step import MAX_PARKED_BYTES
from sglang_dflash.speculative.policy import SpecPolicy

# ---- the tree against a brute-force model ----


class Reference:
    """Every cached prefix (a tuple) -> slot of its last token, its lock count and last access tick."""

    def __init__(self):
        self.slot: dict[tuple, int] = {}
        self.locks: dict[tuple, int] = {}
        self.access: dict[tuple, int] = {}
        self.clock = 0

    def matched(self, key: list[int]) -> int:
        n = 0
        while n < len(key) and tuple(key[: n + 1]) in self.slot:
            n += 1
        return n

    def match(self, key: list[int]) -> list[int]:
        self.clock += 1
        n = self.matched(key)
        for i in range(1, n + 1):
            self.access[tuple(key[:i])] = self.clock
        return [self.slot[tuple(key[:i])] for i in range(1, n + 1)]

    def insert(self, key: list[int], slots: list[int]) -> int:
        self.clock += 1
        n = self.matched(key)
        for i in range(1, len(key) + 1):
            p = tuple(key[:i])
            self.slot.setdefault(p, slots[i - 1])
            self.locks.setdefault(p, 0)
            self.access[p] = self.clock
        return n

    def lock(self, key: list[int], delta: int) -> None:
        for i in range(1, len(key) + 1):
            self.locks[tuple(key[:i])] += delta

    def leaves(self) -> list[tuple]:
        return [p for p in self.slot if not any(q[: len(p)] == p and len(q) > len(p) for q in self.slot)]


def tree_items(cache: RadixCache) -> dict[tuple, int]:
    """Every prefix the tree caches -> its slot, read by walking the tree."""
    out: dict[tuple, int] = {}

    def walk(node: TreeNode, prefix: tuple) -> None:
        assert len(node.key) == len(node.value) > 0 or node is cache.root
        for t, child in node.children.items():
            assert child.key[0] == t and child.parent is node
            for i, s in enumerate(child.value.tolist()):
                out[prefix + tuple(child.key[: i + 1])] = s
            walk(child, prefix + tuple(child.key))

    walk(cache.root, ())
    return out


def check_same(cache: RadixCache, ref: Reference) -> None:
    assert tree_items(cache) == ref.slot
    assert cache.evictable_size == sum(1 for p in ref.slot if ref.locks[p] == 0)
    assert cache.protected_size == sum(1 for p in ref.slot if ref.locks[p] > 0)


@pytest.mark.parametrize("seed", range(6))
def test_tree_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    pool = 400
    alloc = TokenToKVPoolAllocator(pool, torch.device("cpu"))
    cache, ref = RadixCache(alloc), Reference()
    locked: list[tuple[TreeNode, list[int]]] = []
    for _ in range(300):
        op = rng.random()
        key = [rng.randrange(3) for _ in range(rng.randint(1, 10))]  # a small vocabulary: many shared prefixes
        if op < 0.35 and alloc.available_size() >= len(key):
            slots = alloc.alloc(len(key))
            present = cache.insert(key, slots)
            assert present == ref.insert(key, slots.tolist())
            alloc.free(slots[:present])  # the caller's duplicates
        elif op < 0.6:
            slots, node = cache.match_prefix(key)
            assert slots.tolist() == ref.match(key)
            if rng.random() < 0.5:
                cache.lock(node)
                ref.lock(key[: len(slots)], 1)
                locked.append((node, key[: len(slots)]))
        elif op < 0.75 and locked:
            node, prefix = locked.pop(rng.randrange(len(locked)))
            cache.unlock(node)
            ref.lock(prefix, -1)
        else:
            check_evict(cache, ref, alloc, rng.randint(1, 30))
        check_same(cache, ref)
        assert alloc.available_size() + cache.total_size() == pool  # every slot free or cached, once
    for node, _ in locked:
        cache.unlock(node)
    cache.reset()
    assert alloc.available_size() == pool and sorted(alloc._free.tolist()) == list(range(1, pool + 1))


def check_evict(cache: RadixCache, ref: Reference, alloc: TokenToKVPoolAllocator, n: int) -> None:
    """Whole unlocked leaves, least recently used first, until n slots are free; their slots are freed."""
    before, access = dict(ref.slot), dict(ref.access)
    free_before, evictable = alloc.available_size(), cache.evictable_size
    freed = cache.evict(n)
    after = tree_items(cache)
    removed = set(before) - set(after)
    assert set(after) <= set(before) and freed == len(removed) == alloc.available_size() - free_before
    assert freed >= min(n, evictable)
    assert all(ref.locks[p] == 0 for p in removed)
    for p in removed:
        del ref.slot[p], ref.locks[p], ref.access[p]
    if removed:
        last = max(access[p] for p in removed)
        assert all(last <= ref.access[p] for p in ref.leaves() if ref.locks[p] == 0), "a newer leaf went first"
        if freed > n:  # past n, at most the rest of the leaf it had started
            assert freed - n < sum(access[p] == last for p in removed)


def test_split_lock_and_lru_order() -> None:
    alloc = TokenToKVPoolAllocator(64, torch.device("cpu"))
    cache = RadixCache(alloc)
    seqs = {"a": [1, 2, 3, 4], "b": [1, 2, 5, 6], "c": [7, 8, 9]}
    slots = {k: alloc.alloc(len(v)) for k, v in seqs.items()}
    for k, v in seqs.items():
        alloc.free(slots[k][: cache.insert(v, slots[k])])
    assert sorted(cache.root.children[1].children) == [3, 5]  # "b" split the edge of "a" after [1, 2]
    got, node = cache.match_prefix([1, 2, 3, 9])  # ends inside [3, 4]: split again
    assert got.tolist() == slots["a"][:3].tolist() and node.key == [3]
    cache.lock(node)
    assert (cache.protected_size, cache.evictable_size) == (3, 6)
    cache.match_prefix([7, 8, 9])  # "c" becomes the most recently used
    assert cache.evict(1) == 1 and cache.match_prefix([1, 2, 3, 4])[0].numel() == 3  # "a"'s [4]: the oldest
    assert cache.evict(1) == 2 and cache.match_prefix([1, 2, 5])[0].numel() == 2  # then "b"'s [5, 6], not "c"
    assert cache.evict(100) == 3  # "c"; the locked [1, 2, 3] stays
    assert cache.match_prefix([1, 2, 3])[0].tolist() == slots["a"][:3].tolist()
    cache.unlock(node)
    assert cache.evict(100) == 3 and cache.total_size() == 0 and alloc.available_size() == 64


# ---- the engine: outputs with the cache == outputs without it ----
QUESTIONS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how a hash map works, step by step.",
]
OTHERS = [  # distinct prefixes: in a small pool they evict the conversations
    "List ten animals that live in the ocean and say one thing about each.",
    "Give me a recipe for pancakes with all the steps.",
    "Describe the water cycle to a ten year old.",
]
FOLLOW_UP = "Shorter, please."
FIRST, SECOND = 40, 8  # new tokens of first and second turns


def turns(engine: Engine) -> list[list[dict]]:
    """The results of four phases, each one batch: first turns; other requests; second turns (prompt = first
    turn + its answer + a follow-up); the second turns again (fully cached)."""
    firsts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    out1 = engine.chat(firsts, {"temperature": 0, "max_new_tokens": FIRST})
    others = engine.chat([[{"role": "user", "content": q}] for q in OTHERS], {"temperature": 0, "max_new_tokens": 8})
    seconds = [m + [{"role": "assistant", "content": o["text"]}, {"role": "user", "content": FOLLOW_UP}]
               for m, o in zip(firsts, out1)]
    params = {"temperature": 0, "max_new_tokens": SECOND}
    return [out1, others, engine.chat(seconds, params), engine.chat(seconds, params)]


def ids(phases: list[list[dict]]) -> list[list[list[int]]]:
    return [[o["output_ids"] for o in phase] for phase in phases]


def assert_no_leak(engine: Engine) -> None:
    """Nothing running; every slot free or in the cache with no reference; every row free."""
    sched = engine.scheduler
    assert not sched.has_work() and not sched.deferred_frees
    cache = sched.tree_cache
    assert cache.protected_size == 0 and all(n.lock_ref == 0 for n in cache.nodes())
    assert sched.allocator.allocator.available_size() + cache.total_size() == sched.allocator.size
    assert sched.allocator.available_size() == sched.allocator.size
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


@pytest.fixture(scope="module")
def reference() -> list[list[list[int]]]:
    """Greedy AR with --disable-radix-cache; DFLASH is lossless, so it is the reference of both algorithms."""
    with Engine(dtype="float32", max_total_tokens=SMALL_POOL, disable_radix_cache=True) as uncached:
        phases = turns(uncached)
        assert all(o["meta_info"]["cached_tokens"] == 0 for p in phases for o in p)
        assert uncached.scheduler.tree_cache.total_size() == 0
        assert_no_leak(uncached)
    return ids(phases)


@pytest.fixture(scope="module")
def dflash() -> Engine:
    """The shipped drafter (its proposals read the cached draft context K/V), fixed blocks of 4."""
    with Engine(dtype="float32", max_total_tokens=SMALL_POOL, speculative_algorithm="DFLASH",
                speculative_num_draft_tokens=4, speculative_adaptive=False, speculative_lookup=False) as eng:
        yield eng


def assert_cached_kv_is_prefill_kv(engine: Engine, prompts: list[list[int]], rel_err) -> None:
    """The target K/V and (DFLASH) the draft context K/V the cache holds for each prompt's cached prefix
    equal a fresh prefill of that prefix: no slot of a speculative block, no token without K/V."""
    runner = engine.scheduler.worker
    step = getattr(runner, "step", None)
    runner = getattr(runner, "target", runner).model_runner
    pools = [runner.token_to_kv_pool] + ([step.draft_pool] if step is not None else [])
    for prompt in prompts:
        cached, _ = engine.scheduler.tree_cache.match_prefix(prompt)
        n = len(cached)
        row, fresh = runner.req_to_token_pool.alloc(), runner.token_to_kv_pool_allocator.alloc(n)
        try:
            table = runner.req_to_token_pool.req_to_token
            table[row, :n] = fresh
            capture = None if step is None else tuple(step.draft.config.target_layer_ids)
            fb = ForwardBatch.build(ForwardMode.EXTEND, prompt[:n], [row], [0], [n], table, runner.device,
                                    logits="none", capture_layer_ids=capture)
            with torch.inference_mode():
                out = runner.forward(fb)
                if step is not None:
                    step.materialize(out.hidden_states, fb.positions, fb.out_cache_loc)
            for pool in pools:
                for buf in (pool.k_buffer, pool.v_buffer):
                    assert rel_err(buf[:, cached], buf[:, fresh]) < 1e-3
        finally:
            runner.token_to_kv_pool_allocator.free(fresh)
            runner.req_to_token_pool.free(row)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["AR", "DFLASH"])
def test_outputs_with_the_cache_are_the_outputs_without(reference, dflash, algorithm, overlap, monkeypatch, rel_err):
    engine = ar_engine() if algorithm == "AR" else dflash
    monkeypatch.setattr(engine.scheduler, "enable_overlap", overlap)
    assert engine.flush_cache()
    phases = turns(engine)
    assert ids(phases) == reference
    for out in phases[2]:  # second turns: the first turn's prompt and answer are cached
        meta = out["meta_info"]
        assert meta["prompt_tokens"] - meta["cached_tokens"] <= 0.2 * meta["prompt_tokens"], meta
    assert all(o["meta_info"]["cached_tokens"] == o["meta_info"]["prompt_tokens"] - 1 for o in phases[3])
    assert_no_leak(engine)
    seconds = [m + [{"role": "assistant", "content": o["text"]}, {"role": "user", "content": FOLLOW_UP}]
               for m, o in zip(([{"role": "user", "content": q}] for q in QUESTIONS), phases[0])]
    assert_cached_kv_is_prefill_kv(engine, [engine.tokenizer_manager.chat_ids(m) for m in seconds], rel_err)
    assert_no_leak(engine)


def prefilled(engine: Engine, ids: list[int]):
    """A 1-token request run through its prefill (it then finishes); the Req, with its proposer state."""
    req = engine.tokenizer_manager.make_req(None, ids, {"max_new_tokens": 1, "temperature": 0})
    engine.scheduler.add_request(req)
    while engine.scheduler.has_work():
        engine.scheduler.run_step()
    return req


def test_a_cached_prefix_without_draft_context_is_not_drafted_from(monkeypatch, rel_err):
    """Adaptive DFLASH while the policy does not materialise (no DFlash block could pay at the batch's size: a
    loaded CPU) and the parked features are dropped (no room for them): the draft context K/V of the committed
    tokens is not written, yet the radix cache keeps them. Once DFlash may pay again, a second turn that reuses such
    a prefix must not draft from it; where the first turns ran materialising, the cached prefix holds the draft
    context a fresh prefill writes, and the second turn drafts."""
    with Engine(dtype="float32", max_total_tokens=SMALL_POOL, speculative_algorithm="DFLASH") as engine:
        step = engine.scheduler.worker.step
        firsts = [[{"role": "user", "content": q}] for q in QUESTIONS]
        for loaded in (True, False):
            assert engine.flush_cache()
            step.policy = SpecPolicy(step.policy.options, step.policy.cost)
            step.policy.materialise = not loaded
            step.max_parked_bytes = 0 if loaded else MAX_PARKED_BYTES
            with monkeypatch.context() as patch:  # the decision held for the whole turn
                patch.setattr(step.policy, "_decide_materialise", lambda bs, limit: None)
                outs = engine.chat(firsts, {"temperature": 0, "max_new_tokens": FIRST})
            step.policy.materialise = True  # the load is gone
            seconds = [engine.tokenizer_manager.chat_ids(m + [{"role": "assistant", "content": o["text"]},
                                                              {"role": "user", "content": FOLLOW_UP}])
                       for m, o in zip(firsts, outs)]
            if not loaded:
                assert_cached_kv_is_prefill_kv(engine, seconds, rel_err)
            for ids in seconds:
                req = prefilled(engine, ids)
                assert req.cached_tokens > len(ids) // 2
                assert req.spec_state.drafts is not loaded
            assert_no_leak(engine)



def test_running_requests_draft_again_once_the_load_is_gone(reference, monkeypatch, rel_err):
    """Adaptive DFLASH whose policy stops materialising while the first turns run (a load), then materialises
    again while they still run (the load is gone): their features were parked, the next decode step writes their
    draft context K/V and they draft again (the shipped drafter, which reads it); the output is AR's, and the draft
    context K/V the cache holds afterwards equals a fresh prefill's."""
    with Engine(dtype="float32", max_total_tokens=SMALL_POOL, speculative_algorithm="DFLASH") as engine:
        step = engine.scheduler.worker.step
        cost = CostModel({1: 0.010, 64: 0.012, 512: 0.030}, {16: 0.002, 512: 0.010})  # a step costs ~the same
        monkeypatch.setattr(cost, "observe", lambda *args: None)  # whatever it verifies: DFlash blocks pay
        step.policy = SpecPolicy(step.policy.options, cost)
        monkeypatch.setattr(step.policy, "_decide_materialise", lambda bs, limit: None)
        drafts = []
        draft_block = step.draft_block
        monkeypatch.setattr(step, "draft_block", lambda *a, **kw: drafts.append(1) or draft_block(*a, **kw))
        step.policy.materialise = False
        tm = engine.tokenizer_manager
        reqs = [tm.make_req(None, tm.chat_ids([{"role": "user", "content": q}]), {"temperature": 0,
                                                                                  "max_new_tokens": FIRST})
                for q in QUESTIONS]
        for req in reqs:
            engine.scheduler.add_request(req)
        for _ in range(6):  # the prefill and 5 decode steps, parked
            engine.scheduler.run_step()
        assert step.parked and not drafts and not any(r.spec_state.drafts for r in reqs)
        assert all(0 < len(r.output_ids) < FIRST for r in reqs)
        step.policy.materialise = True
        engine.scheduler.run_step()  # writes the parked context; the requests draft from the next plan on
        assert not step.parked and not drafts
        engine.scheduler.run_step()
        assert all(r.spec_state.drafts for r in reqs)
        while engine.scheduler.has_work():
            engine.scheduler.run_step()
        assert drafts
        assert [r.output_ids for r in reqs] == reference[0]
        assert_cached_kv_is_prefill_kv(engine, [r.origin_input_ids + r.output_ids[:-1] for r in reqs], rel_err)
        assert_no_leak(engine)

def test_requests_admitted_after_evictions(reference, monkeypatch):
    """A pool that holds about one phase: the other requests evict the conversations (least recently used
    first), the second turns match what is left; retraction under pressure inserts, recomputation matches."""
    with Engine(dtype="float32", max_total_tokens=192) as engine:
        monkeypatch.setattr(engine.scheduler, "enable_overlap", True)
        phases = turns(engine)
        assert ids(phases) == reference
        seconds = [o["meta_info"] for o in phases[2]]
        assert any(m["cached_tokens"] < m["prompt_tokens"] - FIRST for m in seconds), seconds  # evicted
        assert sum(m["cached_tokens"] for m in seconds) > 0
        assert_no_leak(engine)


def test_fully_cached_prompt_is_fast(monkeypatch):
    """Time to the first token of a long prompt: cached (all but its last token) vs computed."""
    engine = ar_engine()
    monkeypatch.setattr(engine.scheduler, "enable_overlap", False)
    prompt = engine.tokenizer_manager.chat_ids([{"role": "user", "content": " ".join(QUESTIONS + OTHERS) * 8}])
    params = {"temperature": 0, "max_new_tokens": 1}

    def ttft(flush: bool) -> float:
        if flush:
            assert engine.flush_cache()
        return engine.generate(input_ids=prompt, sampling_params=params)["meta_info"]["e2e_latency"]

    computed = min(ttft(flush=True) for _ in range(2))
    cached = min(ttft(flush=False) for _ in range(3))
    meta = engine.generate(input_ids=prompt, sampling_params=params)["meta_info"]
    assert meta["cached_tokens"] == len(prompt) - 1 > 400
    assert cached <= 0.25 * computed, (cached, computed)
    assert_no_leak(engine)


def test_flush_is_refused_while_requests_wait():
    engine = ar_engine()
    sched = engine.scheduler
    engine.chat([{"role": "user", "content": QUESTIONS[0]}], {"temperature": 0, "max_new_tokens": 4})
    assert sched.tree_cache.total_size() > 0
    req = engine.tokenizer_manager.make_req(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    sched.add_request(req)
    assert not sched.flush_cache() and sched.tree_cache.total_size() > 0
    while not req.finished():
        sched.run_step()
    sched.land()
    assert sched.flush_cache()
    assert sched.tree_cache.total_size() == 0 and sched.allocator.allocator.available_size() == sched.allocator.size


# ---- the server ----
def metric(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])


@pytest.fixture(scope="module")
def cache_report_server() -> ServerProcess:
    """DFLASH, the overlap loop, --enable-cache-report."""
    server = ServerProcess(dflash_args(4096, "--enable-overlap-schedule", "--enable-cache-report")).wait_ready()
    yield server
    server.stop()


def test_server_reports_cached_tokens_and_flushes(cache_report_server: ServerProcess) -> None:
    server = cache_report_server
    client = server.client()
    assert server.post("/flush_cache").status_code == 200
    assert server.wait_idle()["radix_cache_tokens"] == 0
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    outs = [client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
            for _ in range(2)]
    assert outs[0].usage.prompt_tokens_details.cached_tokens == 0
    assert outs[1].usage.prompt_tokens_details.cached_tokens == outs[1].usage.prompt_tokens - 1
    assert outs[1].choices[0].message.content == outs[0].choices[0].message.content
    native = server.post("/generate", json={"text": QUESTIONS[1], "sampling_params": {"max_new_tokens": 2}}).json()
    assert native["meta_info"]["cached_tokens"] == 0 and native["meta_info"]["prompt_tokens"] > 1
    info = server.wait_idle()
    assert info["radix_cache_tokens"] == info["evictable_kv_tokens"] > 0
    assert info["free_kv_tokens"] + info["radix_cache_tokens"] == info["max_total_num_tokens"]
    assert info["available_kv_tokens"] == info["max_total_num_tokens"] and not info["disable_radix_cache"]
    assert 0 < info["cache_hit_rate"] < 1 and info["num_cached_tokens"] >= outs[1].usage.prompt_tokens - 1
    text = server.get("/metrics").text
    assert metric(text, "sglang:kv_evictable_tokens") == info["evictable_kv_tokens"]
    assert 0 < metric(text, "sglang:cache_hit_rate") < 1 and metric(text, "sglang:cached_tokens_total") > 0

    body = {"model": "default", "messages": messages, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=300) as r:
        lines = r.iter_lines()  # kept: a closed iterator closes the stream (the request is aborted)
        next(line for line in lines if line.startswith("data: "))
        refused = server.post("/flush_cache")  # like SGLang: a plain-text 400 while a request runs
        assert refused.status_code == 400 and "not flushed" in refused.text
    info = server.wait_idle()  # the stream was closed: its request is aborted
    assert server.get("/flush_cache").status_code == 200
    info = server.info()
    assert info["radix_cache_tokens"] == info["evictable_kv_tokens"] == 0
    assert info["free_kv_tokens"] == info["available_kv_tokens"] == info["max_total_num_tokens"]


async def conversations(client, prompts: list[str]) -> list[tuple[str, str]]:
    """Two-turn greedy chats, all at once; (first answer, second answer) of each."""

    async def one(prompt: str) -> tuple[str, str]:
        messages = [{"role": "user", "content": prompt}]
        kw = {"model": "default", "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
        first = (await client.chat.completions.create(messages=messages, **kw)).choices[0].message.content
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": FOLLOW_UP}]
        second = (await client.chat.completions.create(messages=messages, **kw)).choices[0].message.content
        return first, second

    return await asyncio.gather(*(one(p) for p in prompts))


def test_server_eviction_under_kv_pressure_leaks_nothing() -> None:
    """Many distinct prefixes through a pool of a few requests (retraction, eviction, DFLASH, overlap loop):
    every conversation gets the answers a roomy pool gives, and afterwards every slot is free or cached
    unreferenced."""
    prompts = [f"{q} ({i})" for i, q in enumerate(QUESTIONS + OTHERS)]
    roomy = asyncio.run(conversations(shared_server("dflash_plain").async_client(), prompts))
    server = shared_server("kv_pressure")
    assert asyncio.run(conversations(server.async_client(), prompts)) == roomy
    info = server.wait_idle()
    assert info["max_total_num_tokens"] == KV_PRESSURE_TOKENS and info["num_retractions"] > 0
    assert info["radix_cache_tokens"] == info["evictable_kv_tokens"] > 0
    assert info["free_kv_tokens"] + info["radix_cache_tokens"] == info["available_kv_tokens"] == KV_PRESSURE_TOKENS


def test_cache_flags() -> None:
    from sglang_dflash.launch_server import parse_args

    default, flags = parse_args([]), parse_args(["--disable-radix-cache", "--enable-cache-report"])
    assert not default.disable_radix_cache and not default.enable_cache_report
    assert flags.disable_radix_cache and flags.enable_cache_report


def test_cached_tokens_are_reported_only_with_the_flag() -> None:
    """Like SGLang: usage.prompt_tokens_details only with --enable-cache-report; meta_info always."""
    server = shared_server("dflash_plain")
    assert chat(server.client(), QUESTIONS[0], max_tokens=2).usage.prompt_tokens_details is None
    native = server.post("/generate", json={"text": QUESTIONS[0], "sampling_params": {"max_new_tokens": 2}}).json()
    assert native["meta_info"]["cached_tokens"] >= 0
