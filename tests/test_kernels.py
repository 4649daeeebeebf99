"""DFlash kernels: Triton vs torch references (contiguous and strided inputs), torch references vs naive loops,
sampling losslessness, dispatch.

Without a cuda/xpu device the Triton kernels run on CPU tensors through the Triton interpreter
(TRITON_INTERPRET=1 is set here, before any Triton kernel module is imported); with one they run natively.
"""

import importlib
import math
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from sglang_dflash.device import accelerator
from sglang_dflash.kernels import (
    greedy_accept,
    greedy_accept_torch,
    materialize_draft_kv,
    materialize_draft_kv_torch,
    sampling_accept,
    sampling_accept_torch,
    use_triton,
)
from sglang_dflash.kernels.backend import ENV_VAR, triton_available, triton_import_error

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


def strided(t: torch.Tensor) -> torch.Tensor:
    """The values of `t` in a view of a zero buffer with every dim stepped by 2 and the dims in reversed
    memory order (a transposed, sliced view), so a kernel that ignores any stride reads zeros or wrong rows."""
    buf = t.new_zeros([2 * s + 1 for s in reversed(t.shape)]).permute(*reversed(range(t.dim())))
    view = buf[tuple(slice(1, None, 2) for _ in t.shape)]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def on_device(case: dict, strided_args: tuple[str, ...] = ()) -> dict:
    """`case` with its tensors on DEVICE, those named in `strided_args` as `strided` views."""
    out = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    return out | {k: strided(out[k]) for k in strided_args}


def strided_params(names: tuple[str, ...]) -> list:
    """One case per tensor argument made strided, and one with all of them strided."""
    return [(name,) for name in names] + [pytest.param(names, id="all")]


