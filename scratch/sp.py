import sys
import torch
sys.path.insert(0, 'benchmarks')
sys.path.insert(0, '.')
from decode import Layer  # noqa: E402
from dash_core import DashParams  # noqa: E402
from dash_core.kernels.decode import launch  # noqa: E402
from dash_core.kernels.decode.buffers import DecodeBuffers  # noqa: E402

ctx = int(sys.argv[1])
lay = Layer(1, ctx, 8, 128, 64, 64, torch.bfloat16, 'cuda', seed=1000)
g = torch.Generator(device='cuda').manual_seed(7)
q = torch.randn(1, 32, 128, device='cuda', generator=g).to(torch.bfloat16)
p = DashParams(block_size=64, topk=64, scaling_factor=float(sys.argv[2]))
bufs = DecodeBuffers.for_step(q, lay.cache, lay.block_table, p)
seq = torch.full((1,), ctx, dtype=torch.int32, device='cuda')
for _ in range(5):
    launch.route(q, lay.cache, lay.block_table, seq, p, bufs)
torch.cuda.synchronize()
print('npos-ish count', bufs.sel_count[0].tolist())
