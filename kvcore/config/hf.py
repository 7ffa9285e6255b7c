"""Any Hugging Face checkpoint as a model spec: ``model=hf:PATH``.

``PATH`` is a checkpoint's ``config.json`` or the directory holding it (a local snapshot).  The checkpoint's
own config becomes the values a model YAML under ``configs/model/`` would hold: the shared ``model.*`` keys
(:class:`~kvcore.config.ModelConfig`) and the family sections the plugins declare (``model.mla``,
``model.dsa``, ``model.swa``, ``model.mamba``, ``model.deepseek_v4``, ``model.minimax_sparse``).
:func:`hf_model_config` returns that mapping; config loading merges it where a model YAML would go, so overrides
still win (``parallel.tp_size=8``).

Each ``model_type`` has one small converter in :data:`CONVERTERS` (the sparse-attention ones in
:mod:`kvcore.config.hf_sparse`); what they share (reading keys, the parameter count, the dtype) lives in
:class:`~kvcore.config.hf_reader.HFConfig`.  Parameters come from
``model.safetensors.index.json``'s ``metadata.total_size`` when the directory has one (bytes on disk, which are
then also the weights' bytes), otherwise they are counted from the config's dimensions, as the shipped
YAMLs count them: the served language model only (no vision tower, no multi-token-prediction layers).

Every error is a :class:`~kvcore.errors.ConfigError` naming the file and, for a missing or unusable key, the
key; an unsupported ``model_type`` lists the supported ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcore.config.hf_reader import (_DTYPES, HFConfig, _embeddings, _gated_mlp, _gqa_attention, _plain_weights,
                                     _read_json)  # fmt: skip
from kvcore.config.hf_sparse import _deepseek_v4, _minimax_m3
from kvcore.errors import ConfigError

#: the prefix of a ``model=`` option naming a Hugging Face checkpoint
HF_PREFIX = "hf:"


def is_hf_option(option: str) -> bool:
    """Whether a ``model=`` group option names a Hugging Face checkpoint (``hf:PATH``)."""
    return option.startswith(HF_PREFIX)


def hf_model_config(option: str) -> dict[str, Any]:
    """The ``model`` section for ``hf:PATH`` (the ``hf:`` prefix is optional here).

    :raises ConfigError: naming the file, and the key or the supported model types, when the checkpoint
        cannot be described.
    """
    text = option[len(HF_PREFIX):] if is_hf_option(option) else option
    if not text:
        raise ConfigError("model=hf: names no checkpoint; give model=hf:PATH, PATH a config.json or the directory holding it")
    config_file = _config_file(Path(text).expanduser(), option)
    cfg = HFConfig(_read_json(config_file), config_file)
    supported = f"supported model types: {', '.join(sorted(CONVERTERS))} (or describe the model in a YAML file, see configs/model/)"
    if "model_type" not in cfg.data:
        raise ConfigError(f"{config_file}: key 'model_type' is missing, so model=hf: cannot tell the architecture; {supported}")
    converter = CONVERTERS.get(cfg.model_type)
    if converter is None:
        raise ConfigError(f"{config_file}: model_type {cfg.model_type!r} is not supported by model=hf:; {supported}")
    return converter(cfg)


def _config_file(path: Path, option: str) -> Path:
    option = option if is_hf_option(option) else HF_PREFIX + option
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"model={option}: {path.parent} has no config.json; give a checkpoint directory or its config.json")
    elif not path.is_file():
        raise ConfigError(f"model={option}: {path} is neither a file nor a directory; give a checkpoint's config.json or its directory")
    return path


# -- converters, one per model_type --------------------------------------------------------------------------


def _dense(cfg: HFConfig, *, qkv_bias: bool = False, qk_norm: bool = False) -> dict[str, Any]:
    """Llama-style dense decoders (llama, mistral, qwen2, qwen3): GQA attention, a gated MLP, RMSNorms.

    A sliding window on every layer (Mistral 7B v0.1's ``sliding_window``) is applied by attention; the pool keeps
    every token, as SGLang's does for these models (plain ``mha``).  Qwen's ``use_sliding_window`` (window
    layers from ``max_window_layers`` on) has no kvcore layout and is refused.
    """
    heads, kv_heads, head_dim = cfg.attention_heads()
    hidden, layers = cfg.integer("hidden_size"), cfg.integer("num_hidden_layers")
    attention_bias = bool(cfg.get("attention_bias", False))
    per_layer = (
        _gqa_attention(cfg, heads, kv_heads, head_dim, qkv_bias=qkv_bias or attention_bias, o_bias=attention_bias, qk_norm=qk_norm)
        + _gated_mlp(hidden, cfg.integer("intermediate_size"), bias=bool(cfg.get("mlp_bias", False)))
        + 2 * hidden
    )
    if cfg.model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False):
        raise ConfigError(
            f"{cfg.file}: key 'use_sliding_window' is true: Qwen's sliding window on the layers from "
            "max_window_layers on has no kvcore layout; serve the checkpoint with use_sliding_window false"
        )
    return cfg.common(attention="mha", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      parameters=layers * per_layer + _embeddings(cfg), weights=_plain_weights(cfg))  # fmt: skip


def _qwen3_moe(cfg: HFConfig) -> dict[str, Any]:
    """Qwen3 MoE: Qwen3 attention (q/k norms), sparse MoE blocks on every ``decoder_sparse_step``-th layer
    outside ``mlp_only_layers``, dense MLPs elsewhere."""
    heads, kv_heads, head_dim = cfg.attention_heads()
    hidden, layers = cfg.integer("hidden_size"), cfg.integer("num_hidden_layers")
    experts, step = cfg.integer("num_experts"), cfg.integer("decoder_sparse_step", 1)
    dense_only = set(cfg.get("mlp_only_layers", []))
    moe = experts * _gated_mlp(hidden, cfg.integer("moe_intermediate_size")) + hidden * experts
    dense = _gated_mlp(hidden, cfg.integer("intermediate_size"))
    attention = _gqa_attention(cfg, heads, kv_heads, head_dim, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
    count = _embeddings(cfg) + sum(
        attention + 2 * hidden + (moe if i not in dense_only and (i + 1) % step == 0 else dense) for i in range(layers)
    )
    return cfg.common(attention="mha", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      parameters=count, weights=_plain_weights(cfg))  # fmt: skip


#: transformers' Gemma3TextConfig defaults for the keys gemma-3 checkpoints leave out of config.json
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window_pattern": 6,
                        "tie_word_embeddings": True}  # fmt: skip


def _gemma3(cfg: HFConfig) -> dict[str, Any]:
    """Gemma 3: the language model (``text_config`` of a multimodal checkpoint), five sliding-window layers
    per full-attention one (``layer_types``, or ``sliding_window_pattern``).  Keys the released files leave
    out take transformers' Gemma3TextConfig defaults (:data:`GEMMA3_TEXT_DEFAULTS`); the vision tower is not
    counted in the parameters."""
    text = cfg.sub("text_config") if cfg.model_type == "gemma3" else cfg
    text.data = {**{k: v for k, v in GEMMA3_TEXT_DEFAULTS.items() if k not in text.data}, **text.data}
    heads, kv_heads, head_dim = text.attention_heads()
    hidden, layers = text.integer("hidden_size"), text.integer("num_hidden_layers")
    per_layer = _gqa_attention(text, heads, kv_heads, head_dim, qk_norm=True) + _gated_mlp(hidden, text.integer("intermediate_size")) + 4 * hidden
    interval = text.layer_kinds("layer_types", "full_attention", "sliding_window_pattern")
    spec = text.common(attention="swa", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       parameters=layers * per_layer + _embeddings(text, tied_default=True), weights=_plain_weights(cfg))  # fmt: skip
    spec["swa"] = {"sliding_window": text.integer("sliding_window"), "full_attention_interval": interval}
    return spec


#: MXFP4 bytes per 32 weights: 32 4-bit values and one 8-bit scale
MXFP4_BYTES_PER_32 = 17


def _gpt_oss(cfg: HFConfig) -> dict[str, Any]:
    """gpt-oss: alternating sliding / full attention (``layer_types``) with biases and per-head sinks, and
    MoE blocks whose expert matrices ship as MXFP4 (``quant_method: mxfp4``): ``weight_bytes`` charges them
    at :data:`MXFP4_BYTES_PER_32` bytes per 32 and everything else at the model dtype.  The released files name no
    ``torch_dtype``: their unquantized tensors are bfloat16, which is the default here."""
    cfg.dtype_default = "bfloat16"
    heads, kv_heads, head_dim = cfg.attention_heads()
    hidden, layers = cfg.integer("hidden_size"), cfg.integer("num_hidden_layers")
    experts, intermediate = cfg.integer("num_local_experts"), cfg.integer("intermediate_size")
    expert_matrices = layers * experts * (hidden * 2 * intermediate + intermediate * hidden)
    per_layer = (
        _gqa_attention(cfg, heads, kv_heads, head_dim, qkv_bias=True, o_bias=True) + heads  # sinks
        + hidden * experts + experts  # router
        + experts * (2 * intermediate + hidden)  # expert biases
        + 2 * hidden
    )
    count = layers * per_layer + expert_matrices + _embeddings(cfg)
    method = cfg.quantization().get("quant_method")
    if method == "mxfp4":
        other = count - expert_matrices
        weights = {"weight_bytes": -(-expert_matrices * MXFP4_BYTES_PER_32 // 32) + other * _DTYPES[cfg.dtype][1]}
    else:
        weights = _plain_weights(cfg)
    spec = cfg.common(attention="swa", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      parameters=count, weights=weights)  # fmt: skip
    spec["swa"] = {"sliding_window": cfg.integer("sliding_window"),
                   "full_attention_interval": cfg.layer_kinds("layer_types", "full_attention")}  # fmt: skip
    return spec


def _deepseek(cfg: HFConfig) -> dict[str, Any]:
    """DeepSeek-V3 (and R1): multi-head latent attention (``model.mla``), ``first_k_dense_replace`` dense
    layers then MoE layers every ``moe_layer_freq``; deepseek_v32 adds the lightning indexer (``model.dsa``).
    The multi-token-prediction layers (``num_nextn_predict_layers``) are recorded (the draft of
    ``speculative.algorithm=nextn``) but not counted in the parameters; block-fp8
    weights (``quant_method: fp8``) are charged at one byte (their scales are not counted)."""
    heads = cfg.integer("num_attention_heads")
    hidden, layers = cfg.integer("hidden_size"), cfg.integer("num_hidden_layers")
    kv_rank, rope, nope, v_dim = (cfg.integer(k) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    attention = _mla_attention(cfg, heads)
    is_dsa = cfg.model_type == "deepseek_v32"
    if is_dsa:  # the lightning indexer: wq_b, wk, its LayerNorm (weight and bias), weights_proj
        index_heads, index_dim = cfg.integer("index_n_heads"), cfg.integer("index_head_dim")
        attention += cfg.integer("q_lora_rank") * index_heads * index_dim + hidden * index_dim + 2 * index_dim + hidden * index_heads
    experts, shared = cfg.integer("n_routed_experts"), cfg.integer("n_shared_experts", 0, minimum=0)
    moe_inter = cfg.integer("moe_intermediate_size")
    moe = (experts + shared) * _gated_mlp(hidden, moe_inter) + hidden * experts + experts  # router, score bias
    dense = _gated_mlp(hidden, cfg.integer("intermediate_size"))
    first_dense, freq = cfg.integer("first_k_dense_replace", 0, minimum=0), cfg.integer("moe_layer_freq", 1)
    mlps = sum(moe if i >= first_dense and i % freq == 0 else dense for i in range(layers))
    count = layers * (attention + 2 * hidden) + mlps + _embeddings(cfg)
    spec = cfg.common(attention="dsa" if is_dsa else "mla", num_attention_heads=heads,
                      num_key_value_heads=cfg.integer("num_key_value_heads", heads), head_dim=nope + rope, v_head_dim=v_dim,
                      parameters=count, weights=cfg.fp8_weights())  # fmt: skip
    spec["mla"] = {"kv_lora_rank": kv_rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope}
    if is_dsa:
        spec["dsa"] = {"index_head_dim": cfg.integer("index_head_dim")}
    return spec


def _qwen3_next(cfg: HFConfig) -> dict[str, Any]:
    """Qwen3-Next: gated DeltaNet linear attention (per-request state, ``model.mamba``) with a gated
    full-attention layer every ``full_attention_interval`` (or as ``layer_types`` lists them); MoE with a
    shared expert in every layer.  The multi-token-prediction layer is not counted."""
    heads, kv_heads, head_dim = cfg.attention_heads()
    hidden, layers = cfg.integer("hidden_size"), cfg.integer("num_hidden_layers")
    interval = cfg.layer_kinds("layer_types", "full_attention", "full_attention_interval")
    if interval == 0:
        raise ConfigError(f"{cfg.file}: no full-attention layer (key 'layer_types'); kvcore's linear-attention pools need some")
    v_heads, v_dim = cfg.integer("linear_num_value_heads"), cfg.integer("linear_value_head_dim")
    k_heads, k_dim = cfg.integer("linear_num_key_heads"), cfg.integer("linear_key_head_dim")
    conv = cfg.integer("linear_conv_kernel_dim")
    key_dim, value_dim = k_heads * k_dim, v_heads * v_dim
    delta_net = (
        hidden * (2 * key_dim + 2 * value_dim)  # in_proj_qkvz
        + hidden * 2 * v_heads  # in_proj_ba
        + (2 * key_dim + value_dim) * conv  # depthwise conv1d
        + 2 * v_heads  # dt_bias, A_log
        + v_dim  # gated RMSNorm
        + value_dim * hidden  # out_proj
    )
    gated_attention = _gqa_attention(cfg, heads, kv_heads, head_dim, qk_norm=True, q_gate=True)
    experts, step = cfg.integer("num_experts"), cfg.integer("decoder_sparse_step", 1)
    dense_only = set(cfg.get("mlp_only_layers", []))
    moe = (
        experts * _gated_mlp(hidden, cfg.integer("moe_intermediate_size")) + hidden * experts
        + _gated_mlp(hidden, cfg.integer("shared_expert_intermediate_size")) + hidden  # shared expert and its gate
    )
    dense = _gated_mlp(hidden, cfg.integer("intermediate_size"))
    count = _embeddings(cfg) + sum(
        (gated_attention if (i + 1) % interval == 0 else delta_net) + 2 * hidden
        + (moe if i not in dense_only and (i + 1) % step == 0 else dense)
        for i in range(layers)
    )
    spec = cfg.common(attention="mamba", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      parameters=count, weights=_plain_weights(cfg))  # fmt: skip
    spec["mamba"] = {"kind": "gated_delta_net", "num_heads": v_heads, "head_dim": v_dim, "state_size": k_dim,
                     "num_groups": k_heads, "conv_kernel": conv, "full_attention_interval": interval}  # fmt: skip
    if cfg.get("mamba_ssm_dtype") is not None:
        spec["mamba"]["state_dtype"] = str(cfg["mamba_ssm_dtype"])
    return spec


def _mla_attention(cfg: HFConfig, heads: int) -> int:
    """DeepSeek-style latent attention: q (through q_lora_rank when set), the latent KV projection and its norm,
    the per-head up projection, the output projection."""
    hidden = cfg.integer("hidden_size")
    kv_rank, rope, nope, v_dim = (cfg.integer(k) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    q_dim = heads * (nope + rope)
    if cfg.get("q_lora_rank") is None:
        q = hidden * q_dim
    else:  # down projection, its norm, up projection
        q_rank = cfg.integer("q_lora_rank")
        q = hidden * q_rank + q_rank + q_rank * q_dim
    return q + hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden


def _kimi_linear(cfg: HFConfig) -> dict[str, Any]:
    """Kimi-Linear: latent attention (``model.mla``) in the layers ``linear_attn_config.full_attn_layers`` lists
    (counted from 1), Kimi Delta Attention elsewhere (``model.mamba`` of kind ``kimi_delta_attention``: a state of
    ``num_heads x head_dim x head_dim`` and q/k/v convolution windows per request); ``first_k_dense_replace`` dense
    MLPs then MoE with shared experts.  The context is ``model_max_length``.  KDA's small gate projections
    (``f_a``/``f_b``, ``g_a``/``g_b``, ``b_proj``, ``A_log``, ``dt_bias``) are not counted."""
    heads = cfg.integer("num_attention_heads")
    kv_heads = cfg.integer("num_key_value_heads", heads)
    hidden, layers = cfg.integer("hidden_size"), cfg.integer("num_hidden_layers")
    linear = cfg.sub("linear_attn_config")
    full = sorted(int(i) - 1 for i in linear["full_attn_layers"])
    if not full or full[0] < 0 or full[-1] >= layers:
        raise ConfigError(f"{cfg.file}: key 'linear_attn_config.full_attn_layers' must list layers 1..{layers}, got "
                          f"{linear['full_attn_layers']!r}")  # fmt: skip
    kda_heads, kda_dim, conv = linear.integer("num_heads"), linear.integer("head_dim"), linear.integer("short_conv_kernel_size")
    width = kda_heads * kda_dim
    kda = 3 * hidden * width + width * hidden + 3 * width * conv  # q, k, v and o projections, three short convolutions
    experts, shared = cfg.integer("num_experts"), cfg.integer("num_shared_experts", 0, minimum=0)
    moe = (experts + shared) * _gated_mlp(hidden, cfg.integer("moe_intermediate_size")) + hidden * experts + experts
    dense = _gated_mlp(hidden, cfg.integer("intermediate_size"))
    first_dense, freq = cfg.integer("first_k_dense_replace", 0, minimum=0), cfg.integer("moe_layer_freq", 1)
    mla = _mla_attention(cfg, heads)
    count = _embeddings(cfg) + sum(
        (mla if i in full else kda) + 2 * hidden + (moe if i >= first_dense and i % freq == 0 else dense)
        for i in range(layers)
    )
    nope, rope = cfg.integer("qk_nope_head_dim"), cfg.integer("qk_rope_head_dim")
    spec = cfg.common(attention="mamba_mla", num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=nope + rope, v_head_dim=cfg.integer("v_head_dim"), parameters=count,
                      weights=_plain_weights(cfg))  # fmt: skip
    spec["mla"] = {"kv_lora_rank": cfg.integer("kv_lora_rank"), "qk_rope_head_dim": rope, "qk_nope_head_dim": nope}
    spec["mamba"] = {"kind": "kimi_delta_attention", "num_heads": kda_heads, "head_dim": kda_dim, "state_size": kda_dim,
                     "num_groups": kda_heads, "conv_kernel": conv, "full_attention_interval": 4,
                     "full_attention_layers": full}  # fmt: skip
    return spec


#: model_type -> converter (config.json -> the ``model`` section a YAML under configs/model/ would hold)
CONVERTERS: dict[str, Callable[[HFConfig], dict[str, Any]]] = {
    "llama": _dense,
    "mistral": _dense,
    "qwen2": lambda cfg: _dense(cfg, qkv_bias=True),
    "qwen3": lambda cfg: _dense(cfg, qk_norm=True),
    "qwen3_moe": _qwen3_moe,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek,
    "deepseek_v32": _deepseek,
    "qwen3_next": _qwen3_next,
    "kimi_linear": _kimi_linear,
    "deepseek_v4": _deepseek_v4,
    "minimax_m3_vl": _minimax_m3,
    "minimax_m3": _minimax_m3,
}
