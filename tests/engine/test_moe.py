"""Mixture of experts (Mixtral, Qwen3-MoE, OLMoE): the grouped expert path against a per-token
reference, the three families against transformers (tiny random models in their real HF format, both
attention backends, chunked prefill), their Hub configs, and int8 / int4 experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hasten import LLM, SamplingParams
from hasten.kernels import cpu_attention
from hasten.model.config import ModelConfig
from hasten.model.linear import DenseLinear
from hasten.model.moe import MoEWeights, moe_forward
from tests.engine.conftest import hf_greedy, random_prompts
from tests.engine.test_arch_models import assert_prompt_logprobs_close

NEW_TOKENS = 12
MODELS = {
    "mixtral": dict(sliding_window=16),
    # layer 0 a dense MLP (mlp_only_layers), layer 1 the MoE block
    "qwen3_moe": dict(config_overrides={"mlp_only_layers": [0]}),
    # a clip small enough to change the results (test_routing_rules_are_what_make_it_match)
    "olmoe": dict(config_overrides={"clip_qkv": 0.3, "norm_topk_prob": True}),
}


def reference_moe(moe: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    probs = torch.softmax(x.double() @ moe.router.double().T, dim=-1)
    for t in range(x.shape[0]):
        top = torch.topk(probs[t], moe.top_k)
        weights = top.values / top.values.sum() if moe.renormalize else top.values
        for w, e in zip(weights.tolist(), top.indices.tolist(), strict=True):
            gate_up = x[t].double() @ moe.gate_up[e].weight.double().T
            inter = gate_up.shape[0] // 2
            out[t] += w * (F.silu(gate_up[:inter]) * gate_up[inter:]) @ moe.down[e].weight.double().T
    return out


class CountingLinear(DenseLinear):
    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.calls: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return super().__call__(x)


def random_moe(experts: int, top_k: int, renormalize: bool, hidden: int = 24, inter: int = 20, seed: int = 0) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    return MoEWeights(router=torch.randn(experts, hidden, generator=g),
                      gate_up=[CountingLinear(torch.randn(2 * inter, hidden, generator=g) * 0.3) for _ in range(experts)],
                      down=[CountingLinear(torch.randn(hidden, inter, generator=g) * 0.3) for _ in range(experts)],
                      top_k=top_k, renormalize=renormalize, weights_in_float=False)


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize(("experts", "top_k", "renormalize"), [(4, 1, False), (5, 2, True), (6, 3, False), (8, 8, True)])
def test_grouped_experts_match_the_per_token_reference(tokens, experts, top_k, renormalize):
    moe = random_moe(experts, top_k, renormalize, seed=tokens * 10 + experts)
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(tokens))
    got = moe_forward(moe, x, F.silu)
    torch.testing.assert_close(got.double(), reference_moe(moe, x), rtol=1e-5, atol=1e-5)
    # one gate_up and one down matmul per active expert, over all of its tokens: tokens x top_k rows in all
    calls = [layer.calls for layer in moe.gate_up]
    assert all(len(c) <= 1 for c in calls) and sum(sum(c) for c in calls) == tokens * top_k
    assert [layer.calls for layer in moe.down] == calls


def test_the_fused_silu_mul_gives_the_same_result():
    from hasten.kernels import decoder_ops

    ops = decoder_ops.load()
    if ops is None:
        pytest.skip("the C++ kernels do not build here")
    moe = random_moe(5, 2, True)
    x = torch.randn(33, 24, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe_forward(moe, x, F.silu, ops.silu_mul), moe_forward(moe, x, F.silu))


@pytest.fixture(scope="module")
def reference(tiny_models):
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            path = tiny_models(name, **MODELS[name])
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            prompts = random_prompts(4, hf.config.vocab_size, seed=5, min_len=30, max_len=70)
            with torch.no_grad():
                logps = [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
            cache[name] = (path, prompts, hf_greedy(hf, prompts, NEW_TOKENS), logps)
        return cache[name]

    return get


def engine(path: str, backend: str, **options) -> LLM:
    if backend == "cpp" and cpu_attention.load() is None:
        pytest.skip("C++ kernel cannot be built here")
    opts = dict(num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=24, attention_backend=backend,
                fused_decoder_ops=backend == "cpp")
    return LLM(path, **{**opts, **options})


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_transformers(reference, name, backend):
    path, prompts, ref, logps = reference(name)
    llm = engine(path, backend)
    model = llm.engine.model
    assert model.loop is None and any(lw.moe is not None for lw in model.layers)
    if name == "qwen3_moe":
        assert model.layers[0].moe is None and model.layers[1].moe is not None
    if name == "mixtral":
        assert 0 < max(model.windows) < min(map(len, prompts))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params)  # batched, chunked prefill (24 tokens a step)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_prompt_logprobs_close(outs, prompts, logps)
    assert [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts] == ref


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
def test_routing_rules_are_what_make_it_match(reference, name):
    """Without Mixtral's renormalisation, or without OLMoE's clip, the results move off transformers'."""
    path, prompts, _, logps = reference(name)
    llm = engine(path, "sdpa")
    for lw in llm.engine.model.layers:
        if name == "mixtral":
            lw.moe.renormalize = False
    if name == "olmoe":
        llm.engine.model.cfg.clip_qkv = None
    outs = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    with pytest.raises(AssertionError):
        assert_prompt_logprobs_close(outs, prompts[:1], logps[:1])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts(reference, tmp_path, mode):
    from hasten.quant.kernels import QuantLinear

    path, prompts, _, logps = reference("mixtral")
    llm = engine(path, "cpp", quantization=mode, quant_cache_dir=str(tmp_path))
    moe_layers = [lw.moe for lw in llm.engine.model.layers if lw.moe is not None]
    assert moe_layers and all(isinstance(layer, QuantLinear) for m in moe_layers for layer in m.gate_up + m.down)
    assert isinstance(moe_layers[0].router, torch.Tensor)  # the router stays dense
    assert list(tmp_path.glob("*.safetensors"))  # every expert was quantized, so the file was written
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    agree = total = 0  # prompt log-probabilities near the float model's
    for p, out, logp in zip(prompts, outs, logps, strict=True):
        for i in range(1, len(p)):
            agree += abs(out.prompt_logprobs[i][p[i]] - logp[i - 1, p[i]].item()) < 0.5
            total += 1
    assert agree / total > 0.9


