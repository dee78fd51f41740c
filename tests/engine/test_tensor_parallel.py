"""Tensor parallelism (hasten/distributed) on the CPU: gloo, ranks spawned as processes.

Every case runs the same prompts on one rank and on N ranks: greedy tokens identical (and identical to
transformers), prompt logprobs within 1e-4 in float32, each rank holding about 1/N of the weights.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from hasten import LLM, SamplingParams  # noqa: E402
from hasten.distributed.group import TensorParallelError  # noqa: E402
from hasten.distributed.layers import decoder_weight_bytes  # noqa: E402
from tests.engine.conftest import hf_greedy, random_prompts  # noqa: E402

OPTS = dict(num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64)


def _compare(path: str, world: int, prompts, ref_outs=None, **options):
    params = SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=2, ignore_eos=True)
    if ref_outs is None:
        ref = LLM(path, **OPTS, **options)
        ref_outs = ref.generate(prompts, params, use_tqdm=False)
        ref_bytes = decoder_weight_bytes(ref.engine.model)
    with LLM(path, **OPTS, tensor_parallel_size=world, **options) as tp:
        outs = tp.generate(prompts, params, use_tqdm=False)
        rank_bytes = list(tp.engine.parallel.rank_weight_bytes)
    worst = 0.0
    for a, b in zip(ref_outs, outs, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            for tok, lp in pa.items():
                worst = max(worst, abs(pb[tok] - lp))
    return ref_outs, ref_bytes, rank_bytes, worst


@pytest.mark.parametrize("arch,kwargs,world", [
    ("llama", dict(num_heads=4, num_kv_heads=4), 2),  # MHA
    ("llama", dict(num_heads=4, num_kv_heads=1), 2),  # GQA with fewer KV heads than ranks (replicated)
    ("llama", dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True), 2),
    ("qwen2", dict(num_heads=4, num_kv_heads=2), 2),  # q/k/v biases
    ("llama", dict(hidden_size=96, num_heads=6, num_kv_heads=3), 3),  # 3 ranks, vocabulary not divisible
    ("llama", dict(hidden_size=96, num_heads=6, num_kv_heads=1), 3),
])
def test_tensor_parallel_matches_one_rank_and_transformers(tiny_models, arch, kwargs, world):
    from transformers import AutoModelForCausalLM

    path = tiny_models(arch, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(3, hf.config.vocab_size, seed=world, min_len=3, max_len=90)
    ref_outs, ref_bytes, rank_bytes, worst = _compare(path, world, prompts)
    assert worst < 1e-4
    expected = hf_greedy(hf, prompts, 10)
    assert [o.outputs[0].token_ids for o in ref_outs] == expected
    assert len(rank_bytes) == world
    replicated = kwargs["num_kv_heads"] < world
    for b in rank_bytes:  # about 1/N each: norms are whole on every rank, shared KV heads replicated
        assert ref_bytes / world * 0.95 < b < ref_bytes / world * (1.3 if replicated else 1.1)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_shards_match_one_rank(tiny_models, quantization):
    path = tiny_models("llama", hidden_size=128, num_heads=4, num_kv_heads=2)
    prompts = random_prompts(3, 200, seed=7, min_len=5, max_len=60)
    # the one-rank reference quantizes the full layers; the ranks' shards must be its exact slices
    _, ref_bytes, rank_bytes, worst = _compare(path, 2, prompts, quantization=quantization,
                                               quant_cache_dir=os.environ.get("TMPDIR", "/tmp") + "/hasten-tp-q")
    assert worst < 1e-4
    for b in rank_bytes:
        assert ref_bytes / 2 * 0.9 < b < ref_bytes / 2 * 1.15


def test_phi3_fused_projections_and_sdpa_backend(tiny_models):
    path = tiny_models("phi3", num_heads=4, num_kv_heads=2)
    prompts = random_prompts(2, 200, seed=3, min_len=4, max_len=40)
    for backend in ("cpp", "sdpa"):
        _, _, _, worst = _compare(path, 2, prompts, attention_backend=backend)
        assert worst < 1e-4


def test_ngram_speculation_and_chunked_prefill_under_tensor_parallelism(tiny_models):
    path = tiny_models("llama")
    prompts = [[5, 6, 7, 8] * 20, list(range(10, 150))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(path, **OPTS).generate(prompts, params, use_tqdm=False)
    with LLM(path, **OPTS, tensor_parallel_size=2, speculative="ngram") as tp:
        got = tp.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_a_dying_rank_fails_the_engine_fast_with_a_clear_error(tiny_models, layout):
    """A killed tensor-parallel rank, or a killed pipeline stage."""
    path = tiny_models("llama")
    tp = LLM(path, **OPTS, **layout)
    try:
        proc = tp.engine.parallel.processes[0]
        proc.kill()
        proc.join(5)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            tp.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - t0 < 20
    finally:
        tp.close()


@pytest.mark.parametrize("options,message", [
    (dict(tensor_parallel_size=3), "must divide the 4 attention heads"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=2, quantization="gguf"), "not 'gguf'"),
    (dict(tensor_parallel_size=2, quantization="int4", quant_method="awq"), "rtn"),
])
def test_settings_that_cannot_shard_are_refused(tiny_models, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models("llama"), **OPTS, **options)


def test_torchrun_style_launch_rank1_is_a_hasten_serve_worker(tiny_models, monkeypatch, tmp_path):
    """Ranks started from outside (MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK), as on two hosts:
    `hasten serve` on rank 1 runs only its engine part; rank 0 is the engine here."""
    path = tiny_models("llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK="1")
    log = open(tmp_path / "rank1.log", "w")
    worker = subprocess.Popen([sys.executable, "-m", "hasten.cli", "serve", path, "--tensor-parallel-size", "2"],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK="0").items():
            monkeypatch.setenv(k, v)
        prompts = random_prompts(2, 200, seed=11, min_len=3, max_len=30)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        with LLM(path, **OPTS, tensor_parallel_size=2) as tp:
            assert tp.engine.parallel.processes == []
            got = tp.generate(prompts, params, use_tqdm=False)
        assert worker.wait(timeout=30) == 0, (tmp_path / "rank1.log").read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
        log.close()
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k)
    ref = LLM(path, **OPTS).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]



def test_a_step_that_fails_midway_ends_the_group_instead_of_desynchronising_it(tiny_models, monkeypatch):
    tp = LLM(tiny_models("llama"), **OPTS, tensor_parallel_size=2)
    try:
        model = tp.engine.model
        real = model.forward

        def fail_after_the_broadcast(*args, **kwargs):
            raise MemoryError("rank 0 alone")

        monkeypatch.setattr(model, "forward", fail_after_the_broadcast)
        with pytest.raises(MemoryError):
            tp.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        monkeypatch.setattr(model, "forward", real)
        with pytest.raises(TensorParallelError, match="earlier step failed"):
            tp.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        t0 = time.monotonic()
        tp.close()
        assert time.monotonic() - t0 < 15
    assert all(not p.is_alive() for p in tp.engine.parallel.processes)


def test_a_plain_script_needs_no_main_guard(tiny_models, tmp_path):
    """The local ranks are fresh interpreters (hasten.distributed.rank_main), not multiprocessing spawns
    that would re-import the calling script."""
    script = tmp_path / "plain.py"
    script.write_text(
        "from hasten import LLM, SamplingParams\n"
        f"llm = LLM({tiny_models('llama')!r}, num_kv_blocks=64, max_model_len=256, tensor_parallel_size=2)\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
        "print('TOKENS', len(out[0].outputs[0].token_ids))\n"
        "llm.close()\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "TOKENS 3" in run.stdout