def check_same_result(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == torch.int64 and a.is_contiguous() and torch.equal(a, e)


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


KV_TENSORS = ("kv", "k_norm_weight", "positions", "cos_sin_cache", "k_buffer", "v_buffer", "out_cache_loc")


def run_materialize(
    fn: Callable, case: dict, buffer_dtype: torch.dtype, strided_args: tuple[str, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `fn` into random pools whose target slots are NaN; check those are written, the rest untouched."""
    layers, heads, hd = case["kv"].shape[1], case["kv"].shape[3], case["kv"].shape[4]
    g = gen(99)
    pools = [torch.randn(layers, case["slots"], heads, hd, generator=g).to(buffer_dtype) for _ in range(2)]
    k_buf, v_buf = (p.clone() for p in pools)
    k_buf[:, case["out_cache_loc"]] = math.nan
    v_buf[:, case["out_cache_loc"]] = math.nan
    args = on_device({**case, "k_buffer": k_buf, "v_buffer": v_buf}, strided_args)
    del args["slots"]
    fn(**args)
    k_buf, v_buf = args["k_buffer"].cpu(), args["v_buffer"].cpu()
    untouched = torch.ones(case["slots"], dtype=torch.bool)
    untouched[case["out_cache_loc"]] = False
    for pool, buf in zip(pools, (k_buf, v_buf), strict=True):
        assert not buf.isnan().any(), "a target slot was not written"
        assert torch.equal(buf[:, untouched], pool[:, untouched]), "a slot outside out_cache_loc changed"
    return k_buf, v_buf


def check_materialize_triton(case: dict, buffer_dtype: torch.dtype, strided_args: tuple[str, ...] = ()) -> None:
    expected = run_materialize(materialize_draft_kv_torch, case, buffer_dtype)
    triton_impl = triton_fn("draft_kv", "materialize_draft_kv_triton")
    actual = run_materialize(triton_impl, case, buffer_dtype, strided_args)
    tol = 1e-5 if buffer_dtype == torch.float32 else 1e-2
    assert rel_err(actual[0], expected[0]) < tol
    if case["kv"].dtype == buffer_dtype:
        assert torch.equal(actual[1], expected[1])
    else:  # the interpreter narrows floats by truncation, CUDA rounds to nearest even
        assert rel_err(actual[1], expected[1]) < tol


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
    check_materialize_triton(kv_case(*dims, dtype=dtype, seed=sum(dims)), buffer_dtype)


@needs_triton
@pytest.mark.parametrize("strided_args", strided_params(KV_TENSORS), ids=str)
def test_materialize_triton_strided(strided_args: tuple[str, ...]) -> None:
    check_materialize_triton(kv_case(7, 3, 3, 48, 32, torch.float32, seed=4), torch.float32, strided_args)


def cpu_draft_kv() -> Callable:
    """The C++ CPU kernel of materialize_draft_kv (`csrc/draft_kv.cpp`); a skip where it does not build or the tests
    run on an accelerator."""
    from sglang_dflash.kernels.cpu_extensions import cpu_extension

    ext = cpu_extension("draft_kv") if DEVICE.type == "cpu" else None
    if ext is None:
        pytest.skip("the C++ draft_kv kernel did not build here")
    return ext.materialize_draft_kv


@pytest.mark.parametrize("shape", [s for s in KV_SHAPES if s[5] == s[6]], ids=str)
def test_materialize_cpu_kernel_matches_torch(shape: tuple) -> None:
    *dims, dtype, buffer_dtype = shape
    case = kv_case(*dims, dtype=dtype, seed=sum(dims) + 1)
    expected = run_materialize(materialize_draft_kv_torch, case, buffer_dtype)
    actual = run_materialize(cpu_draft_kv(), case, buffer_dtype)
    # float32 norm and RoPE in another order than torch's ops: float32 rounding, then one bf16 rounding
    assert rel_err(actual[0], expected[0]) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("strided_args", strided_params(KV_TENSORS), ids=str)
def test_materialize_cpu_kernel_strided(strided_args: tuple[str, ...]) -> None:
    case = kv_case(7, 3, 3, 48, 32, torch.bfloat16, seed=5)
    expected = run_materialize(materialize_draft_kv_torch, case, torch.bfloat16)
    actual = run_materialize(cpu_draft_kv(), case, torch.bfloat16, strided_args)
    assert rel_err(actual[0], expected[0]) < 1e-2
    assert torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(9, 3, 64), (5, 1, 48)], ids=str)
def test_block_norm_rope_set_kv_cpu_kernel_matches_torch(dtype: torch.dtype, heads: tuple) -> None:
    """A draft layer's block (`block_kv_kernel`): queries, keys and values as strided slices of one wider projection
    (odd head counts, rotary_dim < head_dim for one case), against the torch reference of materialize_draft_kv
    applied to the keys (written) and to the queries (into a scratch pool)."""
    nh, nkv, hd = heads
    rot = hd if hd == 64 else 32
    cpu_draft_kv()
    from sglang_dflash.kernels.draft_kv import block_kv_kernel

    g = gen(nh + hd)
    t, slots = 11, 40
    qkv = torch.randn(t, nh + 2 * nkv + 1, hd, generator=g).to(dtype)  # one extra head: every view is strided
    q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv : nh + 2 * nkv]
    q_w, k_w = ((torch.rand(hd, generator=g) + 0.5).to(dtype) for _ in range(2))
    positions = torch.randint(0, 1000, (t,), generator=g)
    cache = rope_cache(1000, rot)
    loc = torch.randperm(slots, generator=g)[:t]
    k_cache, v_cache = torch.zeros(slots, nkv, hd, dtype=dtype), torch.zeros(slots, nkv, hd, dtype=dtype)
    kernel = block_kv_kernel(q.device, q.dtype, k_cache.dtype)
    assert kernel is not None
    got_q = kernel(q, k, v, q_w, k_w, positions, cache, rot, 1e-6, k_cache, v_cache, loc)
    want_k, want_v = k_cache.clone().zero_()[None], v_cache.clone().zero_()[None]
    materialize_draft_kv_torch(torch.stack([k, v], 1)[:, None], k_w[None], positions, cache, rot, 1e-6, want_k, want_v,
                               loc)
    want_q = torch.zeros(1, t, nh, hd, dtype=dtype)
    materialize_draft_kv_torch(torch.stack([q, q], 1)[:, None], q_w[None], positions, cache, rot, 1e-6, want_q,
                               want_q.clone(), torch.arange(t))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(k_cache, want_k[0]) < tol and rel_err(got_q, want_q[0]) < tol
    assert torch.equal(v_cache, want_v[0])


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


def greedy_case(bs: int, block: int, seed: int, len_dtype: torch.dtype = torch.int64) -> dict:
    """Drafts that mostly agree with the target, so accept lengths cover 0..block-1."""
    g = gen(seed)
    target = torch.randint(0, 50, (bs, block), generator=g)
    drafts = torch.where(torch.rand(bs, block - 1, generator=g) < 0.85, target[:, :-1], 7)
    candidates = torch.cat([torch.randint(0, 50, (bs, 1), generator=g), drafts], dim=1)
    block_lens = torch.randint(1, block + 1, (bs,), generator=g).to(len_dtype)
    return {"candidates": candidates, "target_argmax": target, "block_lens": block_lens}


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
    case = greedy_case(bs, block, seed=bs)
    candidates, target, block_lens = case.values()
    accept_lens, bonus = [], []
    for i in range(bs):
        acc = 0
        while acc < block_lens[i] - 1 and candidates[i, acc + 1] == target[i, acc]:
            acc += 1
        accept_lens.append(acc)
        bonus.append(target[i, acc].item())
    check_accept_result(greedy_accept_torch(**case), accept_lens, bonus, candidates)
    assert len(set(accept_lens)) > min(block, 3) - 1


@needs_triton
@pytest.mark.parametrize("bs, block", [(1, 1), (9, 5), (33, 16), (6, 23)])
@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
def test_greedy_triton_matches_torch(
    bs: int, block: int, len_dtype: torch.dtype, poisoned_empty: None
) -> None:
    case = on_device(greedy_case(bs, block, seed=bs + 1, len_dtype=len_dtype))
    check_same_result(triton_fn("greedy", "greedy_accept_triton")(**case), greedy_accept_torch(**case))


@needs_triton
@pytest.mark.parametrize("strided_args", strided_params(("candidates", "target_argmax", "block_lens")), ids=str)
def test_greedy_triton_strided(strided_args: tuple[str, ...], poisoned_empty: None) -> None:
    case = on_device(greedy_case(7, 11, seed=3, len_dtype=torch.int32))
    actual = triton_fn("greedy", "greedy_accept_triton")(**on_device(case, strided_args))
    check_same_result(actual, greedy_accept_torch(**case))


ALMOST_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def sampling_case(bs: int, block: int, vocab: int, seed: int) -> dict:
    """Partly zeroed (top-k like) target p; drafts are the argmax of a nearby q, so accept lengths vary."""
    g = gen(seed)
    base = torch.randn(bs, block, vocab, generator=g) * 2
    base[..., 0] = 6.0  # keeps every row non-empty

    def dist(noise: float) -> torch.Tensor:
        logits = base + noise * torch.randn(bs, block, vocab, generator=g)
        logits[torch.rand(bs, block, vocab, generator=g) < 0.2] = -math.inf
        logits[..., 0] = base[..., 0]
        return torch.softmax(logits, dim=-1)

    p, q = dist(0.0), dist(0.7)
    candidates = torch.cat([torch.randint(0, vocab, (bs, 1), generator=g), q.argmax(dim=-1)[:, :-1]], dim=1)
    block_lens = torch.randint(1, block + 1, (bs,), generator=g)
    uniforms = torch.rand(bs, block, generator=g)
    if block > 1:  # p(d1) < 1 is all of row 0's mass and d1 is rejected: the residual is empty -> p
        p[0, 0] = torch.nn.functional.one_hot(candidates[0, 1], vocab) * ALMOST_ONE
        block_lens[0], uniforms[0, 0] = block, ALMOST_ONE
    return {
        "target_probs": p,
        "candidates": candidates,
        "block_lens": block_lens,
        "uniforms": uniforms,
        "bonus_uniforms": torch.rand(bs, generator=g),
    }


SAMPLING_TENSORS = ("target_probs", "candidates", "block_lens", "uniforms", "bonus_uniforms")


def naive_sampling_accept(case: dict) -> tuple[list[int], list[int]]:
    """Rejection sampling of point-mass drafts, one request at a time in float64."""
    p = case["target_probs"].double()
    accept_lens, bonus = [], []
    for i in range(p.shape[0]):
        acc, n_drafts = 0, case["block_lens"][i].item() - 1
        while acc < n_drafts and case["uniforms"][i, acc] < p[i, acc, case["candidates"][i, acc + 1]]:
            acc += 1
        residual = p[i, acc].clone()
        if acc < n_drafts:
            residual[case["candidates"][i, acc + 1]] = 0.0
        if residual.sum() == 0:
            residual = p[i, acc]
        cdf = residual.cumsum(0)
        bonus.append(int((cdf <= case["bonus_uniforms"][i] * cdf[-1]).sum()))
        accept_lens.append(acc)
    return accept_lens, bonus


def test_sampling_torch_matches_loop() -> None:
    case = sampling_case(64, 6, 40, seed=3)
    accept_lens, bonus = naive_sampling_accept(case)
    check_accept_result(sampling_accept_torch(**case), accept_lens, bonus, case["candidates"])
    assert len(set(accept_lens)) >= 4
    assert accept_lens[0] == 0 and bonus[0] == case["candidates"][0, 1]  # the empty residual row


SAMPLING_SHAPES = [(1, 1, 7), (5, 6, 37), (7, 16, 300), (2, 3, 5000)]  # last one spans two vocab chunks


@needs_triton
@pytest.mark.parametrize("bs, block, vocab", SAMPLING_SHAPES)
def test_sampling_triton_matches_torch(bs: int, block: int, vocab: int, poisoned_empty: None) -> None:
    case = on_device(sampling_case(bs, block, vocab, seed=vocab))
    check_same_result(triton_fn("sampling", "sampling_accept_triton")(**case), sampling_accept_torch(**case))


@needs_triton
@pytest.mark.parametrize("strided_args", strided_params(SAMPLING_TENSORS), ids=str)
def test_sampling_triton_strided(strided_args: tuple[str, ...], poisoned_empty: None) -> None:
    case = on_device(sampling_case(5, 7, 4099, seed=5))  # two vocabulary chunks
    actual = triton_fn("sampling", "sampling_accept_triton")(**on_device(case, strided_args))
    check_same_result(actual, sampling_accept_torch(**case))


@needs_triton
def test_sampling_triton_uniform_columns_of_one_tensor(poisoned_empty: None) -> None:
    """What the workers pass: uniforms[:, :B] and the column uniforms[:, B] of one [bs, B + 1] tensor."""
    bs, block, vocab = 6, 5, 300
    case = on_device(sampling_case(bs, block, vocab, seed=8))
    u = torch.rand(bs, block + 1, generator=gen(9)).to(DEVICE)
    case |= {"uniforms": u[:, :block], "bonus_uniforms": u[:, block]}
    expected = sampling_accept_torch(**{k: v.contiguous() for k, v in case.items()})
    check_same_result(triton_fn("sampling", "sampling_accept_triton")(**case), expected)


def first_two_tokens(p_pos: torch.Tensor, q_pos: torch.Tensor, n: int, always_accept: bool = False) -> torch.Tensor:
    """Decode n requests with per-position target p and drafts argmax q until each emitted two tokens."""
    g = gen(11)
    block = 3
    emitted = torch.full((n, 2 + block), -1)
    count = torch.zeros(n, dtype=torch.int64)
    block_lens = torch.randint(1, block + 1, (n,), generator=g)
    while (count < 2).any():
        rows = (count[:, None] + torch.arange(block)).clamp_max(len(p_pos) - 1)
        drafts = q_pos[rows].argmax(dim=-1)
        candidates = torch.cat([torch.zeros(n, 1, dtype=torch.int64), drafts[:, :-1]], dim=1)
        uniforms = torch.zeros(n, block) if always_accept else torch.rand(n, block, generator=g)
        acc, _, out = sampling_accept_torch(p_pos[rows], candidates, block_lens, uniforms, torch.rand(n, generator=g))
        for j in range(block):
            write = (count < 2) & (j <= acc)
            emitted[write, (count + j)[write]] = out[write, j]
        count = torch.where(count < 2, count + acc + 1, count)
    return emitted[:, :2]


def test_sampling_is_lossless() -> None:
    """The first two emitted tokens follow p0 x p1 (total variation small); accepting always does not."""
    p_pos = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0], [0.05, 0.05, 0.1, 0.3, 0.5], [0.2] * 5])
    q_pos = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.4], [0.6, 0.1, 0.1, 0.1, 0.1], [0.2] * 5])
    vocab, n = p_pos.shape[1], 60_000
    expected = torch.outer(p_pos[0], p_pos[1]).flatten()

    def total_variation(tokens: torch.Tensor) -> float:
        counts = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
        return 0.5 * (counts / n - expected).abs().sum().item()

    assert total_variation(first_two_tokens(p_pos, q_pos, n)) < 0.025
    assert total_variation(first_two_tokens(p_pos, q_pos, n, always_accept=True)) > 0.1


# ---------------------------------------------------------------- dispatch


def test_backend_selection(force_kernels) -> None:
    cpu = torch.zeros(1)
    force_kernels(None)
    assert not use_triton(cpu)
    force_kernels("torch")
    assert not use_triton(cpu)
    force_kernels("cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        use_triton(cpu)
    force_kernels("triton")
    if triton_available():
        assert use_triton(cpu)
    else:
        with pytest.raises(RuntimeError, match="triton"):
            use_triton(cpu)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_dispatchers_run_forced_backend(backend: str, force_kernels) -> None:
    force_kernels(backend)
    case = on_device(greedy_case(4, 5, seed=0))
    assert torch.equal(greedy_accept(**case)[2], greedy_accept_torch(**case)[2])
    case = on_device(sampling_case(3, 4, 20, seed=0))
    assert torch.equal(sampling_accept(**case)[2], sampling_accept_torch(**case)[2])
    kv_args = kv_case(2, 2, 1, 64, 64, torch.float32, seed=0)
    dispatched = run_materialize(materialize_draft_kv, kv_args, torch.float32)[0]
    assert rel_err(dispatched, run_materialize(materialize_draft_kv_torch, kv_args, torch.float32)[0]) < 1e-5


def test_dispatchers_check_shapes() -> None:
    case = sampling_case(3, 4, 20, seed=0)
    with pytest.raises(AssertionError):  # all B + 1 uniforms instead of the first B
        sampling_accept(**case | {"uniforms": torch.rand(3, 5)})
    with pytest.raises(AssertionError):
        greedy_accept(**greedy_case(3, 4, seed=0) | {"block_lens": torch.ones(4, dtype=torch.int64)})
    kv_args = kv_case(2, 2, 1, 64, 64, torch.float32, seed=0)
    with pytest.raises(AssertionError):  # an odd rotary_dim
        run_materialize(materialize_draft_kv, kv_args | {"rotary_dim": 63}, torch.float32)
