"""Any Hugging Face checkpoint as a model spec: ``model=hf:PATH``.

``PATH`` is a checkpoint's ``config.json`` or the directory holding it (a local snapshot).  The checkpoint's
own config becomes the values a model YAML under ``configs/model/`` would hold: the shared ``model.*`` keys
(:class:`~kvcore.config.ModelConfig`) and the family sections the plugins declare (``model.mla``,
``model.dsa``, ``model.swa``, ``model.mamba``).  :func:`hf_model_config` returns that mapping; config
loading merges it where a model YAML would go, so overrides still win (``parallel.tp_size=8``).

Each ``model_type`` has one small converter in :data:`CONVERTERS`; what they share (reading keys, the
parameter count, the dtype) lives in :class:`HFConfig`.  Parameters come from
``model.safetensors.index.json``'s ``metadata.total_size`` when the directory has one (bytes on disk, which are
then also the weights' bytes), otherwise they are counted from the config's dimensions, as the shipped
YAMLs count them: the served language model only (no vision tower, no multi-token-prediction layers).

Every error is a :class:`~kvcore.errors.ConfigError` naming the file and, for a missing or unusable key, the
key; an unsupported ``model_type`` lists the supported ones.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcore.errors import ConfigError

logger = logging.getLogger(__name__)

#: the prefix of a ``model=`` option naming a Hugging Face checkpoint
HF_PREFIX = "hf:"

#: ``torch_dtype`` / ``dtype`` values of a config.json -> (kvcore dtype name, bytes per element)
_DTYPES = {"bfloat16": ("bfloat16", 2), "float16": ("float16", 2), "float32": ("float32", 4)}

_MISSING = object()

#: model_type -> the model class transformers builds for it: what a config.json without ``architectures`` (one a
#: bare config's ``save_pretrained`` wrote: ``[None]`` or nothing) is taken to describe
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
    "gemma3_text": "Gemma3ForCausalLM", "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM", "kimi_linear": "KimiLinearForCausalLM",
}  # fmt: skip
#: what a model built from a config.json without a dtype computes in: transformers' default
_DEFAULT_DTYPE = "float32"
_SAID: set[tuple[str, str]] = set()


def _say_once(file: Path, what: str, message: str) -> None:
    """Log ``message`` (a warning) the first time ``what`` is said of ``file`` in this process."""
    if (str(file), what) not in _SAID:
        _SAID.add((str(file), what))
        logger.warning(message)


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object at top level, not {type(data).__name__}")
    return data


class HFConfig:
    """A ``config.json`` and what every converter reads from it; errors name the file and the key.

    :param data: the parsed ``config.json``.
    :param file: where it came from (its directory may hold ``model.safetensors.index.json``).
    :param prefix: the key path of ``data`` inside the file (``text_config.`` for a multimodal config).
    """

    def __init__(self, data: dict[str, Any], file: Path, prefix: str = "", parent: HFConfig | None = None) -> None:
        self.data, self.file, self.prefix, self.parent = data, file, prefix, parent
        #: the dtype of a model type whose files name none (a converter sets it, saying why)
        self.dtype_default: str | None = None

    # -- keys ------------------------------------------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        """A required key: present and not null."""
        value = self.data.get(key)
        if value is None:
            raise ConfigError(
                f"{self.file}: key '{self.prefix}{key}' is {'null' if key in self.data else 'missing'}; "
                f"model=hf: needs it to describe a {self.model_type} model"
            )
        return value

    def get(self, key: str, default: Any = None) -> Any:
        """An optional key (``default`` when missing or null)."""
        value = self.data.get(key)
        return default if value is None else value

    def integer(self, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
        """An integer key of at least ``minimum``; ``default`` (when given) stands in for a missing or null one."""
        value = self[key] if default is _MISSING else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.file}: key '{self.prefix}{key}' must be an integer of at least {minimum}, got {value!r}")
        return value

    def sub(self, key: str) -> HFConfig:
        """A nested config (``text_config`` of a multimodal checkpoint)."""
        value = self[key]
        if not isinstance(value, dict):
            raise ConfigError(f"{self.file}: key '{self.prefix}{key}' must be a JSON object, got {type(value).__name__}")
        return HFConfig(value, self.file, f"{self.prefix}{key}.", parent=self)

    @property
    def root(self) -> HFConfig:
        return self.parent.root if self.parent is not None else self

    @property
    def model_type(self) -> str:
        return str(self.root.data.get("model_type") or "<none>")

    # -- what every model has --------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The checkpoint's directory name; ``org/name`` for a Hugging Face cache snapshot
        (``models--org--name/snapshots/<revision>/config.json``)."""
        folder = self.file.resolve().parent
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
            return folder.parent.parent.name[len("models--"):].replace("--", "/")
        return folder.name

    @property
    def architecture(self) -> str:
        """The model class ``architectures`` names; for a file without one (``save_pretrained`` of a bare config
        writes ``[None]``), the class transformers builds for its ``model_type`` (said once)."""
        architectures = self.root.get("architectures") or [None]
        if not isinstance(architectures, list):
            raise ConfigError(f"{self.file}: key 'architectures' must be a list naming the model class, got {architectures!r}")
        if architectures[0]:
            return str(architectures[0])
        derived = _ARCHITECTURES[self.model_type]  # every converted model_type has one
        _say_once(self.file, "architecture", f"{self.file} names no model class (architectures={architectures!r}): "
                                             f"taking {derived}, transformers' class for model_type {self.model_type!r}")
        return derived

    @property
    def dtype(self) -> str:
        """The compute dtype (``torch_dtype``, or ``dtype`` in newer files; a nested config may leave it to
        the top level)."""
        for cfg in (self, self.root):
            for key in ("torch_dtype", "dtype"):
                value = cfg.get(key)
                if value is not None:
                    if str(value) not in _DTYPES:
                        raise ConfigError(f"{self.file}: key '{cfg.prefix}{key}'={value!r} is not one of: {', '.join(_DTYPES)}")
                    return _DTYPES[str(value)][0]
        if self.root.dtype_default is not None:
            return self.root.dtype_default
        _say_once(self.file, "dtype", f"{self.file} gives no dtype ('torch_dtype' or 'dtype'): taking {_DEFAULT_DTYPE}, "
                                      "what transformers builds a model from it in (set model.dtype to override)")
        return _DEFAULT_DTYPE

    def common(self, *, attention: str, num_attention_heads: int, num_key_value_heads: int, head_dim: int,
               parameters: int, v_head_dim: int | None = None, weights: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """The shared ``model.*`` keys: dimensions as given, the checkpoint's name, architecture and dtype, and
        its weights (:meth:`weights`, from the index when there is one)."""
        spec = {
            "name": self.name,
            "architecture": self.architecture,
            "attention": attention,
            "num_hidden_layers": self.integer("num_hidden_layers"),
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads,
            "head_dim": head_dim,
            "hidden_size": self.integer("hidden_size"),
            "context_length": self.integer("max_position_embeddings") if "model_max_length" not in self.data
            else self.integer("model_max_length"),
            "dtype": self.dtype,
        }
        if v_head_dim is not None and v_head_dim != head_dim:
            spec["v_head_dim"] = v_head_dim
        nextn = self.data.get("num_nextn_predict_layers")
        if isinstance(nextn, int) and nextn > 0:  # the draft layers of speculative.algorithm=nextn
            spec["num_nextn_predict_layers"] = nextn
        spec.update(self.weights(parameters, weights or {}))
        return spec

    def attention_heads(self) -> tuple[int, int, int]:
        """``(query heads, KV heads, head width)``: KV heads default to the query heads (no GQA) as in
        transformers, the width to ``hidden_size / num_attention_heads``."""
        heads = self.integer("num_attention_heads")
        kv_heads = self.integer("num_key_value_heads", heads)
        if "head_dim" in self.data and self.data["head_dim"] is not None:
            head_dim = self.integer("head_dim")
        else:
            hidden = self.integer("hidden_size")
            if hidden % heads:
                raise ConfigError(f"{self.file}: key '{self.prefix}head_dim' is missing and hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
            head_dim = hidden // heads
        return heads, kv_heads, head_dim

    # -- weights ---------------------------------------------------------------------------------------------

    def weights(self, parameters: int, quantized: dict[str, Any]) -> dict[str, Any]:
        """``num_parameters`` and, for a quantized checkpoint, ``weight_dtype`` / ``weight_bytes``.

        With ``model.safetensors.index.json`` beside the config, its ``metadata.total_size`` (bytes) is the
        weights' size: ``num_parameters`` = total_size / the weight dtype's bytes, and for a mixed-precision
        checkpoint ``weight_bytes`` = total_size.  Otherwise ``parameters`` (counted by the converter) stands,
        with what the converter derived for a quantized checkpoint (``quantized``).
        """
        index = self.file.parent / "model.safetensors.index.json"
        weight_dtype = quantized.get("weight_dtype")
        if index.is_file():
            meta = _read_json(index).get("metadata")
            total = meta.get("total_size") if isinstance(meta, dict) else None
            if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
                raise ConfigError(f"{index}: key 'metadata.total_size' must be the checkpoint's size in bytes, got {total!r}")
            itemsize = 1 if weight_dtype and weight_dtype.startswith("float8") else _DTYPES[self.dtype][1]
            spec: dict[str, Any] = {"num_parameters": total // itemsize}
            if weight_dtype:
                spec["weight_dtype"] = weight_dtype
            if "weight_bytes" in quantized:
                spec["weight_bytes"] = total
            return spec
        return {"num_parameters": parameters, **quantized}

    def quantization(self) -> dict[str, Any]:
        """``quantization_config`` (``{}`` for an unquantized checkpoint)."""
        q = self.root.get("quantization_config") or {}
        if not isinstance(q, dict):
            raise ConfigError(f"{self.file}: key 'quantization_config' must be a JSON object")
        return q

    def fp8_weights(self) -> dict[str, Any]:
        """``weight_dtype`` of a block-fp8 checkpoint (DeepSeek's ``quant_method: fp8``), else nothing."""
        q = self.quantization()
        if not q:
            return {}
        method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
        if method == "fp8" and fmt in ("e4m3", "e5m2"):
            return {"weight_dtype": f"float8_{fmt}fn" if fmt == "e4m3" else "float8_e5m2"}
        return self.unsupported_quantization()

    def unsupported_quantization(self) -> dict[str, Any]:
        """A quantized checkpoint the converter cannot size: fine when the index gives its bytes."""
        if (self.file.parent / "model.safetensors.index.json").is_file():
            return {}
        method = self.quantization().get("quant_method")
        raise ConfigError(
            f"{self.file}: key 'quantization_config.quant_method'={method!r} is not sized by model=hf: for "
            f"model_type {self.model_type!r}; put the checkpoint's model.safetensors.index.json beside config.json "
            "(its total size is then the weights' size), or describe the model in a YAML file with model.weight_bytes"
        )

    def layer_kinds(self, key: str, full: str, interval_key: str | None = None) -> int:
        """The period ``n`` of a hybrid layer pattern: layer ``i`` (from 0) is ``full`` exactly when
        ``(i + 1) % n == 0`` (0: no layer is).  Read from the per-layer list ``key`` (``layer_types``) when the
        file has it, else from the period ``interval_key``.

        :raises ConfigError: naming the key when both are missing, or when the list has no such period.
        """
        layers = self.integer("num_hidden_layers")
        types = self.get(key)
        if types is None:
            return self.integer(interval_key or key)  # names the key when it is missing too
        if not isinstance(types, list) or len(types) != layers:
            raise ConfigError(f"{self.file}: key '{self.prefix}{key}' must list one type per layer ({layers}), got {len(types) if isinstance(types, list) else types!r}")
        is_full = [t == full for t in types]
        for n in [0, *range(1, layers + 1)]:
            if all(is_full[i] == bool(n and (i + 1) % n == 0) for i in range(layers)):
                return n
        raise ConfigError(
            f"{self.file}: key '{self.prefix}{key}' does not repeat one pattern of {full!r} every n-th layer "
            f"(layer i full when (i + 1) % n == 0), which is all kvcore's layer split can express"
        )


# -- parameter counting (the served language model, as the shipped YAMLs count it) -------------------------


def _embeddings(cfg: HFConfig, tied_default: bool = False) -> int:
    """Token embedding, the untied LM head, and the final norm."""
    vocab, hidden = cfg.integer("vocab_size"), cfg.integer("hidden_size")
    tied = bool(cfg.get("tie_word_embeddings", tied_default))
    return vocab * hidden * (1 if tied else 2) + hidden


def _gqa_attention(cfg: HFConfig, heads: int, kv_heads: int, head_dim: int, *, qkv_bias: bool = False,
                   o_bias: bool = False, qk_norm: bool = False, q_gate: bool = False) -> int:  # fmt: skip
    hidden = cfg.integer("hidden_size")
    q, kv = heads * head_dim, kv_heads * head_dim
    count = hidden * q * (2 if q_gate else 1) + 2 * hidden * kv + q * hidden
    if qkv_bias:
        count += q * (2 if q_gate else 1) + 2 * kv
    if o_bias:
        count += hidden
    if qk_norm:
        count += 2 * head_dim
    return count


def _gated_mlp(hidden: int, intermediate: int, bias: bool = False) -> int:
    """gate, up and down projections (SwiGLU / GeGLU)."""
    return 3 * hidden * intermediate + ((2 * intermediate + hidden) if bias else 0)


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


def _plain_weights(cfg: HFConfig) -> dict[str, Any]:
    return cfg.unsupported_quantization() if cfg.quantization() else {}


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
}
