"""A prefill worker and a decode worker (prefill/decode disaggregation), in one process on the CPU: the prefill
worker computes a prompt's KV into its pool, the decode worker reserves a request row and token slots, and the KV
moves through NIXL (kvcore.transfer; pip install "kvcore[nixl]").  In an engine the two are separate processes
that exchange the agents' metadata over their own channel."""

import torch

import kvcore
from kvcore.transfer import KVTransferAgent

common = ("memory.max_total_tokens=4096", "memory.max_running_requests=8", "model.context_length=4096")
prefill = kvcore.build_pools(kvcore.load_config("disaggregation.mode=prefill", *common))
decode = kvcore.build_pools(kvcore.load_config("disaggregation.mode=decode", *common))

# Prefill: a prompt of 37 tokens, its K and V stored in every layer (random values stand in for the model's).
source = prefill.token_to_kv_pool
prompt = prefill.token_to_kv_pool_allocator.alloc(37)
for layer in range(source.layer_num):
    k = torch.randn(37, source.head_num, source.head_dim, dtype=source.dtype)
    source.set_kv_buffer(layer, prompt, k, -k)

# Decode: a request row (the decode worker keeps 16 beyond its 8 running requests for arriving requests) and
# slots for the prompt's tokens.
row = decode.req_to_token_pool.alloc(1)[0]
slots = decode.token_to_kv_pool_allocator.alloc(37)
decode.req_to_token_pool.write((row, slice(0, 37)), slots.to(torch.int32))

with KVTransferAgent("prefill", source) as sender, KVTransferAgent("decode", decode.token_to_kv_pool) as receiver:
    sender.connect(receiver.metadata())  # the receiver's agent and buffers, sent out of band in an engine
    moved = sender.write("decode", prompt, slots)
    moved.wait()

target = decode.token_to_kv_pool
same = all(torch.equal(target.get_key_buffer(layer)[slots], source.get_key_buffer(layer)[prompt])
           and torch.equal(target.get_value_buffer(layer)[slots], source.get_value_buffer(layer)[prompt])
           for layer in range(source.layer_num))  # fmt: skip
print(f"moved {moved.bytes} bytes of {source.layer_num} layers into request row {row}: identical {same}")
