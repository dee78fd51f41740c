"""The device runtime's host-side logic: CUDA-graph buckets and padding, the step's packed layout,
the KV pool's memory plan. Plain CPU code, no Triton needed."""

from __future__ import annotations

import pytest
import torch

from hasten.runtime.cuda_graphs import StepLayout, bucket_for, graph_buckets, pack_step
from hasten.runtime.memory import kv_blocks_for_budget


def test_buckets_cover_every_batch_size_with_the_smallest_bucket():
    assert graph_buckets(256, 64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(20, 64) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(3, 3) == [1, 2, 3]
    buckets = graph_buckets(256, 256)
    for n in range(1, 257):
        b = bucket_for(n, buckets)
        assert b is not None and b >= n
        assert all(not (n <= c < b) for c in buckets)  # no smaller bucket holds n
    assert bucket_for(257, buckets) is None  # beyond the largest: eager


def test_pack_step_pads_rows_into_inert_sequences():
    layout = StepLayout(rows=4, seqs=4, width=5, samples=0)
    out = torch.full((layout.size + 3,), -7, dtype=torch.long)
    flat = pack_step(layout, torch.tensor([11, 12, 13]), torch.tensor([40, 7, 2]), torch.tensor([100, 31, 5]),
                     torch.tensor([0, 1, 2, 3]), torch.tensor([41, 8, 3]),
                     torch.tensor([[6, 2, 9], [1, 0, 0], [4, 0, 0]]), None, scratch_slot=999, out=out)
    v = layout.views(flat)
    assert v["input_ids"].tolist() == [11, 12, 13, 0]
    assert v["positions"].tolist() == [40, 7, 2, 0]
    assert v["slot_mapping"].tolist() == [100, 31, 5, 999]  # the padding row writes to the scratch slot
    assert v["query_start"].tolist() == [0, 1, 2, 3, 4]  # ... as a one-token sequence of its own
    assert v["context_lens"].tolist() == [41, 8, 3, 0]  # ... that sees no keys
    assert v["block_tables"].tolist() == [[6, 2, 9, 0, 0], [1, 0, 0, 0, 0], [4, 0, 0, 0, 0], [0] * 5]
    assert out[layout.size:].tolist() == [-7] * 3  # nothing written past the layout


def test_pack_step_unpadded_keeps_the_sample_rows():
    layout = StepLayout(rows=5, seqs=2, width=2, samples=2)
    flat = pack_step(layout, torch.arange(5), torch.arange(5), torch.arange(5) + 16, torch.tensor([0, 4, 5]),
                     torch.tensor([4, 1]), torch.tensor([[1, 2], [3, 0]]), torch.tensor([3, 4]), 0,
                     torch.empty(layout.size, dtype=torch.long))
    v = layout.views(flat)
    assert v["sample_rows"].tolist() == [3, 4] and v["query_start"].tolist() == [0, 4, 5]
    assert layout.size == 3 * 5 + 2 * 2 + 1 + 2 * 2 + 2


def test_memory_plan_leaves_the_activation_peak_and_what_is_in_use():
    gib = 2**30
    plan = kv_blocks_for_budget(total_bytes=80 * gib, utilization=0.9, in_use_bytes=17 * gib,
                                peak_activation_bytes=3 * gib, bytes_per_block=2 * 2**20, reserve_bytes=0)
    assert plan.budget_bytes == int(72 * gib)
    assert plan.num_blocks == (72 - 17 - 3) * 512 and plan.kv_bytes == plan.num_blocks * 2 * 2**20
    assert "blocks x 16 tokens" in plan.describe(16)
    with pytest.raises(RuntimeError, match="no room for the KV cache"):
        kv_blocks_for_budget(16 * gib, 0.5, 7 * gib, 2 * gib, 2**20)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_blocks_for_budget(16 * gib, 1.5, 0, 0, 2**20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_and_replay_on_a_device(tmp_path):
    from hasten import LLM, SamplingParams
    from hasten.testing import make_tiny_model

    path = make_tiny_model(tmp_path / "m")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    graphs = LLM(str(path), device="cuda", dtype="float16", num_kv_blocks=64, max_model_len=256, max_num_seqs=4)
    assert graphs.engine.runner.graphs.captured
    eager = LLM(str(path), device="cuda", dtype="float16", num_kv_blocks=64, max_model_len=256, enforce_eager=True)
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, greedy, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)]
    assert a == b
