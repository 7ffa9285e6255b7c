"""Host cost of one Triton launch on this GPU by path (JIT dispatcher, compiled launcher, its C entry) beside a
bare torch op, index_put and the tensor calls a hot path makes (the probe behind kvcore.kernels.launch).

    python3 benchmarks/probe_launch.py
"""
import time, torch, triton, triton.language as tl
from triton import knobs

dev = "cuda"

@triton.jit
def copy7(dst, src, loc, loc_stride, n, s0, s1, BLOCK: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.load(loc + offs * loc_stride, mask=m, other=0).to(tl.int64)
    c = tl.arange(0, W)
    x = tl.load(src + offs[:, None] * s0 + c[None, :] * s1, mask=m[:, None])
    tl.store(dst + r[:, None] * W + c[None, :], x, mask=m[:, None])

def host_us(fn, n=3000):
    for _ in range(100): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return h

dst = torch.zeros(4096, 128, device=dev, dtype=torch.bfloat16)
src = torch.randn(8, 128, device=dev, dtype=torch.bfloat16)
loc = torch.arange(1, 9, device=dev)
x = torch.zeros(16, device=dev)
res = {}
res["x.add_(0)"] = host_us(lambda: x.add_(0))
res["index_put (dst[loc]=src)"] = host_us(lambda: dst.__setitem__(loc, src))
res["torch.empty(8,576)"] = host_us(lambda: torch.empty((8, 576), device=dev, dtype=torch.bfloat16))
jit = lambda: copy7[(1,)](dst, src, loc, 1, 8, 128, 1, BLOCK=8, W=128)
res["triton JIT dispatch"] = host_us(jit)
ck = copy7[(1,)](dst, src, loc, 1, 8, 128, 1, BLOCK=8, W=128)
get_stream = torch._C._cuda_getCurrentRawStream
args = (dst, src, loc, 1, 8, 128, 1, 8, 128)
res["CompiledKernel.run, tensors"] = host_us(lambda: ck.run(1, 1, 1, get_stream(0), ck.function, ck.packed_metadata, None, None, None, *args))
pargs = (dst.data_ptr(), src.data_ptr(), loc.data_ptr(), 1, 8, 128, 1, 8, 128)
res["CompiledKernel.run, int pointers"] = host_us(lambda: ck.run(1, 1, 1, get_stream(0), ck.function, ck.packed_metadata, None, None, None, *pargs))
launch = ck.run.launch
fn, md = ck.function, ck.packed_metadata
coop, pdl = ck.run.launch_cooperative_grid, ck.run.launch_pdl
res["launcher.launch, int pointers"] = host_us(lambda: launch(1, 1, 1, get_stream(0), fn, coop, pdl, None, None, md, None, None, None, *pargs))
res["get_stream"] = host_us(lambda: get_stream(0))
res["torch.cuda.current_stream().cuda_stream"] = host_us(lambda: torch.cuda.current_stream().cuda_stream)
res["t.data_ptr()"] = host_us(lambda: src.data_ptr())
res["t.stride()"] = host_us(lambda: src.stride())
res["t.dtype"] = host_us(lambda: src.dtype)
res["t.numel()"] = host_us(lambda: loc.numel())
res["t.shape[0]"] = host_us(lambda: loc.shape[0])
res["t.reshape(-1)"] = host_us(lambda: loc.reshape(-1))
res["t.view(8,1,128) "] = host_us(lambda: src.view(8, 1, 128))
res["t.select(1,0) on 3d"] = host_us(lambda: src.view(8, 1, 128).select(1, 0))
res["knobs.runtime.launch_enter_hook"] = host_us(lambda: knobs.runtime.launch_enter_hook)
# correctness of the direct path
dst.zero_(); launch(1, 1, 1, get_stream(0), fn, coop, pdl, None, None, md, None, None, None, *pargs); torch.cuda.synchronize()
print("direct launch correct:", torch.equal(dst[loc], src))
for k, v in res.items():
    print(f"{k:45s} {v:7.2f} us")
print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
