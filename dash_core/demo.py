"""DASH on a long synthetic context: routing, sparsity, agreement with dense attention, speed.

    python -m dash_core.demo [--context 32768] [--requests 4] [--device cpu|cuda]

The context is made of blocks about one of many "topics" (a direction in key space plus noise).
Each request shares the whole context through the same pages (a prefix-cache hit) and asks one
question: a query that points at a few topics. DASH summarises every block, routes each query
with 1.5-entmax to the blocks about its topics, and attends to those plus the local window. The
demo prints, per request, how many blocks were routed, what fraction of the KV cache was read,
how much of dense attention's probability mass those tokens hold, the error against dense
attention, and the agreement with the float64 oracle.

On a GPU it then times what a user of a served model feels, with the code of ``benchmarks/model.py``
(``dash_core.model_timing``): one decode step of a Llama-3-8B-shaped model (32 layers of random bf16
weights; fewer where GPU memory is short, and the output says so) for the same number of requests at
the same context, each request and layer with its own KV cache (far larger than L2), the whole step
captured in one CUDA graph as the engines capture decode, with DASH and with dense SDPA (cuDNN and flash
backends, also captured), compiled and warmed up before timing. It closes with the whole model's
speed-up over the faster dense kernel, and the attention's alone. The demo's own prefill write and decode
call are reported by their wall-clock time only, which on a GPU is the kernels' compilation.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from . import DashParams, dash_reference
from .layout import PagedKVCache, alloc_summaries
from .llama import LlamaModel, LlamaShape, LlamaWeights
from .model_timing import DashSettings, fit_layers, measure_point, speedup_sentence
from .ops import cache_dash_prefill, paged_dash_decode
from .reference import route


def synthetic_context(n, hq, hkv, d, bs, topics, requests, seed, device, dtype):
    """Keys clustered by topic per block; one question query per request about 1-2 topics."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(topics, hkv, d, generator=g), dim=-1) * 3 * math.sqrt(d) ** 0.5
    block_topic = torch.randint(0, topics, (-(-n // bs),), generator=g)
    k = torch.randn(n, hkv, d, generator=g) + centres[block_topic].repeat_interleave(bs, 0)[:n]
    v = torch.randn(n, hkv, d, generator=g)
    asked = torch.randint(0, topics, (requests, 2), generator=g)
    q = centres[asked].sum(1).repeat_interleave(hq // hkv, 1) * 1.5 + 0.3 * torch.randn(requests, hq, d, generator=g)
    hc = torch.randn(hkv, d, generator=g) * 0.1
    cast = lambda x: x.to(device=device, dtype=dtype)
    return cast(q), cast(k), cast(v), cast(hc), block_topic, asked


def dense_attention(q, k, v):
    """Dense attention of one query ``[Hq, D]`` over ``k, v [L, Hkv, D]``: output and weights (float64)."""
    rep = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(rep, 1).transpose(0, 1)  # [Hq, L, D]
    vv = v.double().repeat_interleave(rep, 1).transpose(0, 1)
    w = torch.softmax((kk @ q.double()[:, :, None])[..., 0] / math.sqrt(q.shape[-1]), dim=-1)
    return (w[:, None, :] @ vv)[:, 0], w


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768, help="tokens of shared context (default 32768)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--scaling-factor", type=float, default=1.0)
    ap.add_argument("--prior", choices=["estimate-diagonal", "mp"], default="estimate-diagonal",
                    help="prior of routed blocks: ~1 via estimate_diagonal (default), or the raw probability mp")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-layers", type=int, default=32,
                    help="GPU: layers of the timed Llama-3-8B-shaped model (default 32, lowered if memory is short)")
    ap.add_argument("--peers", default="cudnn,sdpa",
                    help="GPU: dense peers of the model timing (dash_core.llama.PEERS, or auto for every one)")
    ap.add_argument("--no-model", action="store_true", help="GPU: skip the whole-model timing")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n, bs, page = a.context, a.block_size, a.block_size
    p = DashParams(block_size=bs, topk=a.topk, scaling_factor=a.scaling_factor,
                   estimate_diagonal=a.prior == "estimate-diagonal")
    print(f"DASH demo: context {n} tokens, {a.requests} requests sharing it, Hq {a.heads}, Hkv {a.kv_heads}, "
          f"D {a.head_dim}, block {bs} ({n // bs} blocks), topk {p.topk}, scaling_factor {p.scaling_factor}, "
          f"estimate_diagonal {p.estimate_diagonal}, "
          f"{dev.type} {dtype}")
    q, k, v, hc, block_topic, asked = synthetic_context(n + 1, a.heads, a.kv_heads, a.head_dim, bs, 64,
                                                        a.requests, a.seed, dev, dtype)
    # Paged cache with shuffled pages: the context once, plus one private page per request.
    ctx_pages = -(-n // page)
    num_pages = ctx_pages + a.requests + 1
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(a.seed)).to(dev)
    cache = PagedKVCache.from_sglang(torch.zeros(num_pages * page, a.kv_heads, a.head_dim, dtype=dtype, device=dev),
                                     torch.zeros(num_pages * page, a.kv_heads, a.head_dim, dtype=dtype, device=dev),
                                     page, alloc_summaries(num_pages * page, bs, a.kv_heads, a.head_dim, dtype, dev))
    ctx_slots = (perm[torch.arange(n, device=dev) // page] * page + torch.arange(n, device=dev) % page)
    took = _timed(lambda: cache_dash_prefill(k[:n], v[:n], cache, ctx_slots, p, head_cls=hc), dev)
    print(f"prefill: wrote {n} tokens and summarised {n // bs} blocks in {took}")

    # Each request: the shared context pages, then the question token (position n) on a private page
    # (if the context ends mid-page, the question's slot continues that page in a real engine;
    # here n is a multiple of the page size by default).
    assert n % page == 0, "--context must be a multiple of the block size"
    bt = torch.zeros(a.requests, ctx_pages + 1, dtype=torch.int32, device=dev)
    bt[:, :ctx_pages] = perm[:ctx_pages].to(torch.int32)
    bt[:, ctx_pages] = perm[ctx_pages: ctx_pages + a.requests].to(torch.int32)
    slots = bt[:, ctx_pages].long() * page
    seq = torch.full((a.requests,), n + 1, dtype=torch.int32, device=dev)
    kq = k[n:].expand(a.requests, -1, -1).contiguous()
    vq = v[n:].expand(a.requests, -1, -1).contiguous()
    result = []
    took = _timed(lambda: result.append(paged_dash_decode(q, kq, vq, cache, bt, seq, slots, hc, p)), dev, ".3f")
    out = result[-1]
    print(f"decode: {a.requests} requests in {took}\n")

    summ = cache.summaries[(perm[:ctx_pages].long() * page // bs)].permute(1, 0, 2).cpu().double()
    print(f"{'req':>3} {'asked topics':>12} {'routed':>7} {'on-topic':>8} {'KV read':>8} {'dense mass':>10} "
          f"{'err vs dense':>12} {'err vs oracle':>13}")
    k_all = torch.cat([k[:n], k[n:]]).cpu()
    v_all = torch.cat([v[:n], v[n:]]).cpu()
    for r in range(a.requests):
        qs = (q[r].cpu() * p.scaling_factor).to(dtype)[:, None]
        ncand = n // bs - p.local_blocks + 1
        rt = route(qs, summ[:, :ncand], torch.tensor([ncand]), p)
        kept = rt.kept[:, 0]  # [Hkv, ncand]
        routed = kept.sum(-1).float().mean().item()
        on_topic = torch.isin(block_topic[:ncand], asked[r].cpu())
        on_frac = (kept & on_topic[None]).sum().item() / max(1, kept.sum().item())
        attended = kept.sum(-1).float() + p.local_blocks  # blocks per KV head
        kv_read = (attended * bs).mean().item() / (n + 1)
        dense, w = dense_attention(q[r].cpu(), k_all, v_all)
        tok_blk = torch.arange(n + 1) // bs
        mask = torch.zeros(a.kv_heads, n + 1, dtype=torch.bool)
        mask[:, tok_blk >= n // bs - p.local_blocks + 1] = True
        mask[:, : ncand * bs] = kept.repeat_interleave(bs, 1)
        mass = (w * mask.repeat_interleave(a.heads // a.kv_heads, 0)).sum(-1).mean().item()
        rel = ((out[r].cpu().double() - dense).norm() / dense.norm()).item()
        ref, _ = dash_reference(q[r].cpu()[None, :, None].expand(1, -1, n + 1, -1).contiguous(),
                                k_all.permute(1, 0, 2)[None], v_all.permute(1, 0, 2)[None], hc.cpu(), p, rows=[n])
        oerr = (out[r].cpu().double() - ref[0, :, 0].double()).abs().max().item()
        print(f"{r:>3} {str(asked[r].tolist()):>12} {routed:>7.1f} {on_frac:>8.0%} {kv_read:>8.2%} {mass:>10.1%} "
              f"{rel:>12.2e} {oerr:>13.2e}")
    print("\nrouted = blocks routed per KV head (of", n // bs - p.local_blocks + 1, "candidates); KV read includes the"
          " local window; dense mass = dense attention's probability on the tokens DASH read.")
    dense_eq = DashParams.dense_equivalent(block_size=bs)
    out_eq = paged_dash_decode(q, None, None, cache, bt, seq, None, hc, dense_eq)
    worst = max((out_eq[r].cpu().double() - dense_attention(q[r].cpu(), k_all, v_all)[0]).abs().max().item()
                for r in range(a.requests))
    print(f"dense-equivalent configuration (scaling_factor 0, estimate_diagonal): max |DASH - dense| = {worst:.2e}")
    if dev.type == "cuda" and not a.no_model:
        _time_model(a, dev)


def _timed(fn, dev: torch.device, fmt: str = ".2f") -> str:
    """Run ``fn`` and say how long it took (wall clock). On a GPU that time is the kernels' compilation: a call's
    speed is what the whole-model timing below measures, captured as the engines run it."""
    t0 = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return f"{time.perf_counter() - t0:.2f} s (compiling the kernels; the step's speed is timed below)"
    return f"{time.perf_counter() - t0:{fmt}} s"


def _time_model(a, dev: torch.device, shape=None, settings=None) -> None:
    """One decode step of a Llama-3-8B-shaped model at this demo's batch and context, DASH against dense SDPA,
    timed by ``dash_core.model_timing.measure_point`` (the code of ``benchmarks/model.py``). ``shape`` and
    ``settings`` replace the model's sizes and DASH's settings (tests run it tiny on the CPU)."""
    shape = LlamaShape() if shape is None else shape
    settings = DashSettings() if settings is None else settings
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    layers = a.model_layers
    if cuda:
        torch.cuda.empty_cache()
        layers = fit_layers(shape, layers, "tpot", a.requests, a.context, torch.cuda.mem_get_info(dev)[0], 2,
                            settings.block_size, with_weights=True)
    if layers == 0:
        print("\nGPU model timing skipped: not one layer of the Llama-3-8B-shaped model fits in GPU memory")
        return
    how = ("one decode step captured as one CUDA graph, compiled and warmed up before timing, median of 30 replays"
           if cuda else "one eager decode step (on the CPU: a check of the code, not a timing)")
    print(f"\nGPU, the whole model (the code of benchmarks/model.py): a Llama-3-8B-shaped model, {layers} layers of "
          f"random {'bf16' if cuda else 'fp32'} weights"
          f"{'' if layers == a.model_layers else f' (of {a.model_layers}: GPU memory)'}, {a.requests} requests at "
          f"{a.context} tokens of context, each request and layer with its own KV cache; {how}")
    model = LlamaModel(LlamaWeights(shape, dtype, dev, seed=a.seed, layers=layers))
    recs = measure_point(model, "tpot", a.requests, a.context, a.peers.split(","), settings, seed=a.seed,
                         log=lambda m: None)
    for r in recs:
        if r.get("ms") is None:
            print(f"  {r['method']:18s} not run: {r.get('note')}")
            continue
        extra = ""
        if r["method"] == "dash":
            extra = (f"  (block {r['block_size']}, topk {r['topk']}, local {r['local']}, scaling_factor "
                     f"{r['scaling_factor']}{' calibrated' if r['calibrated'] else ''}: "
                     f"{r['selected_fraction']:.1%} of the blocks routed uncapped)")
        att = "-" if r.get("attention_ms") is None else f"{r['attention_ms']:.3f}"
        print(f"  {r['method']:18s} {r['ms']:8.3f} ms a step, attention {att:>7s} ms{extra}")
    if recs and recs[0].get("no_attention_ms") is not None:
        print(f"  {'no attention':18s} {recs[0]['no_attention_ms']:8.3f} ms a step")
    del model
    if cuda:
        torch.cuda.empty_cache()
    line = speedup_sentence(recs)
    print(line[0].upper() + line[1:])


if __name__ == "__main__":
    main()
