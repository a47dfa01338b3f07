"""``kernels.launcher.CachedLaunch``: a cached launch computes what Triton's own launch computes, compiles a new
variant exactly where Triton's cache would (alignment, an int of 1 or a multiple of 16, dtypes, constexprs, options),
gives way to Triton while launch hooks are set, launches inside a captured CUDA graph, and refuses a tensor keyword;
a bound launch (``CachedLaunch.bind``) does the same with its trailing arguments kept (its tensors as addresses)."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

from dash_core.kernels.launcher import cached_launch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@cached_launch
@triton.jit(do_not_specialize=["m"])
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, m, alpha, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    """``out[i] = alpha * x[i] (squared with SQUARE) + y[i] + m`` for ``i < n``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok).to(tl.float32)
    if SQUARE:
        x = x * x
    y = tl.load(y_ptr + offs, mask=ok).to(tl.float32)
    tl.store(out_ptr + offs, (alpha * x + y + m).to(out_ptr.dtype.element_ty), mask=ok)


def _axpy(x, y, out, alpha=0.5, m=0, block=128, square=False, num_warps=4):
    n = out.numel()
    _axpy_kernel[(triton.cdiv(n, block),)](x, y, out, n, m, alpha, BLOCK=block, SQUARE=square, num_warps=num_warps)
    ref = alpha * (x[:n].float() ** (2 if square else 1)) + y[:n].float() + m
    return ref.to(out.dtype)


def _triton_variants() -> int:
    return len(_axpy_kernel.fn.device_caches[torch.cuda.current_device()][0])


def test_cached_launches_match_torch_and_compile_where_triton_would():
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4096, device="cuda", generator=g)
    y = torch.randn(4096, device="cuda", generator=g)
    cases = [  # (x, y, out, kwargs): each a Triton specialisation or a repeat of an earlier one
        (base, y, torch.empty(1024, device="cuda"), {}),
        (base, y, torch.empty(1024, device="cuda"), {"alpha": 2.0, "m": 3}),  # m is not specialised
        (base, y, torch.empty(1000, device="cuda"), {}),  # n not a multiple of 16
        (base, y, torch.empty(1, device="cuda"), {}),  # n == 1: a constant of its own variant
        (base[1:], y, torch.empty(1024, device="cuda"), {}),  # x not 16-byte aligned
        (base[4:], y[4:], torch.empty(1024, device="cuda")[4:], {}),  # aligned again
        (base.half(), y, torch.empty(1024, device="cuda", dtype=torch.float16), {}),
        (base, y, torch.empty(1024, device="cuda"), {"square": True}),
        (base, y, torch.empty(1024, device="cuda"), {"block": 256}),
        (base, y, torch.empty(1024, device="cuda"), {"num_warps": 2}),
    ]
    triton_before, kept_before = _triton_variants(), len(_axpy_kernel._compiled)
    for rep in range(2):  # the second round launches the kept variants, none through Triton
        for x, yy, out, kw in cases:
            ref = _axpy(x, yy, out, **kw)
            torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
        if rep == 0:
            variants = _triton_variants()
    assert _triton_variants() == variants  # nothing compiled in the second round
    # one kept variant for each of Triton's: 8 (the aligned view and the unspecialised m repeat the first case's;
    # the other tests of this file launch with another BLOCK)
    assert len(_axpy_kernel._compiled) - kept_before == variants - triton_before == 8


