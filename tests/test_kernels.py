"""DFlash kernels: Triton vs torch references, torch references vs naive loops, sampling losslessness.

Without a cuda/xpu device the Triton kernels run on CPU tensors through the Triton interpreter
(TRITON_INTERPRET=1 is set here, before any Triton kernel module is imported); with one they run natively.
"""

import importlib
import math
import os
from collections.abc import Callable, Iterator

import pytest
import torch
from sglang_dflash.kernels import (
    greedy_accept,
    greedy_accept_torch,
    materialize_draft_kv,
    materialize_draft_kv_torch,
    prepare_draft_block,
    prepare_draft_block_torch,
    sampling_accept,
    sampling_accept_torch,
    use_triton,
)
from sglang_dflash.kernels.backend import ENV_VAR, triton_available, triton_import_error

from sglang_dflash.device import accelerator

DEVICE = accelerator() or torch.device("cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

needs_triton = pytest.mark.skipif(not triton_available(), reason=f"triton unusable: {triton_import_error()}")
INT_POISON = -7


def triton_fn(module: str, name: str) -> Callable:
    """A Triton implementation, imported lazily (after TRITON_INTERPRET is settled)."""
    return getattr(importlib.import_module(f"sglang_dflash.kernels.{module}_triton"), name)


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.empty returns NaN / -7 filled tensors, so outputs a kernel forgets to write are visible."""
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        out = real_empty(*args, **kwargs)
        return out.fill_(math.nan if out.is_floating_point() else INT_POISON)

    monkeypatch.setattr(torch, "empty", empty)
    yield


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- materialize_draft_kv


def rope_cache(max_pos: int, rotary_dim: int, theta: float = 1e6) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def kv_case(
    n: int, layers: int, heads: int, hd: int, rot: int, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor | int | float]:
    g = gen(seed)
    slots = 3 * n + 5
    wide = torch.randn(n, layers, 2, heads + 1, hd, generator=g).to(dtype)
    return {
        "kv": wide[:, :, :, :heads],  # a strided view, as a slice of a wider GEMM output would be
        "k_norm_weight": (torch.rand(layers, hd, generator=g) + 0.5).to(dtype),
        "positions": torch.randint(0, 1000, (n,), generator=g),
        "cos_sin_cache": rope_cache(1000, rot),
        "rotary_dim": rot,
        "eps": 1e-6,
        "out_cache_loc": torch.randperm(slots, generator=g)[:n],
        "slots": slots,
    }


def run_materialize(fn: Callable, case: dict, buffer_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `fn` into random pools whose target slots are NaN; check those are written, the rest untouched."""
    layers, heads, hd = case["kv"].shape[1], case["kv"].shape[3], case["kv"].shape[4]
    g = gen(99)
    pools = [torch.randn(layers, case["slots"], heads, hd, generator=g).to(buffer_dtype) for _ in range(2)]
    k_buf, v_buf = (p.to(DEVICE) for p in pools)
    loc = case["out_cache_loc"].to(DEVICE)
    k_buf[:, loc] = math.nan
    v_buf[:, loc] = math.nan
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items() if k != "slots"}
    fn(k_buffer=k_buf, v_buffer=v_buf, **args)
    k_buf, v_buf = k_buf.cpu(), v_buf.cpu()
    untouched = torch.ones(case["slots"], dtype=torch.bool)
    untouched[case["out_cache_loc"]] = False
    for pool, buf in zip(pools, (k_buf, v_buf), strict=True):
        assert not buf.isnan().any(), "a target slot was not written"
        assert torch.equal(buf[:, untouched], pool[:, untouched]), "a slot outside out_cache_loc changed"
    return k_buf, v_buf


KV_SHAPES = [  # n, layers, nKV, head_dim, rotary_dim, kv dtype, buffer dtype
    (5, 2, 1, 64, 64, torch.float32, torch.float32),
    (13, 3, 8, 128, 64, torch.float32, torch.float32),
    (7, 5, 3, 64, 32, torch.bfloat16, torch.bfloat16),
    (9, 2, 5, 128, 128, torch.bfloat16, torch.bfloat16),
    (3, 1, 2, 128, 64, torch.float32, torch.bfloat16),
]


@needs_triton
@pytest.mark.parametrize("shape", KV_SHAPES, ids=str)
def test_materialize_triton_matches_torch(shape: tuple) -> None:
    *dims, dtype, buffer_dtype = shape
    case = kv_case(*dims, dtype=dtype, seed=sum(dims))
    expected = run_materialize(materialize_draft_kv_torch, case, buffer_dtype)
    actual = run_materialize(triton_fn("draft_kv", "materialize_draft_kv_triton"), case, buffer_dtype)
    tol = 1e-5 if buffer_dtype == torch.float32 else 1e-2
    assert rel_err(actual[0], expected[0]) < tol
    if dtype == buffer_dtype:
        assert torch.equal(actual[1], expected[1])
    else:  # the interpreter narrows floats by truncation, CUDA rounds to nearest even
        assert rel_err(actual[1], expected[1]) < tol