HUB = {"vocab_size": 1000, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4,
       "num_attention_heads": 32, "num_key_value_heads": 4}


def test_hub_configs():
    mixtral = ModelConfig.from_hf({**HUB, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                   "num_experts_per_tok": 2, "sliding_window": None, "rope_theta": 1e6})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (8, 2, True)
    assert mixtral.moe_layers == [True] * 4 and mixtral.layer_windows == []
    qwen = ModelConfig.from_hf({**HUB, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                                "num_experts_per_tok": 8, "norm_topk_prob": True, "moe_intermediate_size": 768,
                                "decoder_sparse_step": 2, "mlp_only_layers": [1], "head_dim": 128})
    assert qwen.num_experts == 128 and qwen.norm_topk_prob and qwen.qk_norm and not qwen.qk_norm_full
    assert qwen.moe_layers == [False, False, False, True]  # step 2: layers 1 and 3, but 1 is mlp_only
    assert sum(".experts." in n for n in qwen.linear_names()) == 2 * 128
    olmoe = ModelConfig.from_hf({**HUB, "model_type": "olmoe", "num_experts": 64, "num_experts_per_tok": 8,
                                 "clip_qkv": None})
    assert olmoe.arch == "olmoe" and not olmoe.norm_topk_prob and olmoe.qk_norm_full and olmoe.clip_qkv is None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**HUB, "architectures": ["MixtralForCausalLM"], "num_local_experts": 2,
                             "num_experts_per_tok": 3})
