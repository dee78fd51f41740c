"""`hasten distill prune` on tiny random models: block influence finds a layer that does nothing, the
pruned folder serves identically in hasten and transformers, healing lowers the held-out KL, a run
resumes exactly, and bad input gets a clear error."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hasten import LLM, SamplingParams  # noqa: E402
from hasten.distill import cli  # noqa: E402
from hasten.distill.prune import (  # noqa: E402
    block_influence,
    least_influential,
    mlp_channel_importance,
    narrow_mlps,
    remove_layers,
)
from hasten.distill.train import DistillConfig, Distiller, kl_per_token  # noqa: E402
from hasten.testing import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("d") / "llama", arch="llama", num_layers=4))


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _seqs(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (length,), generator=g).tolist() for _ in range(n)]


def test_block_influence_finds_the_layer_that_does_nothing(tiny):
    model = _load(tiny)
    layer = model.model.layers[1]  # its branches add zero: output == input
    torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
    torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    scores = block_influence(model, _seqs(3, 24, 0))
    assert scores[1] < 1e-6 < min(s for i, s in enumerate(scores) if i != 1)
    assert least_influential(scores, 1) == [1]
    with pytest.raises(ValueError, match="between 1 and 3"):
        least_influential(scores, 4)


@pytest.mark.parametrize("arch,kwargs,drop", [
    ("llama", {}, [0, 2]),
    ("gemma2", {"sliding_window": 8}, [0, 2]),  # layer_types sliced
    ("qwen3_moe", {"config_overrides": {"decoder_sparse_step": 2}}, [1]),  # dense 0, 2 and MoE 3 kept
])
def test_pruned_folder_serves_identically_in_hasten_and_transformers(tmp_path, arch, kwargs, drop):
    src = make_tiny_model(tmp_path / "src", arch=arch, num_layers=4, **kwargs)
    student = remove_layers(_load(str(src)), drop)
    kinds = [type(layer.mlp).__name__ for layer in student.model.layers]
    out = tmp_path / "student"
    student.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
    reloaded = _load(str(out))
    assert reloaded.config.num_hidden_layers == 4 - len(drop) and len(reloaded.model.layers) == 4 - len(drop)
    assert [type(layer.mlp).__name__ for layer in reloaded.model.layers] == kinds  # dense / MoE where they were
    if getattr(reloaded.config, "layer_types", None):
        assert len(reloaded.config.layer_types) == 4 - len(drop)
    prompts = _seqs(3, 20, 4)
    want = []
    for p in prompts:
        ids = reloaded.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        want.append(ids[0, len(p):].tolist())
    got = LLM(str(out), num_kv_blocks=64, max_model_len=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want


def _distiller(tiny, steps: int, checkpoint_dir=None, drop=(2,), **kw) -> Distiller:
    teacher = _load(tiny)
    student = remove_layers(_load(tiny), list(drop))
    config = DistillConfig(steps=steps, batch_size=2, lr=3e-3, warmup_steps=2, eval_every=5, checkpoint_every=5,
                           seed=3, **kw)
    return Distiller(student, teacher, _seqs(24, 32, 1), _seqs(4, 32, 2), config, checkpoint_dir, {"t": 1})


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_kl_per_token_matches_the_reference_value_and_gradient(temperature):
    g = torch.Generator().manual_seed(int(temperature * 10))
    student = (3 * torch.randn(2, 19, 301, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = 3 * torch.randn(2, 19, 301, generator=g, dtype=torch.float64)
    t = temperature
    ref = torch.nn.functional.kl_div(torch.log_softmax(student / t, -1).flatten(0, 1),
                                     torch.log_softmax(teacher / t, -1).flatten(0, 1),
                                     log_target=True, reduction="batchmean") * t * t
    (ref_grad,) = torch.autograd.grad(ref * 1.7, student)
    for chunk in (1, 7, 38, 128):  # row chunks that do and do not divide the 38 rows
        got = kl_per_token(student, teacher, t, chunk=chunk)
        (grad,) = torch.autograd.grad(got * 1.7, student)
        assert got.item() == pytest.approx(ref.item(), rel=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-9)
    low = student.detach().bfloat16().requires_grad_()  # autocast's logits: the gradient comes back in bfloat16
    (grad,) = torch.autograd.grad(kl_per_token(low, teacher.bfloat16(), t), low)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.double(), ref_grad / 1.7, rtol=0.05, atol=2e-4)


@pytest.mark.parametrize("precision,train_embeddings", [("float32", True), ("bfloat16", False)])
def test_healing_lowers_the_heldout_kl(tiny, precision, train_embeddings):
    d = _distiller(tiny, 30, drop=(1, 2), precision=precision, train_embeddings=train_embeddings)
    embed = d.student.get_input_embeddings().weight.detach().clone()
    layer = d.student.model.layers[0].mlp.down_proj.weight.detach().clone()
    state = d.run()
    kls = [h["heldout_kl"] for h in state.history if "heldout_kl" in h]
    assert kls[-1] < (0.85 if train_embeddings else 0.9) * kls[0], kls  # random tokens: the embedding matters
    assert state.step == 30
    assert not torch.equal(layer, d.student.model.layers[0].mlp.down_proj.weight)
    assert torch.equal(embed, d.student.get_input_embeddings().weight) is not train_embeddings
    assert d.student.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # float32 master weights


def test_ce_weight_mixes_kl_and_cross_entropy_on_the_text(tiny):
    d = _distiller(tiny, 1, ce_weight=0.3)
    batch = _seqs(2, 32, 9)
    x = torch.tensor(batch)
    with torch.no_grad():
        s, t = d.student(x, use_cache=False).logits, d.teacher(x, use_cache=False).logits
    kl = sum(kl_per_token(s[i], t[i]).item() for i in range(2)) / 2
    ce = sum(torch.nn.functional.cross_entropy(s[i, :-1], x[i, 1:]).item() for i in range(2)) / 2
    assert d._step(batch) == pytest.approx(0.7 * kl + 0.3 * ce, rel=1e-5)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="ce_weight"):
            DistillConfig(ce_weight=bad)


def _counting(n: int, length: int, seed: int) -> list[list[int]]:
    """Token i + 1 follows token i: text a random teacher knows nothing of."""
    g = torch.Generator().manual_seed(seed)
    return [[(int(a) + j) % 370 + 3 for j in range(length)] for a in torch.randint(0, 370, (n,), generator=g)]


def test_hard_labels_teach_the_text_where_pure_distillation_follows_the_teacher(tiny):
    def heldout_ce(weight: float) -> float:
        teacher, student = _load(tiny), remove_layers(_load(tiny), [2])
        config = DistillConfig(steps=40, batch_size=4, lr=1e-2, warmup_steps=2, eval_every=40, seed=3,
                               ce_weight=weight)
        Distiller(student, teacher, _counting(24, 32, 1), _counting(4, 32, 2), config).run()
        x = torch.tensor(_counting(4, 32, 5))
        with torch.no_grad():
            logits = student(x, use_cache=False).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item()

    taught, distilled = heldout_ce(1.0), heldout_ce(0.0)
    assert taught < 0.5 * distilled, (taught, distilled)


def test_distill_config_refuses_an_unknown_precision():
    with pytest.raises(ValueError, match="precision must be one of"):
        DistillConfig(precision="float8")


def test_a_stopped_run_resumes_to_the_same_student(tiny, tmp_path):
    straight = _distiller(tiny, 10)
    straight.run()

    class Stop(Exception):
        pass

    def stop_at_7(state, record):
        if state.step == 7:
            raise Stop

    first = _distiller(tiny, 10, tmp_path)
    with pytest.raises(Stop):
        first.run(stop_at_7)  # the checkpoint of step 5 is on disk
    second = _distiller(tiny, 10, tmp_path)
    assert second.try_resume() and second.state.step == 5
    second.run()
    for (name, a), b in zip(straight.student.state_dict().items(), second.student.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    other = _distiller(tiny, 12, tmp_path)  # other settings: not this checkpoint's run
    with pytest.raises(ValueError, match="different run"):
        other.try_resume()


def test_time_budget_stops_with_a_checkpoint(tiny, tmp_path):
    d = _distiller(tiny, 10, tmp_path, max_minutes=0.0)
    assert d.run().step == 0
    assert (tmp_path / "distill-checkpoint.pt").exists()


def test_cli_prunes_heals_writes_and_refuses_bad_input(tiny, tmp_path, capsys):
    out = tmp_path / "student"
    args = [tiny, "--layers", "1", "--out", str(out), "--seq-len", "48", "--calib-tokens", "2048",
            "--heldout-tokens", "480", "--steps", "6", "--eval-every", "3", "--lr", "1e-3", "--mlp-keep", "0.5"]
    assert cli.main(["prune", *args]) == 0
    report = json.loads((out / "distill.json").read_text())
    assert report["layers_before"] == 4 and len(report["layers_removed"]) == 1 and report["finished"]
    assert report["mlp_channels"] == {"before": 128, "after": 64}
    assert set(report["heldout_perplexity"]) == {"original", "pruned", "healed"}
    assert _load(str(out)).config.num_hidden_layers == 3
    assert not (out / "distill-checkpoint.pt").exists()
    with pytest.raises(SystemExit) as e:  # a finished student is not overwritten silently
        cli.main(["prune", *args])
    assert e.value.code == 2 and "already holds" in capsys.readouterr().err
    for bad, message in ((["--layers", "4"], "between 1 and 3"), (["--out", tiny], "own folder"),
                         (["--mlp-keep", "1.5"], "share of the MLP channels"),
                         (["--precision", "float8"], "invalid choice")):
        with pytest.raises(SystemExit):
            cli.main(["prune", *args, "--out", str(tmp_path / "other"), *bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["prune", str(tmp_path / "nope"), "--layers", "1", "--out", str(tmp_path / "o")])
    assert "not found" in capsys.readouterr().err


def test_cli_time_budget_writes_the_student_so_far_and_resumes(tiny, tmp_path):
    out = tmp_path / "student"
    args = ["prune", tiny, "--layers", "2", "--out", str(out), "--seq-len", "48", "--calib-tokens", "2048",
            "--heldout-tokens", "480", "--steps", "6", "--eval-every", "3"]
    assert cli.main([*args, "--max-minutes", "0"]) == 3
    report = json.loads((out / "distill.json").read_text())
    assert report["steps"] == 0 and not report["finished"]
    assert (out / "distill-checkpoint.pt").exists() and _load(str(out)).config.num_hidden_layers == 2
    assert cli.main(args) == 0  # the same command again: resumed and finished
    report = json.loads((out / "distill.json").read_text())
    assert report["steps"] == 6 and report["finished"] and not (out / "distill-checkpoint.pt").exists()


@pytest.mark.parametrize("arch", ["llama", "phi3"])  # separate gate/up, and Phi-3's fused gate_up
def test_narrowed_mlps_serve_identically_and_drop_the_idle_channels(tmp_path, arch):
    src = make_tiny_model(tmp_path / "src", arch=arch, num_layers=3, hidden_size=64)
    model = _load(str(src))
    inter = model.config.intermediate_size  # 128
    importance = mlp_channel_importance(model, _seqs(2, 24, 5))
    assert len(importance) == 3 and importance[0].shape == (inter,)
    narrow_mlps(remove_layers(model, [1]), [importance[0], importance[2]], 96)
    out = tmp_path / "student"
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
    reloaded = _load(str(out))
    assert reloaded.config.intermediate_size == 96
    prompts = _seqs(2, 16, 6)
    want = [reloaded.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    got = LLM(str(out), num_kv_blocks=64, max_model_len=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    # a channel whose down-projection column is zero changes nothing: the first to go
    fresh = _load(str(src))
    fresh.model.layers[0].mlp.down_proj.weight.data[:, 7] = 0.0
    up = fresh.model.layers[0].mlp
    if hasattr(up, "up_proj"):
        up.up_proj.weight.data[7] = 0.0
    else:
        up.gate_up_proj.weight.data[inter + 7] = 0.0
    imp = mlp_channel_importance(fresh, _seqs(2, 24, 5))[0]
    assert int(imp.argmin()) == 7
