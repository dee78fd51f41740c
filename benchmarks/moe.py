"""The grouped mixture-of-experts path (hasten/model/moe.py) against a per-token loop and against
transformers' own expert loop (MixtralExperts: one masked gather per active expert), on the same
random weights, float32.

    python benchmarks/moe.py --threads 2 [--hidden 1024 --inter 2048 --experts 8 --top-k 2]

For each token count (1 = batch-1 decode, 16 = a decode batch, 256 / 512 = prefill chunks) it prints
the best of --repeats timings of one MoE block (router included) and the ratios. The outputs of
the three are checked against each other first. The last column is the grouped path with the experts
in hasten's int4 layout (group 32, its C++ kernels; the engine's `quantization="int4"`).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hasten.model.linear import DenseLinear
from hasten.model.moe import MoEWeights, moe_forward, route


def per_token(moe: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its top-k experts, one token at a time."""
    weights, experts = route(moe, x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        row = x[t : t + 1]
        for w, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate_up = moe.gate_up[e](row)
            inter = gate_up.shape[-1] // 2
            out[t] += w * moe.down[e](F.silu(gate_up[:, :inter]) * gate_up[:, inter:])[0]
    return out


def transformers_block(moe: MoEWeights, hidden: int, inter: int):
    """transformers' MixtralExperts holding the same weights, behind the same router."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=len(moe.gate_up),
                        num_experts_per_tok=moe.top_k)
    experts = MixtralExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack([layer.weight for layer in moe.gate_up]))
        experts.down_proj.copy_(torch.stack([layer.weight for layer in moe.down]))

    def run(x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(moe, x)
        return experts(x, ids, weights)

    return run


def int4_copy(moe: MoEWeights) -> MoEWeights:
    from hasten.quant.formats import quantize_int4
    from hasten.quant.kernels import make_layer

    def q(layers):
        return [make_layer(quantize_int4(layer.weight, 32)) for layer in layers]

    return MoEWeights(moe.router, q(moe.gate_up), q(moe.down), moe.top_k, moe.renormalize, moe.weights_in_float)


def best_ms(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="1,16,256,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    scale = args.hidden**-0.5
    moe = MoEWeights(
        router=torch.randn(args.experts, args.hidden, generator=g) * scale,
        gate_up=[DenseLinear(torch.randn(2 * args.inter, args.hidden, generator=g) * scale) for _ in range(args.experts)],
        down=[DenseLinear(torch.randn(args.hidden, args.inter, generator=g) * args.inter**-0.5) for _ in range(args.experts)],
        top_k=args.top_k, renormalize=True, weights_in_float=False)
    hf = transformers_block(moe, args.hidden, args.inter)
    grouped = lambda x: moe_forward(moe, x, F.silu)  # noqa: E731
    moe4 = int4_copy(moe)
    print(f"MoE block: hidden {args.hidden}, expert MLP {args.inter}, top-{args.top_k} of {args.experts} experts, "
          f"float32, {torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'tokens':>7} | {'grouped ms':>10} | {'per-token ms':>12} | {'transformers ms':>15} | "
          f"{'vs per-token':>12} | {'vs transformers':>15} | {'int4 experts ms':>15}")
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden, generator=g)
            ref = grouped(x)
            torch.testing.assert_close(per_token(moe, x), ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hf(x), ref, rtol=1e-4, atol=1e-4)
            a = best_ms(grouped, x, args.repeats)
            b = best_ms(lambda x: per_token(moe, x), x, max(1, args.repeats // 2 if tokens > 64 else args.repeats))
            c = best_ms(hf, x, args.repeats)
            d = best_ms(lambda x: moe_forward(moe4, x, F.silu), x, args.repeats)
            print(f"{tokens:>7} | {a:>10.2f} | {b:>12.2f} | {c:>15.2f} | {b / a:>11.2f}x | {c / a:>14.2f}x | {d:>15.2f}")


if __name__ == "__main__":
    main()
