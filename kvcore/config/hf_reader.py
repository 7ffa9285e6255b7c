"""What every ``model=hf:`` converter reads from a ``config.json`` (:class:`HFConfig`) and the parameter counts they
share; the converters are in :mod:`kvcore.config.hf` and :mod:`kvcore.config.hf_sparse`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvcore.errors import ConfigError

logger = logging.getLogger("kvcore.config.hf")  # the name users filter model=hf:'s warnings by

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
    "deepseek_v4": "DeepseekV4ForCausalLM", "minimax_m3_vl": "MiniMaxM3SparseForConditionalGeneration",
    "minimax_m3": "MiniMaxM3SparseForCausalLM",
}  # fmt: skip
#: what a model built from a config.json without a dtype computes in: transformers' default
_DEFAULT_DTYPE = "float32"
_SAID: set[tuple[str, str]] = set()


def _say_once(file: Path, what: str, message: str) -> None:
    """Log ``message`` (a warning) the first time ``what`` is said of ``file`` in this process."""
    if (str(file), what) not in _SAID:
        _SAID.add((str(file), what))
        logger.warning(message)


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

def _plain_weights(cfg: HFConfig) -> dict[str, Any]:
    return cfg.unsupported_quantization() if cfg.quantization() else {}

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