def naive_materialize(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, layer and head: RMSNorm, then RoPE pair by pair from the angle itself, in float64."""
    kv, weight, rot, eps = (
        case["kv"].double(),
        case["k_norm_weight"].double(),
        case["rotary_dim"],
        case["eps"],
    )
    n, layers, _, heads, hd = kv.shape
    k_out = torch.full((layers, case["slots"], heads, hd), math.nan, dtype=torch.float64)
    v_out = k_out.clone()
    half = rot // 2
    for t in range(n):
        slot, pos = case["out_cache_loc"][t].item(), case["positions"][t].item()
        for layer in range(layers):
            for h in range(heads):
                x = kv[t, layer, 0, h]
                y = x / math.sqrt((x * x).mean().item() + eps) * weight[layer]
                out = y.clone()
                for i in range(half):
                    angle = pos / 1e6 ** (2 * i / rot)
                    c, s = math.cos(angle), math.sin(angle)
                    out[i] = y[i] * c - y[i + half] * s
                    out[i + half] = y[i + half] * c + y[i] * s
                k_out[layer, slot, h] = out
                v_out[layer, slot, h] = kv[t, layer, 1, h]
    return k_out, v_out


@pytest.mark.parametrize("shape", [(4, 2, 3, 64, 64), (3, 2, 2, 128, 64)], ids=str)
def test_materialize_torch_matches_naive(shape: tuple) -> None:
    case = kv_case(*shape, dtype=torch.float32, seed=1)
    k_naive, v_naive = naive_materialize(case)
    k_buf = torch.full(k_naive.shape, math.nan)
    v_buf = k_buf.clone()
    materialize_draft_kv_torch(
        k_buffer=k_buf, v_buffer=v_buf, **{k: v for k, v in case.items() if k != "slots"}
    )
    written = case["out_cache_loc"]
    assert rel_err(k_buf[:, written], k_naive[:, written]) < 1e-5
    assert torch.equal(v_buf[:, written].double(), v_naive[:, written])


# ---------------------------------------------------------------- accept kernels


def greedy_case(bs: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafts that mostly agree with the target, so accept lengths cover 0..block-1."""
    g = gen(seed)
    target = torch.randint(0, 50, (bs, block), generator=g)
    drafts = torch.where(torch.rand(bs, block - 1, generator=g) < 0.85, target[:, :-1], 7)
    candidates = torch.cat([torch.randint(0, 50, (bs, 1), generator=g), drafts], dim=1)
    block_lens = torch.randint(1, block + 1, (bs,), generator=g)
    return candidates, target, block_lens


def naive_accept_outputs(candidates: torch.Tensor, accept_lens: list[int], bonus: list[int]) -> torch.Tensor:
    out = torch.full(candidates.shape, -1, dtype=torch.int64)
    for i, (acc, b) in enumerate(zip(accept_lens, bonus, strict=True)):
        out[i, :acc] = candidates[i, 1 : acc + 1]
        out[i, acc] = b
    return out


def check_accept_result(
    result: tuple[torch.Tensor, ...], acc: list[int], bonus: list[int], cand: torch.Tensor
):
    assert result[0].tolist() == acc
    assert result[1].tolist() == bonus
    assert torch.equal(result[2], naive_accept_outputs(cand, acc, bonus))


@pytest.mark.parametrize("bs, block", [(1, 1), (9, 5), (33, 16), (6, 23)])
def test_greedy_torch_matches_loop(bs: int, block: int) -> None:
    candidates, target, block_lens = greedy_case(bs, block, seed=bs)
    accept_lens, bonus = [], []
    for i in range(bs):
        acc = 0
        while acc < block_lens[i] - 1 and candidates[i, acc + 1] == target[i, acc]:
            acc += 1
        accept_lens.append(acc)
        bonus.append(target[i, acc].item())
    check_accept_result(greedy_accept_torch(candidates, target, block_lens), accept_lens, bonus, candidates)
    assert len(set(accept_lens)) > min(block, 3) - 1


@needs_triton
@pytest.mark.parametrize("bs, block", [(1, 1), (9, 5), (33, 16), (6, 23)])
@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
def test_greedy_triton_matches_torch(
    bs: int, block: int, len_dtype: torch.dtype, poisoned_empty: None
) -> None:
    candidates, target, block_lens = greedy_case(bs, block, seed=bs + 1)
    args = (candidates.to(DEVICE), target.to(DEVICE), block_lens.to(DEVICE, len_dtype))
    expected = greedy_accept_torch(*args)
    actual = triton_fn("greedy", "greedy_accept_triton")(*args)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == torch.int64 and torch.equal(a, e)


def sampling_case(bs: int, block: int, vocab: int, seed: int, point_mass: bool = False) -> dict:
    """Partly zeroed (top-k like) p and a nearby q; drafts sampled from q (or its argmax for point
    masses, then draft_probs is None), so accept lengths vary."""
    g = gen(seed)
    base = torch.randn(bs, block, vocab, generator=g) * 2
    base[..., 0] = 6.0  # keeps every row non-empty

    def dist(noise: float) -> torch.Tensor:
        logits = base + noise * torch.randn(bs, block, vocab, generator=g)
        logits[torch.rand(bs, block, vocab, generator=g) < 0.2] = -math.inf
        logits[..., 0] = base[..., 0]
        return torch.softmax(logits, dim=-1)

    p, q = dist(0.0), dist(0.7)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(bs, block)
    if point_mass:
        drafts = q.argmax(dim=-1)
    candidates = torch.cat([torch.randint(0, vocab, (bs, 1), generator=g), drafts[:, :-1]], dim=1)
    block_lens = torch.randint(1, block + 1, (bs,), generator=g)
    uniforms = torch.rand(bs, block, generator=g)
    if block > 1 and not point_mass:  # q = p except q(d1) = 2 p(d1): d1 rejected, residual empty -> p
        q[0, 0] = p[0, 0]
        q[0, 0, candidates[0, 1]] *= 2
        block_lens[0], uniforms[0, 0] = block, 0.99
    return {
        "target_probs": p,
        "candidates": candidates,
        "draft_probs": None if point_mass else q,
        "block_lens": block_lens,
        "uniforms": uniforms,
        "residual_uniforms": torch.rand(bs, generator=g),
    }


def naive_sampling_accept(case: dict) -> tuple[list[int], list[int]]:
    """The rule of REFERENCE.md section 3, one request at a time in float64."""
    point_mass = case["draft_probs"] is None
    p = case["target_probs"].double()
    q = p if point_mass else case["draft_probs"].double()
    accept_lens, bonus = [], []
    for i in range(p.shape[0]):
        acc, n_drafts = 0, case["block_lens"][i].item() - 1
        while acc < n_drafts:
            d = case["candidates"][i, acc + 1]
            ratio = p[i, acc, d] if point_mass else min(1.0, p[i, acc, d] / q[i, acc, d])
            if not case["uniforms"][i, acc] < ratio:
                break
            acc += 1
        residual = p[i, acc].clone()
        if acc < n_drafts:
            if point_mass:
                residual[case["candidates"][i, acc + 1]] = 0.0
            else:
                residual = (residual - q[i, acc]).clamp_min(0.0)
        if residual.sum() == 0:
            residual = p[i, acc]
        cdf = residual.cumsum(0)
        bonus.append(int((cdf <= case["residual_uniforms"][i] * cdf[-1]).sum()))
        accept_lens.append(acc)
    return accept_lens, bonus


@pytest.mark.parametrize("point_mass", [True, False], ids=["point_mass", "draft_q"])
def test_sampling_torch_matches_loop(point_mass: bool) -> None:
    case = sampling_case(64, 6, 40, seed=3, point_mass=point_mass)
    accept_lens, bonus = naive_sampling_accept(case)
    check_accept_result(sampling_accept_torch(**case), accept_lens, bonus, case["candidates"])
    assert len(set(accept_lens)) >= 4


SAMPLING_SHAPES = [(1, 1, 7), (5, 6, 37), (7, 16, 300), (2, 3, 5000)]  # last one spans two vocab chunks


@needs_triton
@pytest.mark.parametrize("point_mass", [True, False], ids=["point_mass", "draft_q"])
@pytest.mark.parametrize("bs, block, vocab", SAMPLING_SHAPES)
def test_sampling_triton_matches_torch(
    bs: int, block: int, vocab: int, point_mass: bool, poisoned_empty: None
) -> None:
    case = sampling_case(bs, block, vocab, seed=vocab, point_mass=point_mass)
    case = {k: None if v is None else v.to(DEVICE) for k, v in case.items()}
    expected = sampling_accept_torch(**case)
    actual = triton_fn("sampling", "sampling_accept_triton")(**case)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == torch.int64 and torch.equal(a, e)


def first_two_tokens(
    p_pos: torch.Tensor, q_pos: torch.Tensor, point_mass: bool, n: int, always_accept: bool = False
) -> torch.Tensor:
    """Decode n requests with per-position target p and draft q until each emitted two tokens."""
    g = gen(11)
    block, vocab = 3, p_pos.shape[1]
    emitted = torch.full((n, 2 + block), -1)
    count = torch.zeros(n, dtype=torch.int64)
    block_lens = torch.randint(1, block + 1, (n,), generator=g)
    while (count < 2).any():
        rows = (count[:, None] + torch.arange(block)).clamp_max(len(p_pos) - 1)
        p, q = p_pos[rows], q_pos[rows]
        if point_mass:
            drafts = q.argmax(dim=-1)
        else:
            drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(n, block)
        candidates = torch.cat([torch.zeros(n, 1, dtype=torch.int64), drafts[:, :-1]], dim=1)
        uniforms = torch.zeros(n, block) if always_accept else torch.rand(n, block, generator=g)
        acc, _, out = sampling_accept_torch(
            p, candidates, None if point_mass else q, block_lens, uniforms, torch.rand(n, generator=g)
        )
        for j in range(block):
            write = (count < 2) & (j <= acc)
            emitted[write, (count + j)[write]] = out[write, j]
        count = torch.where(count < 2, count + acc + 1, count)
    return emitted[:, :2]


@pytest.mark.parametrize("point_mass", [True, False], ids=["point_mass", "draft_q"])
def test_sampling_is_lossless(point_mass: bool) -> None:
    """The first two emitted tokens follow p0 x p1 (total variation small); accepting always does not."""
    p_pos = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0], [0.05, 0.05, 0.1, 0.3, 0.5], [0.2] * 5])
    q_pos = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.4], [0.6, 0.1, 0.1, 0.1, 0.1], [0.2] * 5])
    vocab, n = p_pos.shape[1], 60_000
    expected = torch.outer(p_pos[0], p_pos[1]).flatten()

    def total_variation(tokens: torch.Tensor) -> float:
        counts = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
        return 0.5 * (counts / n - expected).abs().sum().item()

    assert total_variation(first_two_tokens(p_pos, q_pos, point_mass, n)) < 0.025
    assert total_variation(first_two_tokens(p_pos, q_pos, point_mass, n, always_accept=True)) > 0.1


