"""The KV of one 32k-token Llama-3-8B request (32 layers, page 16: 4 GiB) moved between two pools on one GPU through
kvcore.transfer (NIXL, UCX, VRAM), beside the device copy ceiling and the torch path (index copies); every moved byte
checked.  Needs a GPU and NIXL (pip install "kvcore[nixl]"; on a machine without a registry, carry the nixl and
nixl-cu13 wheels as benchmarks/device_session.sh carries omegaconf's).

    python benchmarks/bench_transfer.py            # results also in $OUT/transfer.json (default /tmp)"""
import os, time, statistics, json
import torch
import kvcore
from kvcore.transfer import KVTransferAgent

N = 32768
common = ("model=llama-3-8b", "hardware=h200", "kv_cache.page_size=16", "memory.max_total_tokens=36864",
          "memory.max_running_requests=8")
a = kvcore.build_pools(kvcore.load_config("disaggregation.mode=prefill", *common))
b = kvcore.build_pools(kvcore.load_config("disaggregation.mode=decode", *common))
pa, pb = a.token_to_kv_pool, b.token_to_kv_pool
for buf in pa.buffers().values():
    buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8, device="cuda"))
src = a.token_to_kv_pool_allocator.alloc(N)
dst = b.token_to_kv_pool_allocator.alloc(N)
nbytes = N * pa.layer_num * 2 * pa.head_num * pa.head_dim * 2
print(f"request: {N} tokens, {nbytes / 2**30:.2f} GiB", flush=True)
res = {}
with KVTransferAgent("prefill", pa) as sa, KVTransferAgent("decode", pb) as sb:
    sa.connect(sb.metadata())
    for name, d in (("contiguous pages", dst), ("pages shuffled", None)):
        if d is None:  # destination pages in a random order: one descriptor per page and buffer
            pages = dst.view(-1, 16)[torch.randperm(N // 16, device="cuda")]
            d = pages.reshape(-1)
        times = []
        for i in range(3):
            torch.cuda.synchronize(); t = time.perf_counter()
            x = sa.write("decode", src, d); x.wait()
            times.append(time.perf_counter() - t)
        u8 = lambda t: t.contiguous().view(torch.uint8)  # random bytes hold NaNs as bf16: compare bytes
        ok = all(torch.equal(u8(pb.get_key_buffer(l)[d]), u8(pa.get_key_buffer(l)[src])) and
                 torch.equal(u8(pb.get_value_buffer(l)[d]), u8(pa.get_value_buffer(l)[src])) for l in range(pa.layer_num))
        med = statistics.median(times[1:])
        res[name] = dict(seconds=med, gbps=x.bytes / med / 1e9, descriptors=x.descriptors, bytes=x.bytes, exact=ok)
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res[name].items()}, flush=True)
# ceiling: one device copy of as many bytes
s = torch.empty(nbytes, dtype=torch.uint8, device="cuda"); t2 = torch.empty_like(s)
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ts = []
for _ in range(6):
    e0.record(); t2.copy_(s); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) / 1e3)
ceil = statistics.median(ts[1:])
res["device copy ceiling"] = dict(seconds=ceil, gbps=nbytes / ceil / 1e9)
# torch path: index copies per layer and buffer (what an engine without a transfer engine does in one process)
ts = []
for _ in range(4):
    torch.cuda.synchronize(); t = time.perf_counter()
    for l in range(pa.layer_num):
        pb.get_key_buffer(l)[dst] = pa.get_key_buffer(l)[src]
        pb.get_value_buffer(l)[dst] = pa.get_value_buffer(l)[src]
    torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
tp = statistics.median(ts[1:])
res["torch index copies"] = dict(seconds=tp, gbps=nbytes / tp / 1e9)
for k in ("device copy ceiling", "torch index copies"):
    print(k, {a: round(b, 4) for a, b in res[k].items()}, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "transfer.json"), "w"), indent=1)
