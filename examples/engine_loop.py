"""An engine's KV-cache work on kvcore: two requests are prefilled, decode three tokens, and one finishes.
Runs as it is on a CPU (the default config: Qwen2.5-0.5B's pools); README.md shows the same program."""

import torch

import kvcore

cfg = kvcore.load_config("kv_cache.page_size=16", "memory.max_total_tokens=4096")  # model=..., hardware=... too
pools = kvcore.build_pools(cfg)  # plans (kvcore.plan_memory(cfg)), then allocates
requests, allocator, kv = pools.req_to_token_pool, pools.token_to_kv_pool_allocator, pools.token_to_kv_pool
device, layers = kv.device, range(kv.start_layer, kv.end_layer + 1)  # layer ids are global (pipeline stages)


def new_kv(n: int) -> torch.Tensor:
    """What attention would store: K (or V) rows of n tokens, [n, KV heads, head dim]."""
    return torch.randn(n, kv.head_num, kv.head_dim, dtype=kv.dtype, device=device)


# Prefill: two new requests with prompts of 5 and 37 tokens.  alloc_extend takes SGLang's arguments in SGLang's
# order; each length comes as a device tensor and its CPU copy (the copies let the allocator count pages without
# waiting for the device; pass None instead to have it read the device tensors).
prompt_lens = [5, 37]
slots = requests.alloc(len(prompt_lens))  # a request-table row each
prefix_lens = torch.zeros(2, dtype=torch.int64)  # tokens each request has cached already: none, they are new
seq_lens = torch.tensor(prompt_lens, dtype=torch.int64)  # tokens each request has after this step
last_loc = torch.full((2,), -1, dtype=torch.int64)  # each request's last cached location; -1: it has none
extend_num_tokens = int((seq_lens - prefix_lens).sum())  # the new tokens of all requests together: 42
out_cache_loc = allocator.alloc_extend(prefix_lens.to(device), prefix_lens, seq_lens.to(device), seq_lens,
                                       last_loc.to(device), extend_num_tokens)  # int64 [42]: request 0's, then 1's
keys = {}
for layer in layers:
    keys[layer] = new_kv(extend_num_tokens)
    kv.set_kv_buffer(layer, out_cache_loc, keys[layer], new_kv(extend_num_tokens))  # layer: an int or .layer_id
requests.write((slots[0], slice(0, 5)), out_cache_loc[:5])  # the request table: each request's locations
requests.write((slots[1], slice(0, 37)), out_cache_loc[5:])

# Decode: one new token per running request, three steps.  seq_lens already counts the new token; last_loc is
# each request's previous last location (the new one follows it inside its page, or opens a page).
for step in range(3):
    last_loc = torch.stack([requests.req_to_token[s, n - 1] for s, n in zip(slots, seq_lens.tolist())]).long()
    seq_lens += 1
    out_cache_loc = allocator.alloc_decode(seq_lens.to(device), seq_lens, last_loc.to(device))  # int64 [2]
    for layer in layers:
        kv.set_kv_buffer(layer, out_cache_loc, new_kv(2), new_kv(2))
    for s, n, loc in zip(slots, seq_lens.tolist(), out_cache_loc):
        requests.write((s, n - 1), loc)

# Attention reads a request's K and V through its locations.
loc_of_0 = requests.req_to_token[slots[0], :5].long()
assert torch.equal(kv.get_key_buffer(kv.start_layer)[loc_of_0], keys[kv.start_layer][:5])

# Request 0 finishes: its token locations and its request row go back (inside a free group, as an engine frees
# the requests of one step together).
finished_loc = requests.req_to_token[slots[0], : int(seq_lens[0])].long()
allocator.free_group_begin()
allocator.free(finished_loc)
allocator.free_group_end()
requests.free(slots[0])
print(f"{len(layers)} layers, page {allocator.page_size}: request 1 holds {int(seq_lens[1])} tokens; "
      f"{allocator.available_size()} of {allocator.size} token slots free")
