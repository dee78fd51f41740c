"""last_layer_sampled_rows: the last layer writes every row's keys and values, then runs attention,
o_proj and the MLP only for the rows whose logits are sampled. Its metadata against a per-row
reference, and engines with it against engines without it."""

from __future__ import annotations

import pytest
import torch

from hasten import LLM, SamplingParams
from hasten.kernels import cpu_attention
from hasten.model.layers import AttentionMetadata, rows_metadata
from tests.engine.conftest import random_prompts
from tests.engine.test_attention_kernel import make_inputs, reference

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="C++ kernels cannot be built here")


def test_rows_metadata_attends_as_the_rows_do_in_their_sequences():
    gen = torch.Generator().manual_seed(3)
    q, k, v, tables, qs, cl = make_inputs(gen, [40, 7, 90], [40, 1, 25], 6, 2, 32, 16, torch.float32)
    meta = AttentionMetadata(slot_mapping=torch.zeros(int(qs[-1]), dtype=torch.long), block_tables=tables,
                             query_start=qs, context_lens=cl)
    rows = torch.tensor([0, 17, 39, 40, 41, 60, 65])  # first, middle and last rows; a decode row
    picked = rows_metadata(meta, rows)
    assert picked.query_start.tolist() == list(range(len(rows) + 1)) and picked.max_query_len == 1
    # row r of a sequence with n new tokens and context c sees c - n + (its index) + 1 keys
    assert picked.context_lens.tolist() == [1, 18, 40, 7, 66, 85, 90]
    got = cpu_attention.paged_attention(q[rows].contiguous(), k, v, picked.block_tables, picked.query_start,
                                        picked.context_lens, 32**-0.5)
    want = reference(q, k, v, tables, qs, cl, 32**-0.5)[rows]
    assert (got.double() - want).abs().max().item() < 2e-5


def generate(llm: LLM, prompts: list[list[int]], **kw) -> list:
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, **kw))


@pytest.mark.parametrize("options", [{}, {"quantization": "int4", "kv_cache_dtype": "int8"}], ids=["float32", "int4"])
def test_engine_with_sampled_rows_only_matches_every_row(tiny_models, options, monkeypatch):
    from hasten.model import decoder
    from tests.quant.wide_paths import assert_loops_agree

    picked: list[int] = []  # rows kept in each step that selected them

    def counted(meta, rows):
        picked.append(rows.numel())
        return rows_metadata(meta, rows)

    monkeypatch.setattr(decoder, "rows_metadata", counted)

    path = tiny_models("llama")
    kw = dict(num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=48, **options)
    on, off = LLM(path, **kw), LLM(path, last_layer_sampled_rows=False, **kw)
    assert on.engine.model.last_layer_sampled_rows and not off.engine.model.last_layer_sampled_rows
    vocab = on.engine.model_config.vocab_size
    prompts = random_prompts(6, vocab, seed=23, min_len=10, max_len=100)  # chunked beside decodes
    worst = 0.0
    outs_on = generate(on, prompts)
    assert picked and max(picked) < 48  # prefill steps went on with their sampled rows only
    count = len(picked)
    outs_off = generate(off, prompts)
    assert len(picked) == count  # switched off: never
    for a, b in zip(outs_on, outs_off, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            worst = max(worst, max(abs(la[t] - lb[t]) for t in la.keys() & lb.keys()))
    # the sampled rows take the per-row kernels in the last layer instead of the wide ones
    assert worst < (1e-4 if options else 1e-5)
    # the Python layer loop selects the rows as the C++ one does: bit-identical
    assert_loops_agree(on, LLM(path, native_decoder_loop=False, **kw))
    # prompt logprobs read every row: the step keeps them all, and they match
    a = on.generate(prompts[:2], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))
    b = off.generate(prompts[:2], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))
    assert [o.prompt_logprobs for o in a] == [o.prompt_logprobs for o in b]
