"""``model=hf:`` converters of the sparse-attention checkpoints: DeepSeek-V4 (``deepseek_v4``, counted tensor by
tensor with the bytes each is stored in) and MiniMax-M3 (``minimax_m3_vl`` / ``minimax_m3``).  What every converter
shares is in :mod:`kvcore.config.hf_reader`; :data:`kvcore.config.hf.CONVERTERS` lists these beside the others.
"""

from __future__ import annotations

from typing import Any

from kvcore.config.hf_reader import _DTYPES, HFConfig, _embeddings, _gated_mlp, _gqa_attention, _plain_weights
from kvcore.errors import ConfigError


#: bytes of one block scale of DeepSeek's fp8 / fp4 weights: ``scale_fmt: ue8m0`` checkpoints store
#: float8_e8m0fnu scales, older ones (DeepSeek-V3) float32 ``weight_scale_inv``
_UE8M0_SCALE_BYTES, _FP32_SCALE_BYTES = 1, 4
#: DeepSeek-V4's fp4 expert weights: two e2m1 values a byte and one ue8m0 scale per 32 along the input dimension
#: (the reference ``inference/model.py``: ``fp4_block_size = 32``), the same 17 bytes per 32 weights as MXFP4
DSV4_FP4_BLOCK = 32


class _Tally:
    """Parameters and bytes of a checkpoint, tensor by tensor (what :func:`_deepseek_v4` counts)."""

    def __init__(self, model_itemsize: int, fp8_block: tuple[int, int] | None, scale_bytes: int) -> None:
        self.parameters = self.bytes = 0
        self.model_itemsize, self.fp8_block, self.scale_bytes = model_itemsize, fp8_block, scale_bytes

    def plain(self, count: int, itemsize: int | None = None) -> None:
        """Unquantized values: of the model dtype (``itemsize`` None) or of ``itemsize`` bytes (float32: 4)."""
        self.parameters += count
        self.bytes += count * (self.model_itemsize if itemsize is None else itemsize)

    def linear(self, out: int, inp: int, n: int = 1) -> None:
        """``n`` ``[out, inp]`` projections: block-fp8, a scale per ``weight_block_size`` block, in an fp8
        checkpoint, else of the model dtype."""
        if self.fp8_block is None:
            return self.plain(n * out * inp)
        rows, cols = self.fp8_block
        self.parameters += n * out * inp
        self.bytes += n * (out * inp + -(-out // rows) * -(-inp // cols) * self.scale_bytes)

    def fp4(self, out: int, inp: int, n: int = 1) -> None:
        """``n`` ``[out, inp]`` fp4 projections: half a byte a weight and a ue8m0 scale per :data:`DSV4_FP4_BLOCK`
        inputs."""
        self.parameters += n * out * inp
        self.bytes += n * (out * inp // 2 + out * -(-inp // DSV4_FP4_BLOCK) * _UE8M0_SCALE_BYTES)


def _deepseek_v4(cfg: HFConfig) -> dict[str, Any]:
    """DeepSeek-V4 (Flash, Pro; ``DeepseekV4ForCausalLM``): every layer attends to a sliding window of one
    shared 512-wide latent per token and, by its ``compress_ratios`` entry, to compressed latents (ratio 4: one per
    4 tokens, chosen by a lightning indexer; ratio 128: one per 128) -- ``model.deepseek_v4``, the ``dsv4`` plugin's
    section.  ``compress_ratios`` is kept whole: its entries past ``num_hidden_layers`` are the
    multi-token-prediction layers'.

    Parameters are counted tensor by tensor as DeepSeek's reference ``inference/model.py`` (DeepSeek-V4-Flash
    repository) builds them, for the main model only, as DeepSeek's published totals count it (284B Flash, 1.6T
    Pro): token embedding and ``head`` (untied), the final norm, the hyper-connection head (``hc_head_fn`` /
    ``_base`` / ``_scale``); per layer the attention (``attn_sink``, ``wq_a``, ``q_norm``, ``wq_b``, ``wkv``,
    ``kv_norm``, the grouped output ``wo_a`` of ``o_groups x o_lora_rank`` and ``wo_b``), the compressor of a
    ratio-r layer (``ape``, ``wkv``, ``wgate`` twice as wide at ratio 4, whose windows overlap, and its norm), the
    indexer of a ratio-4 layer (``wq_b``, ``weights_proj`` and its own ratio-4 compressor of ``index_head_dim``),
    the MoE (router weight, its score bias -- a token-to-expert table on the first ``num_hash_layers`` instead,
    charged in bytes but not counted as parameters --, ``n_routed_experts`` and ``n_shared_experts`` SwiGLU experts
    of ``moe_intermediate_size``), the two norms and the two hyper-connection mixes (``hc_*_fn`` of
    ``(2 + hc_mult) x hc_mult`` by ``hc_mult x hidden_size``, their bases and scales).  Not counted: the
    ``num_nextn_predict_layers`` MTP layers (recorded, the draft of ``speculative.algorithm=nextn``) and the block
    scales.  This reproduces the released checkpoints' tensor lists exactly (element counts 158069433298 Flash,
    861608274846 Pro with the MTP layer and the scales; see tests/test_hf_config.py).

    ``weight_bytes`` charges each tensor as the released checkpoints store it: the block-fp8 projections
    (``quant_method: fp8``) at a byte plus their ``weight_block_size`` scales (one byte each with ``scale_fmt:
    ue8m0``), the routed
    experts as fp4 (17 bytes per 32 weights with their scales), the embeddings, norms, router, compressor
    projections and ``weights_proj`` at the model dtype, the hyper-connection mixes, sinks, ``ape`` and router
    biases as float32, the hash layers' tables as int64.  The experts are fp4 when ``expert_dtype`` says ``fp4`` and
    also when an fp8 checkpoint's file has no ``expert_dtype`` key: the release revisions of both files lack it,
    and their checkpoints' expert weights are nonetheless packed fp4 (``[out, in / 2]`` bytes and ``[out, in /
    32]`` ue8m0 scales in the published tensor lists); ``expert_dtype: null`` is taken as the key's absence.
    """
    heads, hidden, layers = cfg.integer("num_attention_heads"), cfg.integer("hidden_size"), cfg.integer("num_hidden_layers")
    head_dim, rope = cfg.integer("head_dim"), cfg.integer("qk_rope_head_dim")
    if rope >= head_dim:
        raise ConfigError(f"{cfg.file}: key 'qk_rope_head_dim'={rope} must be less than head_dim={head_dim} (the latent "
                          "is head_dim wide, its last qk_rope_head_dim values rotated)")  # fmt: skip
    ratios = cfg["compress_ratios"]
    if not isinstance(ratios, list) or len(ratios) < layers or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ratios):
        raise ConfigError(f"{cfg.file}: key 'compress_ratios' must list a compression ratio (an integer, 0 for none) "
                          f"for each of the {layers} layers, got {ratios!r}")  # fmt: skip
    q_rank, o_rank, o_groups = cfg.integer("q_lora_rank"), cfg.integer("o_lora_rank"), cfg.integer("o_groups")
    index_heads, index_dim = cfg.integer("index_n_heads"), cfg.integer("index_head_dim")
    experts, shared = cfg.integer("n_routed_experts"), cfg.integer("n_shared_experts", 0, minimum=0)
    moe_inter, top_k = cfg.integer("moe_intermediate_size"), cfg.integer("num_experts_per_tok")
    hash_layers, hc = cfg.integer("num_hash_layers", 0, minimum=0), cfg.integer("hc_mult", 1)
    vocab = cfg.integer("vocab_size")

    weights = cfg.fp8_weights()
    q = cfg.quantization()
    block = q.get("weight_block_size", [128, 128]) if weights else None
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{cfg.file}: key 'quantization_config.weight_block_size' must be two positive integers, got {block!r}")
    expert_dtype = cfg.get("expert_dtype", "fp4" if weights else None)
    if expert_dtype not in ("fp4", None):
        raise ConfigError(f"{cfg.file}: key 'expert_dtype'={expert_dtype!r} is not sized by model=hf: (fp4, or no key: "
                          "the experts stored as the other projections)")  # fmt: skip
    scale_bytes = _UE8M0_SCALE_BYTES if q.get("scale_fmt") == "ue8m0" else _FP32_SCALE_BYTES
    t = _Tally(_DTYPES[cfg.dtype][1], tuple(block) if block else None, scale_bytes)
    f32, i64 = 4, 8

    t.plain(2 * vocab * hidden + hidden)  # embed, head (untied), norm
    t.plain(hc * hc * hidden + hc + 1, f32)  # hc_head_fn, hc_head_base, hc_head_scale
    mix = (2 + hc) * hc
    expert = t.fp4 if expert_dtype == "fp4" else t.linear
    for i in range(layers):
        ratio = ratios[i]
        # attention: sinks, q through q_lora_rank, the one latent, the grouped output projection; four norms
        t.plain(heads, f32)
        t.linear(q_rank, hidden)  # wq_a
        t.linear(heads * head_dim, q_rank)  # wq_b
        t.linear(head_dim, hidden)  # wkv
        t.linear(o_groups * o_rank, heads * head_dim // o_groups)  # wo_a
        t.linear(hidden, o_groups * o_rank)  # wo_b
        t.plain(q_rank + head_dim + 2 * hidden)  # q_norm, kv_norm, attn_norm, ffn_norm
        if ratio:  # the compressor (ape; wkv, wgate; norm): overlapping windows, twice as wide, at ratio 4
            width = (2 if ratio == 4 else 1) * head_dim
            t.plain(ratio * width, f32)
            t.plain(2 * width * hidden + head_dim)
        if ratio == 4:  # the lightning indexer (wq_b, weights_proj) and its own ratio-4 compressor
            t.linear(index_heads * index_dim, q_rank)
            t.plain(index_heads * hidden)
            t.plain(4 * 2 * index_dim, f32)
            t.plain(2 * 2 * index_dim * hidden + index_dim)
        # MoE: the router (a token -> expert table on the hash layers, a score bias elsewhere), routed and shared experts
        t.plain(experts * hidden)
        if i < hash_layers:
            t.bytes += vocab * top_k * i64
        else:
            t.plain(experts, f32)
        for out, inp in ((moe_inter, hidden), (hidden, moe_inter), (moe_inter, hidden)):  # w1, w2, w3
            expert(out, inp, n=experts)
            t.linear(out, inp, n=shared)
        t.plain(2 * (mix * hc * hidden + mix + 3), f32)  # hc_attn_* and hc_ffn_*: fn, base, scale
    spec = cfg.common(attention="deepseek_v4", num_attention_heads=heads,
                      num_key_value_heads=cfg.integer("num_key_value_heads", 1), head_dim=head_dim,
                      parameters=t.parameters, weights={**weights, "weight_bytes": t.bytes})  # fmt: skip
    spec["deepseek_v4"] = {"compress_ratios": list(ratios), "sliding_window": cfg.integer("sliding_window"),
                           "qk_nope_head_dim": head_dim - rope, "qk_rope_head_dim": rope, "index_head_dim": index_dim}  # fmt: skip
    return spec


def _minimax_m3(cfg: HFConfig) -> dict[str, Any]:
    """MiniMax-M3 (``MiniMaxM3SparseForCausalLM``; the released checkpoint is the vision-language wrapper
    ``minimax_m3_vl``, whose language model is ``text_config``): GQA attention with q/k RMSNorms (one weight of
    ``head_dim`` each for ``qk_norm_type: per_head``, else over every head), a dense SwiGLU MLP of
    ``dense_intermediate_size`` on the layers ``moe_layer_freq`` marks 0 and MoE on the others (``num_local_experts``
    of ``intermediate_size``, ``n_shared_experts`` of ``shared_intermediate_size``, the router and, with
    ``use_routing_bias``, its score-correction bias).  ``sparse_attention_config`` gives ``model.minimax_sparse``:
    the layers ``sparse_attention_freq`` marks carry a lightning indexer (``index_q_proj`` of
    ``sparse_num_index_heads`` heads, ``index_k_proj`` of one, both of ``sparse_index_dim`` with their norms), whose
    index keeps no value where ``sparse_disable_index_value`` says 1; without sparse attention the model is plain
    ``mha``.  ``moe_layer_freq`` and ``sparse_attention_freq`` are per-layer lists (a shorter one repeats, as the
    minimax_sparse pool reads it); an integer ``moe_layer_freq`` ``n`` puts MoE on every layer ``i % n == 0``.
    ``attention_output_gate: true`` (false in the released file) is counted as a gate projection of q_proj's size,
    as Qwen3-Next's gated attention has: an assumption, not checked against a checkpoint.

    Counted: the language model only.  Not the vision tower, the projector and the patch-merge MLP (865M in
    MiniMax-M3's checkpoint), nor multi-token-prediction modules (``num_nextn_predict_layers`` is recorded; the
    released checkpoint's tensor list holds none), nor an index value projection (no released sparse layer keeps an
    index value).  The released checkpoint's tensor list sums to 427040140160 parameters; less the vision parts
    that is this count (tests/test_hf_config.py).  Its router weights and biases are float32 (90 MB more than the
    bf16 charge)."""
    text = cfg.sub("text_config") if "text_config" in cfg.data else cfg
    heads, kv_heads, head_dim = text.attention_heads()
    hidden, layers = text.integer("hidden_size"), text.integer("num_hidden_layers")

    def per_layer(key: str, data: HFConfig, default: list[int] | int | None = None) -> list[int]:
        value = data.get(key, default)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:  # a period, as DeepSeek's moe_layer_freq
            return [int(i % value == 0) for i in range(layers)]
        if not isinstance(value, list) or not value or any(v not in (0, 1) for v in value):
            raise ConfigError(f"{cfg.file}: key '{data.prefix}{key}' must list 0 or 1 per layer, got {value!r}")
        return value

    moe_layers = per_layer("moe_layer_freq", text, 1)
    sparse_cfg = text.sub("sparse_attention_config") if text.get("sparse_attention_config") is not None else None
    sparse = sparse_cfg is not None and bool(sparse_cfg.get("use_sparse_attention", True))
    sparse_layers = per_layer("sparse_attention_freq", sparse_cfg) if sparse else [0]

    qk_norm = 0
    if text.get("use_qk_norm", False):
        qk_norm = 2 * head_dim if text.get("qk_norm_type", "per_head") == "per_head" else (heads + kv_heads) * head_dim
    attention = _gqa_attention(text, heads, kv_heads, head_dim, q_gate=bool(text.get("attention_output_gate", False))) + qk_norm
    if sparse:
        index_dim, index_heads = sparse_cfg.integer("sparse_index_dim"), sparse_cfg.integer("sparse_num_index_heads", 1)
        indexer = hidden * index_heads * index_dim + hidden * index_dim + 2 * index_dim  # q and k projections, norms
    count = _embeddings(text)
    for i in range(layers):
        count += attention + 2 * hidden
        if sparse and sparse_layers[i % len(sparse_layers)]:
            count += indexer
        if moe_layers[i % len(moe_layers)]:
            experts, shared = text.integer("num_local_experts"), text.integer("n_shared_experts", 0, minimum=0)
            count += experts * _gated_mlp(hidden, text.integer("intermediate_size")) + experts * hidden
            count += experts if text.get("use_routing_bias", False) else 0
            if shared:
                count += shared * _gated_mlp(hidden, text.integer("shared_intermediate_size", text.integer("intermediate_size")))
        else:
            count += _gated_mlp(hidden, text.integer("dense_intermediate_size"))
    spec = text.common(attention="minimax_sparse" if sparse else "mha", num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, parameters=count, weights=_plain_weights(cfg))  # fmt: skip
    if sparse:
        section: dict[str, Any] = {"index_head_dim": index_dim, "sparse_attention_freq": list(sparse_layers)}
        if sparse_cfg.get("sparse_disable_index_value") is not None:
            section["disable_index_value"] = per_layer("sparse_disable_index_value", sparse_cfg)
        spec["minimax_sparse"] = section
    return spec
