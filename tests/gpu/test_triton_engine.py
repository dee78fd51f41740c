"""The engine's GPU code path end to end, on the CPU: Triton attention and fused ops run in Triton's
interpreter, the step goes through the device runner (one packed copy of the step's tensors) and
the batched device sampler. Greedy tokens must equal transformers' on tiny random models, batched
and one by one, with prefix-cache hits and chunked prefill; the CUDA-graph buckets' padding must
change nothing."""

from __future__ import annotations

import pytest
import torch

from hasten.kernels import triton as triton_kernels

pytestmark = pytest.mark.skipif(not triton_kernels.usable_on("cpu"),
                                reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hasten.testing import make_tiny_model

    made: dict[str, str] = {}

    def get(name: str, **kwargs) -> str:
        if name not in made:
            made[name] = str(make_tiny_model(tmp_path_factory.mktemp(name), **kwargs))
        return made[name]

    return get


def _prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _hf_greedy(path: str, prompts: list[list[int]], new: int, dtype=torch.float32) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def _triton_llm(path: str, **options):
    from hasten import LLM

    llm = LLM(path, attention_backend="triton", **{"num_kv_blocks": 96, "max_model_len": 512, **options})
    engine = llm.engine
    # the GPU path, not the CPU one: device runner, Triton glue, device sampler, flat Triton metadata
    assert type(engine.runner).__name__ == "DeviceModelRunner"
    assert type(engine.model.ops).__name__ == "TritonDecoderOps" and engine.model.loop is None
    assert type(engine.sampler).__name__ == "DeviceSampler"
    return llm


def _greedy(new: int):
    from hasten import SamplingParams

    return SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch,kwargs", [
    ("llama", {}),  # GQA: 4 query heads on 2 kv heads
    ("llama", {"num_heads": 4, "num_kv_heads": 1}),  # MQA
    ("qwen2", {"num_kv_heads": 4}),  # q/k/v biases, MHA
])
def test_greedy_tokens_match_transformers_batched_and_one_by_one(models, arch, kwargs):
    path = models(f"{arch}-{kwargs.get('num_kv_heads', 2)}", arch=arch, **kwargs)
    llm = _triton_llm(path, max_num_batched_tokens=64)
    vocab = llm.engine.model_config.vocab_size
    prompts = _prompts(vocab, [5, 23, 40, 70], seed=len(path))  # 70 > the 64-token budget: chunked prefill
    new = 8
    ref = _hf_greedy(path, prompts, new)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(new), use_tqdm=False)]
    assert batched == ref
    one_by_one = [llm.generate([p], _greedy(new), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert one_by_one == ref


def test_prefix_hits_and_small_chunks_keep_the_tokens(models):
    path = models("llama-2", arch="llama")
    llm = _triton_llm(path, max_num_batched_tokens=16)  # every prompt prefilled in 16-token chunks
    vocab = llm.engine.model_config.vocab_size
    shared = _prompts(vocab, [40], seed=7)[0]
    tails = _prompts(vocab, [3, 9, 1], seed=8)
    prompts = [shared + t for t in tails]
    ref = _hf_greedy(path, prompts, 6)
    first = llm.generate([prompts[0]], _greedy(6), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == ref[0]
    rest = llm.generate(prompts[1:], _greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in rest] == ref[1:]
    assert all(o.num_cached_tokens >= 32 for o in rest)  # the shared 40 tokens' two full blocks came from the cache


def test_float16_model_on_the_triton_path_matches_transformers_in_float16(models):
    path = models("llama-2", arch="llama")
    llm = _triton_llm(path, dtype="float16", max_num_batched_tokens=64)
    assert llm.engine.dtype == torch.float16
    prompts = _prompts(llm.engine.model_config.vocab_size, [12, 30], seed=3)
    ref = _hf_greedy(path, prompts, 6, dtype=torch.float16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(6), use_tqdm=False)]
    assert got == ref


def test_decode_steps_through_the_graph_buckets_change_nothing(models):
    """The CUDA-graph path without capture: decode steps packed padded to their bucket, into the
    bucket's buffer, rows beyond the batch inert; tokens equal the eager path's and transformers'."""
    from hasten.runtime.runner import DeviceModelRunner

    path = models("llama-2", arch="llama")
    llm = _triton_llm(path, max_num_batched_tokens=64, max_num_seqs=8)
    engine = llm.engine
    eager = engine.runner
    padded = DeviceModelRunner(engine.model, engine.model_config, engine.kv.pool.num_blocks, engine.config.block_size,
                               engine.kv_dtype, "triton", engine.device, engine.max_model_len, "padded",
                               graph_max_batch=8, max_num_seqs=8)
    assert padded.graphs is not None and padded.graphs.buckets == [1, 2, 4, 8]
    replayed: list[tuple[int, int]] = []
    run_step = padded.run_step

    def spy(step):
        if step.graph is not None:
            replayed.append(step.graph)
        return run_step(step)

    padded.run_step = spy
    engine.runner = padded
    try:
        prompts = _prompts(engine.model_config.vocab_size, [4, 11, 17], seed=11)
        ref = _hf_greedy(path, prompts, 7)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(7), use_tqdm=False)]
    finally:
        engine.runner = eager
    assert got == ref
    assert (4, 3) in replayed  # three sequences decoded in the 4-row bucket, one row of padding
    # the padding rows wrote only to the scratch block, which no request owns
    assert padded.scratch_slot == engine.kv.pool.num_blocks * engine.config.block_size


def test_ngram_speculation_on_the_device_path_keeps_the_tokens(models):
    """The verify step is one more paged-attention call with k + 1 rows per request: accepted drafts
    keep their K/V, rejected ones are overwritten, and the tokens stay transformers'."""
    path = models("llama-2", arch="llama")
    llm = _triton_llm(path, speculative="ngram", speculative_adaptive=False, num_speculative_tokens=3)
    vocab = llm.engine.model_config.vocab_size
    motif = _prompts(vocab, [6], seed=21)[0]
    prompts = [motif * 4, _prompts(vocab, [17], seed=22)[0] + motif * 2]  # repeats: n-gram lookup proposes
    ref = _hf_greedy(path, prompts, 12)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(12), use_tqdm=False)]
    assert got == ref
    st = llm.engine.get_stats()
    assert st.spec_proposed_tokens > 0 and st.num_free_blocks == st.num_total_blocks


def test_preemption_on_the_device_path_keeps_the_tokens(models):
    """A pool too small for every sequence at once: sequences are preempted, recomputed and still
    give transformers' tokens."""
    path = models("llama-2", arch="llama")
    llm = _triton_llm(path, num_kv_blocks=12, max_model_len=96, max_num_seqs=6)
    prompts = _prompts(llm.engine.model_config.vocab_size, [20, 25, 30, 18, 22, 27], seed=31)
    ref = _hf_greedy(path, prompts, 20)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(20), use_tqdm=False)]
    assert got == ref
    st = llm.engine.get_stats()
    assert st.num_preemptions > 0 and st.num_free_blocks == st.num_total_blocks


def test_device_options_are_checked_at_start(models, monkeypatch):
    from hasten import LLM

    path = models("llama-2", arch="llama")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            LLM(path, device="cuda", num_kv_blocks=64)
    with pytest.raises(ValueError, match="unsupported device"):
        LLM(path, device="mps", num_kv_blocks=64)
    with pytest.raises(ValueError, match="float16 runs on the device path only"):
        LLM(path, dtype="float16", attention_backend="sdpa", num_kv_blocks=64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="interpreter"):
        LLM(path, attention_backend="triton", num_kv_blocks=64)