def test_launch_hooks_take_tritons_path():
    x = torch.randn(256, device="cuda")
    out = torch.empty_like(x)
    _axpy(x, x, out, block=64)  # a kept variant
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _axpy(x, x, out, block=64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_axpy_kernel"]


def test_cached_launch_replays_in_a_cuda_graph():
    x, y = torch.randn(512, device="cuda"), torch.randn(512, device="cuda")
    out = torch.empty_like(x)
    _axpy(x, y, out, block=64)  # compiled and kept outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        _axpy(x, y, out, block=64)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn(512, device="cuda"))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 0.5 * x + y)


def test_a_tensor_keyword_is_refused():
    """A tensor passed by keyword would key the cache by its identity (a new variant kept at every call)."""
    x = torch.randn(64, device="cuda")
    with pytest.raises(TypeError, match="pass tensors positionally"):
        _axpy_kernel[(1,)](x, x, out_ptr=torch.empty_like(x), n=64, m=0, alpha=1.0, BLOCK=64, SQUARE=False)


def test_bound_launches_match_torch_and_specialise_their_leading_arguments():
    """A bound launch keeps n, m, alpha and BLOCK; each call passes x, y and out, whose alignment and dtypes pick
    the variant (as Triton's would), and a keyword of the call (SQUARE) keys it too."""
    g = torch.Generator(device="cuda").manual_seed(1)
    base, y = torch.randn(4096, device="cuda", generator=g), torch.randn(4096, device="cuda", generator=g)
    n = 1024
    bound = _axpy_kernel.bind((triton.cdiv(n, 128),), 3, (n, 0, 0.5), BLOCK=128)
    triton_before = _triton_variants()
    cases = [(base, {}), (base[1:], {}), (base[8:], {}), (base, {"SQUARE": True}), (base.half(), {})]
    for rep in range(2):  # the second round finds every variant kept
        for x, more in cases:
            out = torch.empty(n, device="cuda", dtype=x.dtype)
            bound(x, y, out, **{"SQUARE": False, **more})
            ref = 0.5 * x[:n].float() ** (2 if more.get("SQUARE") else 1) + y[:n]
            torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
        if rep == 0:
            variants = _triton_variants()
    assert _triton_variants() == variants
    assert len(bound._variants) == 4  # base and base[8:] share one: both 16-byte aligned
    assert variants - triton_before <= 4  # at most the same variants, compiled by Triton once each


def test_bound_launch_replays_in_a_cuda_graph_and_refuses_a_wrong_count():
    x, y = torch.randn(512, device="cuda"), torch.randn(512, device="cuda")
    out = torch.empty_like(x)
    bound = _axpy_kernel.bind((8,), 3, (512, 0, 1.0), BLOCK=64, SQUARE=False)
    bound(x, y, out)  # compiled and kept outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        bound(x, y, out)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn(512, device="cuda"))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x + y)
    with pytest.raises(TypeError, match="3 leading arguments"):
        bound(x, y)
    with pytest.raises(TypeError, match="runtime parameters"):
        _axpy_kernel.bind((8,), 3, (512, 0, 1.0, 64))  # BLOCK is a constexpr: a keyword


def test_bound_launch_keeps_its_tensors_as_addresses_and_reads_them_at_each_launch():
    """Kept CUDA tensors go to the C launcher as the addresses the first call found (no driver query a launch);
    each launch reads what they hold then, into the kept output."""
    x, y = torch.randn(512, device="cuda"), torch.randn(512, device="cuda")
    out = torch.empty_like(x)
    bound = _axpy_kernel.bind((8,), 1, (y, out, 512, 0, 2.0), BLOCK=64, SQUARE=False)
    bound(x)
    torch.testing.assert_close(out, 2.0 * x + y)
    (_, rest), = bound._variants.values()
    assert rest[:2] == (y.data_ptr(), out.data_ptr())
    y.copy_(torch.randn(512, device="cuda"))
    x2 = torch.randn(512, device="cuda")
    bound(x2)
    torch.testing.assert_close(out, 2.0 * x2 + y)


@cached_launch
@triton.jit
def _tile_copy_kernel(desc, out_ptr, scale, BLOCK: tl.constexpr):
    """``out[rows of program i] = scale * desc`` over a ``[BLOCK, BLOCK]`` tile loaded through a tensor descriptor."""
    r0 = tl.program_id(0) * BLOCK
    x = desc.load([r0, 0]).to(tl.float32)
    offs = r0 + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], x * scale)


def test_direct_launches_encode_each_descriptor_once_and_match_torch():
    """On Hopper, a kept variant's launch calls the C launcher directly (``launcher._direct``), each tensor
    descriptor's arguments encoded at its first launch only; launches over two descriptors, alternated, read each
    its own tensor, and a new descriptor object over changed memory is encoded anew."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from dash_core.kernels import launcher

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    block = 32
    a, b = (torch.randn(4 * block, block, device="cuda") for _ in range(2))
    descs = [TensorDescriptor.from_tensor(x, [block, block]) for x in (a, b)]
    out = torch.empty_like(a)
    for rep in range(3):
        for x, desc in zip((a, b), descs):
            _tile_copy_kernel[(4,)](desc, out, 2.0, BLOCK=block)
            torch.testing.assert_close(out, 2.0 * x)
    compiled = next(iter(_tile_copy_kernel._compiled.values()))
    direct = launcher._DIRECT[compiled]
    assert direct is not False and [pos for pos, _ in direct[2]] == [0]
    assert all(launcher._EXPANDED[id(d)][0]() is d for d in descs)
    c = torch.randn(4 * block, block, device="cuda")
    _tile_copy_kernel[(4,)](TensorDescriptor.from_tensor(c, [block, block]), out, -1.0, BLOCK=block)
    torch.testing.assert_close(out, -c)
