"""An EAGLE-style draft head: one decoder layer that reads the target model's own features.

At position t the head takes the target's final hidden state f_t (after its final norm, the
vector the target's lm_head reads) and the embedding of the next token x_{t+1}, mixes them with
`fc`, runs one Llama decoder layer (RMSNorm, GQA attention with RoPE over the head's own
cache, SiLU MLP) and a final RMSNorm, and so predicts f_{t+1}. Its lm_head covers a reduced
vocabulary (the target's most frequent tokens, `token_map` gives each one's target id), so
drafting a token costs a small fraction of a target step. Drafting more than one token feeds the
predicted feature back in place of the target's.

A head lives in a folder: `eagle.json` (EagleConfig) and `eagle.safetensors` (the weights and
`token_map`). The embeddings are the target's own and are not stored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hasten.model.rope import RotaryEmbedding, apply_rope
from hasten.model.rope_params import RopeSpec

CONFIG_FILE = "eagle.json"
WEIGHTS_FILE = "eagle.safetensors"
FORMAT = "hasten-eagle-1"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of the tokenizer's vocabulary (token -> id): a draft only fits a target that shares it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_vocab_size: int
    draft_vocab_size: int
    tokenizer_fingerprint: str
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    target: str = ""  # the folder the head was trained for (informational)
    format: str = FORMAT
    training: dict[str, Any] = field(default_factory=dict)  # what the trainer reports (informational)

    @classmethod
    def for_target(cls, cfg: Any, draft_vocab_size: int, fingerprint: str, target: str = "",
                   intermediate_size: int | None = None) -> EagleConfig:
        """A head shaped like one layer of the target (hasten ModelConfig `cfg`)."""
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, intermediate_size=intermediate_size or cfg.intermediate_size,
                   rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, target_vocab_size=cfg.vocab_size,
                   draft_vocab_size=draft_vocab_size, tokenizer_fingerprint=fingerprint,
                   rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings, target=target)

    def rope_spec(self) -> RopeSpec:
        return RopeSpec(self.rope_theta, self.head_dim, self.rope_scaling, self.max_position_embeddings)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.final_norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("token_map", torch.arange(cfg.draft_vocab_size, dtype=torch.long))
        self._rope: RotaryEmbedding | None = None

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope is None or self._rope.cos.shape[0] < need:
            size = max(need, 4096, 2 * (self._rope.cos.shape[0] if self._rope is not None else 0))
            self._rope = RotaryEmbedding(self.cfg.rope_spec(), size, torch.float32)
        cos, sin = self._rope.lookup(positions)
        dtype = self.input_norm.dtype
        return cos.to(dtype), sin.to(dtype)

    def qkv(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor):
        """Rows [N, hidden] of embeddings and features: the residual x and the rotated q, k and v."""
        c = self.cfg
        eps = c.rms_norm_eps
        x = self.fc(torch.cat([emb, feat], dim=-1))
        a = F.rms_norm(x, (c.hidden_size,), self.input_norm, eps)
        n = x.shape[0]
        q = self.q_proj(a).view(n, c.num_heads, c.head_dim)
        k = self.k_proj(a).view(n, c.num_kv_heads, c.head_dim)
        v = self.v_proj(a).view(n, c.num_kv_heads, c.head_dim)
        cos, sin = self.rope(positions)
        return x, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention (attn: [N, heads * head_dim]): the predicted features."""
        c = self.cfg
        eps = c.rms_norm_eps
        x = x + self.o_proj(attn)
        m = F.rms_norm(x, (c.hidden_size,), self.post_norm, eps)
        x = x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        return F.rms_norm(x, (c.hidden_size,), self.final_norm, eps)

    def forward(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """Training form: emb, feat [B, T, hidden] for positions 0..T-1 -> predicted next features
        [B, T, hidden], causal attention within each sequence."""
        b, t, h = emb.shape
        c = self.cfg
        positions = torch.arange(t).repeat(b)
        x, q, k, v = self.qkv(emb.reshape(b * t, h), feat.reshape(b * t, h), positions)
        q = q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.num_heads != c.num_kv_heads)
        o = o.transpose(1, 2).reshape(b * t, c.num_heads * c.head_dim)
        return self.finish(x, o).view(b, t, h)

    def unrolled(self, emb_next: torch.Tensor, feat: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training as drafting runs: emb_next [n, hidden] (embedding of token t+1), feat [n, hidden]
        (the target's f_t) for positions t = 0..n-1. Step 1 predicts f_{t+1} from the target's
        features; step s > 1 makes the entry at position t+s-1 from step s-1's prediction and the
        embedding of token t+s, attending (as the proposer's speculative entries do) to the entries
        made from the target's features up to position t and to the steps before it at its row.
        Returns one [n-s+1, hidden] tensor per step: the predicted f_{t+s}."""
        c = self.cfg
        n = emb_next.shape[0]
        gqa = c.num_heads != c.num_kv_heads
        keys: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        preds: list[torch.Tensor] = []
        cur = feat
        for s in range(1, steps + 1):
            m = n - s + 1
            if m <= 0:
                break
            x, q, k, v = self.qkv(emb_next[s - 1 : s - 1 + m], cur[:m], torch.arange(m) + (s - 1))
            keys.append(k)
            vals.append(v)
            kk = torch.cat([keys[0]] + [t[:m] for t in keys[1:]])
            vv = torch.cat([vals[0]] + [t[:m] for t in vals[1:]])
            mask = torch.arange(n).view(1, n) <= torch.arange(m).view(m, 1)  # the target-feature entries
            if s > 1:
                mask = torch.cat([mask, torch.eye(m, dtype=torch.bool).repeat(1, s - 1)], dim=1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                               vv.transpose(0, 1)[None], attn_mask=mask, enable_gqa=gqa)
            cur = self.finish(x, o[0].transpose(0, 1).reshape(m, c.num_heads * c.head_dim))
            preds.append(cur)
        return preds

    def logits(self, feat: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (index i is target token token_map[i])."""
        return self.lm_head(feat)

    # ------------------------------------------------------------ folders
    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().clone() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.cfg), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> EagleHead:
        from safetensors.torch import load_file

        folder = Path(folder).expanduser()
        if not (folder / CONFIG_FILE).exists() or not (folder / WEIGHTS_FILE).exists():
            raise ValueError(f"{folder} is not an EAGLE draft folder (no {CONFIG_FILE} / {WEIGHTS_FILE}): "
                             "make one with `hasten distill draft TARGET --out DIR`")
        raw = json.loads((folder / CONFIG_FILE).read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"{folder / CONFIG_FILE}: unknown draft format {raw.get('format')!r}")
        known = set(EagleConfig.__dataclass_fields__)
        head = cls(EagleConfig(**{k: v for k, v in raw.items() if k in known}))
        state = load_file(str(folder / WEIGHTS_FILE))
        head.load_state_dict(state)
        head.to(dtype)  # floating-point tensors only: token_map stays int64
        return head.eval()

    LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")

    def quantize_int8(self) -> None:
        """Serve the head's linear layers through hasten's int8 kernels (per-channel weights, a quarter
        of the bytes a draft token reads). Inference only: the head cannot be trained afterwards."""
        from hasten.quant.formats import quantize_int8
        from hasten.quant.kernels import make_layer

        for name in self.LINEARS:
            layer = getattr(self, name)
            if isinstance(layer, nn.Linear):
                del self._modules[name]
                object.__setattr__(self, name, make_layer(quantize_int8(layer.weight.detach())))

    def check_target(self, cfg: Any, fingerprint: str) -> None:
        """Raise ValueError unless the head fits the target (hasten ModelConfig `cfg`, tokenizer fingerprint)."""
        c = self.cfg
        if c.tokenizer_fingerprint != fingerprint:
            raise ValueError("the EAGLE draft was trained for a model with another tokenizer "
                             f"(fingerprint {c.tokenizer_fingerprint}, the target's is {fingerprint})")
        if (c.hidden_size, c.target_vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise ValueError(f"the EAGLE draft reads features of width {c.hidden_size} and a vocabulary of "
                             f"{c.target_vocab_size}; the target has {cfg.hidden_size} and {cfg.vocab_size}")
        if int(self.token_map.max()) >= cfg.vocab_size or int(self.token_map.min()) < 0:
            raise ValueError("the EAGLE draft's token_map holds ids outside the target's vocabulary")
