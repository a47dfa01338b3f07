"""The model benchmark's DASH path with the Triton kernels (interpreted on the CPU, compiled on a GPU) against
the same model over the PyTorch paged path: the model's tensors (strided values, one workspace per prefill
step, decode through ``graphs.DecodeGraphBuffers``) go through the kernels as the GPU benchmark sends them."""

from __future__ import annotations

import torch

from dash_core import DashParams
from dash_core.kernels.decode.launch import paged_dash_decode_triton
from dash_core.kernels.prefill.launch import paged_dash_prefill_triton
from dash_core.llama import DashAttention, KVStore, LlamaModel, LlamaShape, LlamaWeights, Step, correlated_rows
from graphs.decode import DecodeGraphBuffers
from tests.kernels._kernel_env import KERNEL_DEVICE

DEV = KERNEL_DEVICE
SHAPE = LlamaShape(layers=2, hidden=256, q_heads=4, kv_heads=2, head_dim=64, mlp=256, vocab=32, rope_theta=10000.0)
BS = 16


class KernelDash(DashAttention):
    """``DashAttention`` calling the Triton launchers themselves (the ops take them on CUDA only)."""

    def prepare(self, step):
        super().prepare(step)
        if step.decode and self.buffers.kernel is None:  # on the CPU: the interpreter's scratch
            self.buffers = DecodeGraphBuffers.allocate(
                step.batch, step.block_table.shape[1], SHAPE.q_heads, SHAPE.kv_heads, SHAPE.head_dim, BS,
                self.params, step.store.dtype, step.store.device, io=False, kernel=True)
            self.buffers.fill_metadata(step.block_table, step.seq_lens)

    def __call__(self, layer, q, k, v):
        st = self.step
        cache = st.store.cache(layer)
        if st.decode:
            b = self.buffers
            return paged_dash_decode_triton(q, k, v, cache, b.block_table[: st.batch], b.seq_lens[: st.batch],
                                            st.slot_mapping, self.head_cls[layer], self.params, buffers=b.kernel)
        return paged_dash_prefill_triton(q, k, v, cache, st.block_table, st.cu_seqlens_q, st.seq_lens,
                                         st.slot_mapping, self.head_cls[layer], self.params,
                                         workspace=self.workspace)


def _steps(model, attn, batch, prompt, dev):
    store = KVStore(SHAPE, SHAPE.layers, batch, prompt + 1, BS, BS, torch.bfloat16, dev)
    g = torch.Generator().manual_seed(1)
    x = correlated_rows(batch, prompt, SHAPE.hidden, 0.9, g, torch.bfloat16).to(dev)
    xd = torch.randn(batch, SHAPE.hidden, generator=g).to(torch.bfloat16).to(dev)
    step = Step.prefill(store, prompt)
    attn.prepare(step)
    first = model.forward(x, step, attn).float().cpu()
    step = Step.decode_step(store, prompt + 1)
    attn.prepare(step)
    return first, model.forward(xd, step, attn).float().cpu()


def test_model_on_the_kernels_equals_the_model_on_the_pytorch_path():
    weights = LlamaWeights(SHAPE, torch.bfloat16, "cpu", seed=3)
    p = DashParams(block_size=BS, topk=2, scaling_factor=4.0)
    got = _steps(LlamaModel(weights.to(DEV)), KernelDash(p, weights.to(DEV).head_cls), 2, 80, DEV)
    want = _steps(LlamaModel(weights), DashAttention(p, weights.head_cls), 2, 80, "cpu")
    for g, w in zip(got, want):  # bf16 activations: the kernels' and the oracle's roundings differ
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=0.05, rtol=0.02)
