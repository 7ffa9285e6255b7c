"""A vendor plugin with ``kvcore bench`` cases only (no backend): a small MHA pool on the tests' device (the CPU with
the kernels interpreted, CUDA in compiled runs), so that the cases can be built and checked in the suite
(``kvcore bench`` itself builds them on the GPU)."""

from types import SimpleNamespace

import torch

from kvcore import hookimpl
from kvcore.hookspecs import API_VERSION, GATHER, BenchCase, BenchCases, BenchPool
from kvcore.testing.tensors import test_device
from kvcore.tools.bench import locations, rand

KVCORE_API_VERSION = API_VERSION
TOKENS, HEADS, HEAD_DIM = 256, 2, 16


def make(kernels):
    from kvcore_mha.pool import MHATokenToKVPool

    return MHATokenToKVPool(size=TOKENS, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                            layer_num=2, device=test_device(), enable_memory_saver=False, kernels=kernels)  # fmt: skip


def inputs(n, gen):
    device = test_device()
    return SimpleNamespace(loc=locations(n, gen, TOKENS, device=device), k=rand(gen, n, HEADS, HEAD_DIM, device=device),
                           v=rand(gen, n, HEADS, HEAD_DIM, device=device))  # fmt: skip


#: set by a test to make the store write one row wrong (the check must catch it)
WRONG = {"store": False}


def store(pool, x):
    def call():
        pool.set_kv_buffer(0, x.loc, x.k, x.v)
        if WRONG["store"] and pool.kernels != "native":
            pool.get_key_buffer(0)[x.loc[0]] += 1

    return call


@hookimpl
def kvcore_bench_cases():
    cases = (
        BenchCase(op="vendor set_kv_buffer", pool="vendor_mha", call=store, written=lambda x: x.loc,
                  bytes_per_token=2 * 2 * HEADS * HEAD_DIM * 2),
        BenchCase(op="vendor get_key_buffer rows", pool="vendor_mha",
                  call=lambda pool, x: lambda: pool.get_key_buffer(1)[x.loc], written=GATHER),
    )  # fmt: skip
    yield BenchCases(pools=(BenchPool(name="vendor_mha", make=make),), inputs=inputs, cases=cases)