# ---------------------------------------------------------------- prepare_draft_block


def block_case(table_dtype: torch.dtype) -> tuple:
    g = gen(5)
    rows, max_len, bs = 6, 64, 5
    req_to_token = torch.randperm(rows * max_len, generator=g).view(rows, max_len).to(table_dtype)
    seq_lens = torch.tensor([0, 9, 30, 48, 1])
    return torch.randint(0, 1000, (bs,), generator=g), seq_lens, torch.tensor([3, 0, 5, 2, 4]), req_to_token


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_prepare_draft_block_torch_matches_loop(block_size: int) -> None:
    bonus, seq_lens, pool_idx, table = block_case(torch.int32)
    ids, positions, loc = prepare_draft_block_torch(bonus, seq_lens, pool_idx, table, block_size, 1234)
    for i in range(len(bonus)):
        for t in range(block_size):
            k, pos = i * block_size + t, seq_lens[i].item() + t
            assert ids[k] == (bonus[i] if t == 0 else 1234)
            assert positions[k] == pos and loc[k] == table[pool_idx[i], pos]
    assert all(x.dtype == torch.int64 for x in (ids, positions, loc))


@needs_triton
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_prepare_draft_block_triton_matches_torch(
    block_size: int, table_dtype: torch.dtype, poisoned_empty: None
) -> None:
    args = [x.to(DEVICE) for x in block_case(table_dtype)] + [block_size, 1234]
    expected = prepare_draft_block_torch(*args)
    actual = triton_fn("draft_block", "prepare_draft_block_triton")(*args)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == torch.int64 and torch.equal(a, e)


