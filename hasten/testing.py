"""Tiny random models in real Hugging Face formats, made on the spot for fast tests."""

from __future__ import annotations

import json
from pathlib import Path

_CORPUS = """The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
To be or not to be, that is the question. All that glitters is not gold. Où est la gare? Ça va très bien, merci.
def main():\n    print("hello world")\n    return 0\n{"name": "hasten", "fast": true, "numbers": [1, 2, 3]}
Emoji 😀 and 漢字 and Ελληνικά test. The capital of France is Paris. Large language models generate tokens.
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer(path: str | Path, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a fixed text (deterministic), with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    init_std: float = 0.1,
    rope_scaling: dict | None = None,
    sliding_window: int | None = None,
    config_overrides: dict | None = None,
) -> Path:
    """Write a random `arch` model + tokenizer into `path`: llama | qwen2 | qwen3 | mistral | gemma2 |
    gemma3 (text) | phi3 | granite | mixtral | qwen3_moe | olmoe (4 experts, top 2). sliding_window:
    Mistral / Phi-3 / Mixtral on every layer, Gemma on its
    sliding layers (Gemma 2: every other one; Gemma 3 here: every other one too, sliding_window_pattern
    2). config_overrides: more fields for the transformers config (multipliers, soft caps, ...)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    common.update(config_overrides or {})
    head_dim = hidden_size // num_heads
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=sliding_window)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=head_dim)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gemma2":
        config = transformers.Gemma2Config(**{"head_dim": head_dim, "sliding_window": sliding_window or 4096, **common})
        cls = transformers.Gemma2ForCausalLM
    elif arch == "gemma3":
        config = transformers.Gemma3TextConfig(**{"head_dim": head_dim, "sliding_window": sliding_window or 4096,
                                                  "sliding_window_pattern": 2, **common})
        cls = transformers.Gemma3ForCausalLM
    elif arch == "phi3":
        config = transformers.Phi3Config(**{"sliding_window": sliding_window, "rope_scaling": rope_scaling, **common})
        cls = transformers.Phi3ForCausalLM
    elif arch == "granite":
        config = transformers.GraniteConfig(**common)
        cls = transformers.GraniteForCausalLM
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2,
                                               "sliding_window": sliding_window, **common})
        cls = transformers.MixtralForCausalLM
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{"head_dim": head_dim, "num_experts": 4, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": hidden_size, "norm_topk_prob": True,
                                                **common})
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "olmoe":
        config = transformers.OlmoeConfig(**{"num_experts": 4, "num_experts_per_tok": 2, **common})
        cls = transformers.OlmoeForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # biases start at zero in HF init: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * init_std)
    model.save_pretrained(str(path))
    meta = {"arch": arch, "seed": seed}
    (path / "hasten_tiny.json").write_text(json.dumps(meta))
    return path
