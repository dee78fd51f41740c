"""Pipeline parallelism (hasten/distributed/pipeline.py) on the CPU: gloo, one spawned rank per stage.

The same prompts on one rank and on N stages: greedy tokens identical, prompt logprobs within 1e-4,
the weights spread over the stages.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hasten import LLM, SamplingParams  # noqa: E402
from hasten.distributed.layers import decoder_weight_bytes  # noqa: E402
from tests.engine.conftest import random_prompts  # noqa: E402

OPTS = dict(num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64)


def _compare_pipeline(path: str, stages: int, prompts, tensor_parallel_size: int = 1, **options):
    params = SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=2, ignore_eos=True)
    options = {**OPTS, **options}
    ref = LLM(path, **options)
    ref_outs = ref.generate(prompts, params, use_tqdm=False)
    total = decoder_weight_bytes(ref.engine.model)
    with LLM(path, pipeline_parallel_size=stages, tensor_parallel_size=tensor_parallel_size, **options) as pp:
        outs = pp.generate(prompts, params, use_tqdm=False)
        rank_bytes = list(pp.engine.parallel.rank_weight_bytes)
    for a, b in zip(ref_outs, outs, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert all(abs(pb[t] - lp) < 1e-4 for t, lp in pa.items())
    return total, rank_bytes


@pytest.mark.parametrize("arch,kwargs,stages", [
    ("llama", dict(num_layers=3), 2),  # uneven split: 2 + 1 layers
    ("llama", dict(num_layers=3, tie_word_embeddings=True), 3),  # the last stage needs the tied embedding
    ("gemma2", dict(num_layers=4, sliding_window=8), 2),  # per-layer windows and sandwich norms sliced
    ("mixtral", dict(num_layers=2), 2),  # MoE layers split like any other
])
def test_pipeline_stages_match_one_rank(tiny_models, arch, kwargs, stages):
    path = tiny_models(arch, **kwargs)
    prompts = random_prompts(4, 200, seed=stages, min_len=3, max_len=70)
    total, rank_bytes = _compare_pipeline(path, stages, prompts)
    assert len(rank_bytes) == stages
    assert 0.9 * total < sum(rank_bytes) < 1.1 * total + (total / 4 if kwargs.get("tie_word_embeddings") else 0)
    assert max(rank_bytes) < 0.8 * total  # no stage holds the model


def test_rank0_keeps_the_blocks_later_stages_full_attention_layers_read(tiny_models):
    """Stage 0 of Gemma 2 over 4 stages holds one sliding-window layer; the later full-attention layers
    still read every block, so rank 0 must not free blocks behind the window. A pool this small
    reuses a freed block at once, which would corrupt the others' attention."""
    path = tiny_models("gemma2", num_layers=4, sliding_window=8)
    prompts = random_prompts(4, 200, seed=8, min_len=40, max_len=70)
    _compare_pipeline(path, 4, prompts, num_kv_blocks=12, max_model_len=128, max_num_seqs=4)


def test_pipeline_with_quantized_layers_matches_one_rank(tiny_models, tmp_path):
    path = tiny_models("llama", num_layers=3, hidden_size=128)
    _compare_pipeline(path, 2, random_prompts(3, 200, seed=9, min_len=5, max_len=50), quantization="int4",
                      quant_cache_dir=str(tmp_path))


def test_micro_batches_split_consecutive_sequences_by_tokens():
    from hasten.distributed.pipeline import split_batch
    from hasten.engine.scheduler import ScheduledBatch

    batch = ScheduledBatch(requests=list("abcdef"), num_new_tokens=[100, 1, 1, 1, 1, 96])
    parts = split_batch(batch, 2)
    assert [p.requests for p in parts] == [["a"], list("bcdef")]
    assert sum(len(p.requests) for p in split_batch(batch, 4)) == 6 and len(split_batch(batch, 4)) == 4
    assert len(split_batch(ScheduledBatch(requests=["x"], num_new_tokens=[5]), 3)) == 1
    decode = ScheduledBatch(requests=list("abcd"), num_new_tokens=[1, 1, 1, 1])
    assert [p.requests for p in split_batch(decode, 2)] == [["a", "b"], ["c", "d"]]


@pytest.mark.parametrize("options,message", [
    (dict(pipeline_parallel_size=3), "exceeds the model's 2 layers"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=3), "must divide the 4 attention heads"),
])
def test_pipeline_settings_that_cannot_split_are_refused(tiny_models, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models("llama"), **OPTS, **options)
