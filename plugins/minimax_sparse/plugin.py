"""MiniMax's sparse attention pool as a kvcore plugin (entry point ``minimax_sparse``): the backend of models whose
attention is ``minimax_sparse`` (MiniMax-M3)."""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout
from kvcore_minimax_sparse.layout import BACKEND, MiniMaxSparseDims

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_minimax_sparse.layout import minimax_sparse_layout

    return minimax_sparse_layout(request)


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_minimax_sparse.layout import index_dtype, layer_groups
    from kvcore_minimax_sparse.pool import MiniMaxSparseKVPool

    dims: MiniMaxSparseDims = request.section("minimax_sparse")
    dense, with_value, no_value = layer_groups(dims, range(request.start_layer, request.end_layer + 1))
    return MiniMaxSparseKVPool(
        size=sizes["tokens"], page_size=request.page_size, dtype=request.kv_dtype, head_num=request.head_num,
        head_dim=request.head_dim, idx_head_dim=dims.index_head_dim, dense_layer_ids=dense,
        sparse_layer_ids=sorted(with_value + no_value), disable_value_sparse_layer_ids=no_value, device=request.device,
        index_dtype=index_dtype(request), start_layer=request.start_layer, end_layer=request.end_layer + 1,
        kernels=request.kernels,
    )  # fmt: skip


@hookimpl
def kvcore_register_backends():
    return [BackendSpec(name=BACKEND, attention=("minimax_sparse",), layout=layout, create_pool=create_pool,
                        model_sections={"minimax_sparse": MiniMaxSparseDims},
                        description="MiniMax sparse attention: K/V of every layer, and each sparse layer's lightning-"
                        "indexer key (and value, unless disabled) per token")]  # fmt: skip


@hookimpl
def kvcore_bench_cases():
    """``kvcore bench``'s cases of this family (:mod:`kvcore_minimax_sparse.bench`, imported only when the bench
    runs)."""
    from kvcore_minimax_sparse.bench import bench_cases

    return bench_cases()
