"""DeviceSampler (hasten/runtime/sampler.py) against the CPU Sampler, and the Philox uniform kernel.

Runs on the CPU: the Triton kernel in the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py),
the torch-generator path always."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from hasten.engine.request import Request
from hasten.engine.sampler import Sampler, draw_with_uniforms
from hasten.kernels import triton as triton_kernels
from hasten.runtime.sampler import DeviceSampler
from hasten.sampling_params import SamplingParams

needs_triton = pytest.mark.skipif(not triton_kernels.usable_on("cpu"), reason=triton_kernels.unusable_reason("cpu"))
V = 300  # more than one 256-token chunk of the inverse-CDF draw


def _req(params: SamplingParams, prompt=(1, 2, 3), out=(), eos=(0,)) -> Request:
    r = Request("r", list(prompt), params, list(eos))
    r.output_token_ids = list(out)
    return r


def _only(tok: int):
    """A logits processor that allows only `tok` (like a finished grammar allowing only EOS)."""
    def proc(_ids: list[int], row: torch.Tensor) -> None:
        keep = row[tok].clone()
        row.fill_(float("-inf"))
        row[tok] = keep
    return proc


def _mixed_batch() -> list[Request]:
    """Fresh requests (fresh generators) mixing greedy / random rows and every processing step."""
    sp = SamplingParams
    return [
        _req(sp(temperature=0)),
        _req(sp(temperature=0.8, repetition_penalty=1.3), prompt=[5, 6, 7, 299], out=[5, 8, 8, 310]),
        _req(sp(temperature=0, presence_penalty=0.7, frequency_penalty=0.3), out=[9, 9, 9, 10, 11]),
        _req(sp(temperature=1.0, repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5,
                top_k=7), prompt=[1, 2, 3, 3], out=[4, 4, 1]),
        _req(sp(temperature=0, logit_bias={3: 100.0, 17: -100.0, 250: 2.5})),
        _req(sp(temperature=0.7, top_p=0.9, logit_bias={12: 5.0}, seed=11), out=[1]),
        _req(sp(temperature=0, min_tokens=4, stop_token_ids=[21, 22]), out=[1], eos=(0, 42)),
        _req(sp(temperature=0.5, min_p=0.1, min_tokens=2, ignore_eos=True, stop_token_ids=[30]), eos=(0,)),
        # the ban would leave no finite logit: the row is restored
        _req(sp(temperature=0, min_tokens=3, logits_processors=[_only(0)]), eos=(0,)),
        _req(sp(temperature=1.3, top_k=3, top_p=0.5, min_p=0.05, seed=99, logprobs=3), out=[2, 2]),
        _req(sp(temperature=0, logprobs=0, repetition_penalty=1.1), out=[7]),
    ]


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def _chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit over the tokens of nonzero expected count (scipy when installed, else the
    Wilson-Hilferty normal approximation of the chi-square survival function)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was drawn"
    obs, exp = observed[keep].double(), expected[keep].double()
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, dof))
    except ImportError:
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def test_process_and_probs_equal_the_cpu_sampler():
    logits = _logits(11)
    logits[4, 5] = float("-inf")
    want = Sampler.process(logits, _mixed_batch())
    got = DeviceSampler(V).process(logits, _mixed_batch())
    assert torch.equal(got, want) and got is not logits
    assert torch.isfinite(got[8]).sum() == 1 and torch.isinf(got[6, [0, 42, 21, 22]]).all()
    assert torch.equal(DeviceSampler(V).probs(got, _mixed_batch()), Sampler.probs(want, _mixed_batch()))
    plain = [_req(SamplingParams(top_k=k, top_p=p, min_p=m)) for k, p, m in [(0, 1.0, 0.0), (5, 0.8, 0.0),
                                                                            (0, 0.3, 0.2), (2, 1.0, 0.0)]]
    head = logits[:4]
    assert DeviceSampler(V).process(head, plain) is head  # nothing to do: the input itself
    assert torch.equal(DeviceSampler(V).probs(logits[:4], plain), Sampler.probs(logits[:4], plain))
    with pytest.raises(IndexError):
        DeviceSampler(V).process(logits[:1], [_req(SamplingParams(logit_bias={V: 1.0}))])


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_sample_greedy_rows_and_logprobs_equal_the_cpu_sampler(use_triton):
    logits = _logits(11, seed=1)
    cpu, dev = Sampler(V), DeviceSampler(V, use_triton=use_triton)
    want, want_lp = cpu.sample(logits, _mixed_batch())
    got, got_lp = dev.sample(logits, _mixed_batch())
    greedy = [i for i, r in enumerate(_mixed_batch()) if r.params.greedy]
    assert [got[i] for i in greedy] == [want[i] for i in greedy]
    assert got[8] == 0 and got[6] not in (0, 42, 21, 22)
    if not use_triton:  # the torch generators: the same uniforms, so every token matches
        assert got == want and got_lp == want_lp
    assert [lp is None for lp in got_lp] == [lp is None for lp in want_lp]
    assert got_lp[10] == want_lp[10] and len(got_lp[9]) >= 3
    # logprobs of the tokens actually drawn, from the raw logits
    for i in (9, 10):
        assert got_lp[i][got[i]] == pytest.approx(float(logits[i].log_softmax(-1)[got[i]]), abs=0)
    # all greedy, all random
    g = [_req(SamplingParams(temperature=0)) for _ in range(3)]
    assert dev.sample(logits[:3], g)[0] == logits[:3].argmax(-1).tolist()
    r = [_req(SamplingParams(top_k=1)) for _ in range(3)]
    assert dev.sample(logits[:3], r)[0] == logits[:3].argmax(-1).tolist()


@needs_triton
@pytest.mark.parametrize("params", [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=6)])
def test_triton_draws_follow_the_distribution(params):
    """Chi-square goodness of fit of 4000 draws (half unseeded, half with their own seeds) against
    Sampler.probs, through the Philox kernel."""
    n, row = 4000, torch.randn(20, generator=torch.Generator().manual_seed(3))
    logits = row.repeat(n, 1)
    reqs = [_req(SamplingParams(seed=None if i % 2 else 1000 + i, **params)) for i in range(n)]
    ref = Sampler.probs(logits[:1], reqs[:1])[0]
    dev = DeviceSampler(20, use_triton=True)
    dev.reseed(5)
    toks, _ = dev.sample(logits, reqs)
    observed = torch.bincount(torch.tensor(toks), minlength=20)
    assert _chi2_pvalue(observed, ref.double() * n) > 1e-4


@needs_triton
def test_triton_seeded_draws_do_not_depend_on_the_batch():
    from hasten.kernels.triton.sampling import uniform_rows_reference

    logits = torch.zeros(6, 1000)  # uniform over 1000 tokens: the token reveals u
    def seeded(out_len: int) -> Request:
        return _req(SamplingParams(seed=1234), out=[1] * out_len)
    dev = DeviceSampler(1000, use_triton=True)
    others = [_req(SamplingParams(temperature=0.9)), _req(SamplingParams(seed=7)), _req(SamplingParams(top_k=50))]
    a, _ = dev.sample(logits[:4], [seeded(5)] + others)
    b, _ = dev.sample(logits[:3], [others[2], _req(SamplingParams(seed=8)), seeded(5)])
    c, _ = dev.sample(logits[:1], [seeded(5)])
    assert a[0] == b[2] == c[0]
    # the token is exactly the inverse-CDF draw of Philox(seed, offset = number of generated tokens)
    u = uniform_rows_reference(torch.tensor([1234]), torch.tensor([5])).unsqueeze(1)
    assert c[0] == int(draw_with_uniforms(torch.full((1, 1000), 1e-3), u)[0])
    by_offset = [dev.sample(logits[:1], [seeded(k)])[0][0] for k in range(8)]
    assert len(set(by_offset)) >= 6 and by_offset[5] == c[0]
    # unseeded rows do change from call to call
    assert len({dev.sample(logits[:1], [_req(SamplingParams())])[0][0] for _ in range(5)}) > 1


def test_torch_generator_path_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.zeros(4, 1000)
    dev = DeviceSampler(1000, use_triton=False)
    a, _ = dev.sample(logits[:3], [_req(SamplingParams(seed=5)), _req(SamplingParams()), _req(SamplingParams(seed=6))])
    b, _ = dev.sample(logits[:2], [_req(SamplingParams(seed=6)), _req(SamplingParams(seed=5))])
    assert a[0] == b[1] and a[2] == b[0]


@needs_triton
def test_uniform_kernel_matches_reference_and_is_uniform():
    from hasten.kernels.triton.sampling import as_int64_seed, uniform_rows, uniform_rows_reference

    g = torch.Generator().manual_seed(0)
    seed = torch.randint(-(2**63), 2**63 - 1, (6000,), generator=g)
    seed[:4] = torch.tensor([0, -1, as_int64_seed(2**64 + 3), -(2**63)])
    offset = torch.randint(0, 2**40, (6000,), generator=g)
    u = uniform_rows(seed, offset)
    assert u.dtype == torch.float64 and torch.equal(u, uniform_rows_reference(seed, offset))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # one seed, consecutive offsets (one request's successive tokens): uniform too
    v = uniform_rows(torch.full((6000,), 42), torch.arange(6000))
    for x in (u, v):
        observed = torch.bincount((x * 50).long(), minlength=50)
        assert _chi2_pvalue(observed, torch.full((50,), len(x) / 50)) > 1e-4
    assert uniform_rows(seed[:0], offset[:0]).shape == (0,)


def test_importing_the_kernel_module_does_not_import_triton():
    code = "import sys, hasten.kernels.triton.sampling, hasten.runtime.sampler; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_spec_verify_and_noise_work_with_the_device_sampler():
    from hasten.engine.spec.verify import verify

    dev = DeviceSampler(V, use_triton=False)
    req = _req(SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.2), out=[4])
    toks, lps, accepted = verify(dev, req, _logits(3, seed=4), [7, 8], None)
    assert 1 <= len(toks) <= 3 and accepted == len(toks) - 1 and lps == [None] * len(toks)
    assert dev.noise_for(req, (5,)).device == dev.device