# ---------------------------------------------------------------- dispatch


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(1)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not use_triton(cpu)
    monkeypatch.setenv(ENV_VAR, "torch")
    assert not use_triton(cpu)
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        use_triton(cpu)
    monkeypatch.setenv(ENV_VAR, "triton")
    if triton_available():
        assert use_triton(cpu)
    else:
        with pytest.raises(RuntimeError, match="triton"):
            use_triton(cpu)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_dispatchers_run_forced_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, backend)
    candidates, target, block_lens = greedy_case(4, 5, seed=0)
    assert torch.equal(
        greedy_accept(candidates, target, block_lens)[2],
        greedy_accept_torch(candidates, target, block_lens)[2],
    )
    case = sampling_case(3, 4, 20, seed=0)
    assert torch.equal(sampling_accept(**case)[2], sampling_accept_torch(**case)[2])
    args = block_case(torch.int64) + (4, 99)
    assert torch.equal(prepare_draft_block(*args)[2], prepare_draft_block_torch(*args)[2])
    kv_args = kv_case(2, 2, 1, 64, 64, torch.float32, seed=0)
    dispatched = run_materialize(materialize_draft_kv, kv_args, torch.float32)[0]
    assert rel_err(dispatched, run_materialize(materialize_draft_kv_torch, kv_args, torch.float32)[0]) < 1e-5
