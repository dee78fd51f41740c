"""GGUF files of every family hasten serves, as llama.cpp's convert_hf_to_gguf.py writes them
(tests/fixtures/gguf, rebuilt by make_fixtures.py there): the converted folder holds the original
model's tensors and configuration, and hasten's greedy tokens and prompt logprobs from the .gguf
equal transformers' on them, batched and one by one, on both attention backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from hasten import LLM, SamplingParams  # noqa: E402
from hasten.kernels import cpu_attention  # noqa: E402
from hasten.model.loader import convert_gguf  # noqa: E402
from tests.engine.conftest import hf_greedy, random_prompts  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
SPECS = json.loads((FIXTURES / "specs.json").read_text())
NAMES = sorted(SPECS["models"])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (converted folder, transformers model on it), converted once into a private cache."""
    import os

    import transformers

    cache = tmp_path_factory.mktemp("gguf-cache")
    made: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in made:
            before = os.environ.get("HASTEN_CACHE_DIR")
            os.environ["HASTEN_CACHE_DIR"] = str(cache)
            try:
                folder = convert_gguf(FIXTURES / f"{name}.gguf")
            finally:
                if before is None:
                    os.environ.pop("HASTEN_CACHE_DIR")
                else:
                    os.environ["HASTEN_CACHE_DIR"] = before
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            made[name] = (folder, hf)
        return made[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_conversion_restores_the_original_model(converted, tmp_path, name):
    """Every tensor of the model the fixture was made from (rebuilt from its spec; float16 as in the
    file), under its HF name, and the configuration fields that change the computation."""
    import transformers

    made = SPECS["made_with"]
    if made["transformers"] != transformers.__version__ or made["torch"] != torch.__version__.split("+")[0]:
        pytest.skip(f"fixtures made with {made}; random init may differ in this version")
    from safetensors.torch import load_file

    from hasten.testing import make_tiny_model

    spec = SPECS["models"][name]
    original = make_tiny_model(tmp_path / name, arch=spec["arch"], **spec.get("kwargs", {}))
    want = load_file(str(original / "model.safetensors"))
    folder, hf = converted(name)
    got = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((original / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        want.pop("lm_head.weight", None)
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        # llama.cpp writes matrices as float16 but norms and routers in float32
        exact = torch.allclose(got[key], w.float(), rtol=0, atol=1e-6)
        assert exact or torch.equal(got[key], w.half().float()), key
    ref_cfg = transformers.AutoConfig.from_pretrained(str(original))
    for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
                  "layer_types", "attention_multiplier", "embedding_multiplier", "residual_multiplier",
                  "logits_scaling", "num_experts_per_tok", "norm_topk_prob", "partial_rotary_factor",
                  "original_max_position_embeddings"):
        if hasattr(ref_cfg, field) and field in ref_cfg.to_dict():
            value, ref_value = getattr(hf.config, field), getattr(ref_cfg, field)
            if isinstance(ref_value, float):  # GGUF keeps float32
                ref_value = pytest.approx(ref_value, rel=1e-6)
            assert value == ref_value, field
    if name == "phi3":
        assert hf.config.rope_parameters["long_factor"] == spec["kwargs"]["rope_scaling"]["long_factor"]


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
@pytest.mark.parametrize("name", NAMES)
def test_gguf_model_matches_transformers(converted, name, backend):
    if backend == "cpp" and cpu_attention.load() is None:
        pytest.skip("C++ attention kernel cannot be built here")
    folder, hf = converted(name)
    prompts = random_prompts(3, hf.config.vocab_size, seed=7, min_len=20, max_len=60)
    with torch.no_grad():
        want = hf_greedy(hf, prompts, 10)
        logps = [hf(torch.tensor([p])).logits[0].double().log_softmax(-1) for p in prompts]
    llm = LLM(str(FIXTURES / f"{name}.gguf"), num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=24,
              attention_backend=backend, fused_decoder_ops=backend == "cpp")
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([list(p) for p in prompts], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    single = [llm.generate([list(p)], sp, use_tqdm=False)[0] for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in single] == want
    for p, out, logp in zip(prompts, outs, logps, strict=True):
        err = max(abs(out.prompt_logprobs[i][p[i]] - logp[i - 1, p[i]].item()) for i in range(1, len(p)))
        assert err < 1e-3, err


def projection_layers(model) -> list:
    layers = [model.lm_head]
    for lw in model.layers:
        layers += [lw.qkv_proj, lw.o_proj]
        if lw.moe is not None:
            layers += [*lw.moe.gate_up, *lw.moe.down]
        else:
            layers += [lw.gate_up_proj, lw.down_proj]
    return layers


@pytest.mark.parametrize(("name", "kind"), [(n, "Q8_0") for n in NAMES] + [("mixtral", "Q4_0"), ("phi3", "Q5_1"),
                                                                          ("gemma3", "Q5_0"), ("olmoe", "Q4_1")])
def test_quantized_gguf_served_from_its_blocks(tmp_path, name, kind):
    """Each family's GGUF with quantized matrices (the gguf package's quantizer): quantization="gguf"
    serves every projection (experts and Phi-3's fused ones included) from the file's blocks. With
    float32 activations its prompt logprobs equal the same file served in float32 (the blocks are
    read in the right places); with int8 activations (the default) it runs the same model, to
    within the rounding of activations (which these tiny random models amplify)."""
    from hasten.kernels import quant_linear
    from hasten.quant.kernels import GroupedInt8Linear, Int4HastenLinear
    from tests.quant.gguf_helpers import requantize_gguf

    if quant_linear.load() is None:
        pytest.skip("C++ kernels unavailable")
    path = requantize_gguf(FIXTURES / f"{name}.gguf", tmp_path / f"{name}.{kind}.gguf", kind)
    opts = dict(num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=24)
    exact = LLM(str(path), **opts)
    prompts = random_prompts(2, exact.engine.model_config.vocab_size, seed=3, min_len=20, max_len=50)
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    want = exact.generate(prompts, sp, use_tqdm=False)
    del exact
    for kernels, tol in (({"quant_int8_kernel": "hasten", "quant_int4_kernel": "hasten"}, 1e-3), ({}, 1.0)):
        quant = LLM(str(path), quantization="gguf", **opts, **kernels)
        model = quant.engine.model
        layers = projection_layers(model)
        if model.cfg.tie_word_embeddings:  # the embedding stays float32 here, and so its lm_head
            layers = layers[1:]
        served = {type(layer) for layer in layers}
        assert served <= {GroupedInt8Linear, Int4HastenLinear}, served
        got = quant.generate(prompts, sp, use_tqdm=False)
        for p, a, b in zip(prompts, got, want, strict=True):
            err = max(abs(a.prompt_logprobs[i][p[i]] - b.prompt_logprobs[i][p[i]]) for i in range(1, len(p)))
            assert err < tol, (kernels, err)
        del quant


def _convert_in_process(args: tuple[str, str]) -> str:
    from hasten.model.gguf_convert import convert_gguf_into

    src, out = args
    return str(convert_gguf_into(Path(src), Path(out)))


def test_processes_converting_one_file_at_once_all_get_the_whole_folder(tmp_path):
    """Replicas starting together on a fresh machine convert the same GGUF at the same moment: each
    must end with the complete folder (once, one process removed the folder another was loading)."""
    import multiprocessing as mp

    out = tmp_path / "cache" / "llama-converted"
    with mp.get_context("spawn").Pool(3) as pool:
        got = pool.map(_convert_in_process, [(str(FIXTURES / "llama.gguf"), str(out))] * 3)
    assert got == [str(out)] * 3
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["llama-converted"]  # no copy left behind
    llm = LLM(str(out), num_kv_blocks=32, max_model_len=64)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids) == 2


def test_a_partial_folder_left_by_a_killed_conversion_is_replaced(tmp_path):
    from hasten.model.gguf_convert import convert_gguf_into, is_converted

    out = tmp_path / "cache" / "llama-converted"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{")  # a killed run's half-written folder
    assert convert_gguf_into(FIXTURES / "llama.gguf", out) == out and is_converted(out)
    assert json.loads((out / "config.json").read_text())["architectures"]
    assert out.stat().st_mode & 0o777 == 0o755  # readable like any cache folder
    assert sorted(p.name for p in out.parent.iterdir()) == ["llama-converted"]
