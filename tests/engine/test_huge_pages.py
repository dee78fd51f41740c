"""hasten.runtime.huge_pages: which memory `collapse` asks the kernel about, and that it never changes
what the tensors hold."""

import errno
import types

import torch

from hasten.runtime import huge_pages as hp
from tests.engine.conftest import random_prompts

MB2 = hp.HUGE_PAGE_BYTES


def test_aligned_span_takes_whole_2mb_pages_inside_the_range_only():
    assert hp.aligned_span(0, 3 * MB2) == (0, 3 * MB2)
    assert hp.aligned_span(100, 3 * MB2) == (MB2, 2 * MB2)  # [100, 3 MB2 + 100): pages 1 and 2
    assert hp.aligned_span(MB2 - 1, MB2 + 1) == (MB2, MB2)
    assert hp.aligned_span(1, MB2) == (MB2, 0)  # no whole page inside
    assert hp.aligned_span(5 * MB2, 0) == (5 * MB2, 0)


def test_cpu_storages_count_views_once_and_skip_small_tensors():
    big = torch.zeros(3 * MB2, dtype=torch.uint8)
    views = [big, big[10:], big.view(torch.int32), big[: MB2 * 2]]
    small = torch.zeros(1000)
    spans = hp.cpu_storages([*views, small, "not a tensor"])
    assert spans == {big.untyped_storage().data_ptr(): 3 * MB2}


class FakeMadvise:
    def __init__(self, fail_with: int | None = None):
        self.calls: list[tuple[int, int, int]] = []
        self.fail_with = fail_with

    def __call__(self, address: int, length: int, advice: int) -> int:
        self.calls.append((address, length, advice))
        if advice == hp.MADV_COLLAPSE and self.fail_with is not None:
            import ctypes

            ctypes.set_errno(self.fail_with)
            return -1
        return 0


def test_collapse_asks_for_each_storages_aligned_pages_and_counts_them():
    a = torch.zeros(5 * MB2, dtype=torch.uint8)
    b = torch.zeros(3 * MB2, dtype=torch.uint8)
    fake = FakeMadvise()
    report = hp.collapse([a, b, a[1:]], madvise=fake)
    expected = {}
    for t in (a, b):
        start, length = hp.aligned_span(t.data_ptr(), t.numel())
        assert length >= MB2  # a buffer of 3 or 5 pages holds at least two whole aligned ones
        expected[start] = length
        assert (start, length, hp.MADV_HUGEPAGE) in fake.calls
        assert (start, length, hp.MADV_COLLAPSE) in fake.calls
    assert report.storages == 2 and report.collapsed_bytes == sum(expected.values()) and report.refused_bytes == 0
    for address, length, _ in fake.calls:  # never outside the tensors' own bytes
        assert any(t.data_ptr() <= address and address + length <= t.data_ptr() + t.numel() for t in (a, b))


def test_collapse_stops_at_a_kernel_without_madv_collapse():
    tensors = [torch.zeros(3 * MB2, dtype=torch.uint8) for _ in range(3)]
    fake = FakeMadvise(fail_with=errno.EINVAL)
    report = hp.collapse(tensors, madvise=fake)
    assert report.collapsed_bytes == 0 and report.error == "EINVAL"
    assert sum(1 for c in fake.calls if c[2] == hp.MADV_COLLAPSE) == 1  # the others would be refused alike
    assert "refused" in report.describe()


def test_collapse_for_real_keeps_the_contents():
    """On this machine's kernel: whatever it grants, the bytes stay the same; where it reports huge
    pages, the process's AnonHugePages grew by at least as much."""
    torch.manual_seed(0)
    t = torch.randn(4 * MB2 // 4)  # 8 MB of float32, written before collapsing as a loaded weight is
    copy = t.clone()
    before = hp.anon_huge_bytes()
    report = hp.collapse([t])
    assert torch.equal(t, copy)
    assert report.storages == 1
    if report.collapsed_bytes:
        assert hp.anon_huge_bytes() - before >= report.collapsed_bytes - MB2  # allow one page split meanwhile
    else:
        assert report.error  # a refusal says why


def test_tensors_under_walks_objects_but_not_modules():
    pool = torch.zeros(4)
    weight = torch.ones(2)

    class Layer:
        __slots__ = ("w",)

        def __init__(self):
            self.w = weight

    holder = types.SimpleNamespace(layers=[Layer()], caches=[(pool, pool)], table={"x": torch.arange(3)},
                                   module=torch, fn=test_aligned_span_takes_whole_2mb_pages_inside_the_range_only)
    found = hp.tensors_under(holder)
    assert {id(t) for t in found} == {id(pool), id(weight), id(holder.table["x"])}


def test_engine_with_huge_pages_gives_the_same_tokens(tiny_models):
    """The engine's switch: the pool (here 4 storages of 8 MB) and weights are looked at, the kernel's
    answer is reported, and greedy tokens equal those of an engine with the switch off."""
    from hasten import LLM, SamplingParams

    path = tiny_models("llama")
    prompts = random_prompts(3, 256, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for on in (True, False):
        llm = LLM(path, num_kv_blocks=4096, max_model_len=512, huge_pages="on" if on else "off")
        report = llm.engine.huge_pages_report
        if on:
            assert report is not None and report.storages >= 4
            assert report.collapsed_bytes + report.refused_bytes >= 4 * 8 * 2**20 - 4 * MB2
            assert report.collapsed_bytes or report.error
        else:
            assert report is None
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_the_option_resolves_auto_by_quantization_and_takes_switch_spellings():
    import pytest

    from hasten.config import EngineConfig

    assert not EngineConfig(model="m").wants_huge_pages()  # float weights: auto is off
    assert EngineConfig(model="m", quantization="gguf").wants_huge_pages()
    assert EngineConfig(model="m", huge_pages="on").wants_huge_pages()
    assert not EngineConfig(model="m", quantization="int8", huge_pages="off").wants_huge_pages()
    for raw, want in (("AUTO", "auto"), (True, "on"), ("false", "off"), ("yes", "on"), (0, "off")):
        assert EngineConfig(model="m", huge_pages=raw).huge_pages == want
    for bad in ("maybe", 2, None, ""):
        with pytest.raises(TypeError, match="huge_pages must be auto, on or off"):
            EngineConfig(model="m", huge_pages=bad)


def test_auto_leaves_a_float_engine_alone(tiny_models):
    from hasten import LLM

    llm = LLM(tiny_models("llama"), num_kv_blocks=4096, max_model_len=512)
    assert llm.engine.huge_pages_report is None
