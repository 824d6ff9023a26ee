"""The model families we run, and what sets them apart. All are one decoder (gpu/llama.py); a
family is the names it goes by in config.json and GGUF, and the flags of gpu/model_config.py
it sets. Sliding windows, which layers they apply to, and each layer's RoPE base come from each
file's own settings (hf_loader, gguf_loader).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu.loader.errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_model_type: str  # config.json "model_type"
    hf_architecture: str  # config.json "architectures" entry
    gguf_arch: str | None  # general.architecture (Mistral's GGUFs say "llama")
    qkv_bias: bool = False
    qk_norm: bool = False
    # llama.cpp's converter permutes the q/k rows of "llama" files (for its GPT-J style rope);
    # its Qwen2/Qwen3 converters do not (transformers' GGUF loader agrees).
    gguf_qk_permuted: bool = False
    # Gemma 3: GELU-tanh gate, (1 + w) norms around attention and MLP, scaled embeddings.
    mlp_activation: str = "silu"
    norm_adds_one: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    # Windowed layers rotate with their own RoPE base (Gemma 3's rope_local_base_freq, 10000
    # where a file leaves it out), and every `window_pattern`-th layer is a full one where a
    # file does not list its layer types (transformers' and llama.cpp's default, 6).
    local_rope: bool = False
    window_pattern: int | None = None

    def config_flags(self) -> dict:
        """The ModelConfig fields the family sets (the same from either file format)."""
        return dict(qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                    mlp_activation=self.mlp_activation, norm_adds_one=self.norm_adds_one,
                    sandwich_norms=self.sandwich_norms, scale_embeddings=self.scale_embeddings)


DEFAULT_LOCAL_ROPE_THETA = 10000.0


def pattern_window_layers(pattern: int, num_layers: int) -> tuple[int, ...]:
    """The windowed layers of a pattern: all but every `pattern`-th (Gemma 3: 5 local, 1 global)."""
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


FAMILIES = (
    Family("llama", "llama", "LlamaForCausalLM", "llama", gguf_qk_permuted=True),
    Family("mistral", "mistral", "MistralForCausalLM", None),
    Family("qwen2", "qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    Family("qwen3", "qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True),
    Family("gemma3", "gemma3_text", "Gemma3ForCausalLM", "gemma3", qk_norm=True,
           mlp_activation="gelu_tanh", norm_adds_one=True, sandwich_norms=True,
           scale_embeddings=True, local_rope=True, window_pattern=6),
)
SUPPORTED_HF = ", ".join(f"{f.hf_model_type} ({f.hf_architecture})" for f in FAMILIES)
SUPPORTED_GGUF = tuple(f.gguf_arch for f in FAMILIES if f.gguf_arch)


def hf_family(raw: dict, config_file) -> Family:
    """The family of a config.json, by model_type (or, lacking it, by architectures)."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    for family in FAMILIES:
        if model_type == family.hf_model_type or (
                model_type is None and family.hf_architecture in architectures):
            return family
    raise ModelLoadError(f"{config_file}: model_type '{model_type}' (architectures "
                         f"{architectures}) is not supported; supported: {SUPPORTED_HF}")


def gguf_family(arch: str, path) -> Family:
    for family in FAMILIES:
        if family.gguf_arch == arch:
            return family
    raise ModelLoadError(f"architecture '{arch}' in {path} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF)}")
