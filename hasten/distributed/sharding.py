"""Which part of each weight a tensor-parallel rank holds, read from the checkpoint shard by shard.

Megatron-style: q/k/v and gate/up are column-parallel (each rank owns whole attention heads and a
slice of the MLP's intermediate rows), o and down are row-parallel (the matching input columns; their
partial outputs are summed by one all-reduce each), the embedding and lm_head are vocab-parallel
(rows [lo, hi) of the vocabulary). KV heads are split like the query heads when there are at least
as many as ranks; with fewer (N > num_kv_heads, N a multiple of them) each rank keeps the one KV head
its query heads read, so ranks share (replicate) it. Norms stay whole on every rank.

`ShardedState` is a read-only mapping over the checkpoint's safetensors files: `state[name]` reads only
this rank's rows or columns of that tensor (safetensors slices), so no rank ever holds the whole model.
The decoder is then built from it exactly as from a full state dict, with the rank's `local_config`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from hasten.model.config import ModelConfig
from hasten.model.linear import LinearFactory, LinearLayer


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world`: its heads, KV heads, MLP rows and vocabulary rows."""

    cfg: ModelConfig
    rank: int
    world: int

    def __post_init__(self) -> None:
        cfg, n = self.cfg, self.world
        if n < 1 or not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} of a tensor-parallel group of {n}")
        if n == 1:
            return
        if cfg.num_experts:
            raise ValueError("tensor parallelism does not shard mixture-of-experts models yet (expert parallelism)")
        if cfg.qk_norm_full:
            raise ValueError("tensor parallelism cannot split q/k norms over the whole projection (OLMoE)")
        if cfg.num_heads % n:
            raise ValueError(f"--tensor-parallel-size {n} must divide the {cfg.num_heads} attention heads")
        kv = cfg.num_kv_heads
        if kv % n and n % kv:
            raise ValueError(f"--tensor-parallel-size {n} and the {kv} KV heads: one must divide the other")
        if cfg.intermediate_size % n:
            raise ValueError(f"--tensor-parallel-size {n} must divide the MLP's {cfg.intermediate_size} rows")

    # ------------------------------------------------------------ ranges
    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.world)

    @property
    def kv_replicated(self) -> bool:
        return self.cfg.num_kv_heads < self.world

    def kv_head_start(self) -> int:
        if self.kv_replicated:  # world // kv ranks share each KV head
            return self.rank // (self.world // self.cfg.num_kv_heads)
        return self.rank * self.kv_heads

    def inter_rows(self) -> tuple[int, int]:
        step = self.cfg.intermediate_size // self.world
        return self.rank * step, (self.rank + 1) * step

    def vocab_rows(self) -> tuple[int, int]:
        """This rank's vocabulary rows: ceil(V / N) each, the last rank's fewer."""
        step = -(-self.cfg.vocab_size // self.world)
        lo = min(self.rank * step, self.cfg.vocab_size)
        return lo, min(lo + step, self.cfg.vocab_size)

    @property
    def vocab_step(self) -> int:
        return -(-self.cfg.vocab_size // self.world)

    def local_config(self) -> ModelConfig:
        """The config the rank's decoder is built with: its heads, KV heads and MLP rows (vocab stays whole:
        the sampler and token-id checks see the full vocabulary)."""
        c = self.cfg
        return replace(c, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=c.intermediate_size // self.world)

    # ------------------------------------------------------------ slices of each tensor
    def q_rows(self) -> tuple[int, int]:
        d = self.cfg.head_dim
        return self.rank * self.heads * d, (self.rank + 1) * self.heads * d

    def kv_rows(self) -> tuple[int, int]:
        d = self.cfg.head_dim
        start = self.kv_head_start()
        return start * d, (start + self.kv_heads) * d


@dataclass(frozen=True)
class StagePlan:
    """Pipeline stage `stage` of `stages`: layers [lo, hi) of the model (the first stages one more when
    the layers do not divide evenly), the embedding on stage 0, the final norm + lm_head on the last."""

    cfg: ModelConfig
    stage: int
    stages: int

    def __post_init__(self) -> None:
        if self.stages < 1 or not 0 <= self.stage < self.stages:
            raise ValueError(f"stage {self.stage} of a pipeline of {self.stages}")
        if self.cfg.num_layers < self.stages:
            raise ValueError(f"--pipeline-parallel-size {self.stages} exceeds the model's {self.cfg.num_layers} layers")

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def layers(self) -> tuple[int, int]:
        base, extra = divmod(self.cfg.num_layers, self.stages)
        lo = self.stage * base + min(self.stage, extra)
        return lo, lo + base + (1 if self.stage < extra else 0)

    def local_config(self, cfg: ModelConfig | None = None) -> ModelConfig:
        """`cfg` (default: the plan's) narrowed to this stage's layers."""
        c = cfg or self.cfg
        lo, hi = self.layers()
        return replace(c, num_layers=hi - lo, layer_windows=c.layer_windows[lo:hi] if c.layer_windows else [],
                       moe_layers=c.moe_layers[lo:hi] if c.moe_layers else [])


class NotOnThisStage:
    """lm_head of a pipeline stage before the last: never called."""

    nbytes = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("lm_head lives on the last pipeline stage")


_LOCAL_LAYER = re.compile(r"(model\.)?layers\.(\d+)\.(.+)$")


def global_layer_name(name: str, offset: int, count: int | None = None) -> str | None:
    """A stage's name of a layer tensor or projection ("layers.0.o_proj") as the checkpoint numbers it;
    None for a layer the stage does not have."""
    m = _LOCAL_LAYER.fullmatch(name)
    if m is None:
        return name
    j = int(m.group(2))
    if count is not None and j >= count:
        return None
    return f"{m.group(1) or ''}layers.{j + offset}.{m.group(3)}"


def stage_factory(inner: LinearFactory, stage: StagePlan) -> LinearFactory:
    """`inner` asked with the checkpoint's layer numbers (so quantized files and GGUF blocks match)."""
    offset = stage.layers()[0]

    def make(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
        if name == "lm_head" and not stage.last:
            return NotOnThisStage()
        return inner(global_layer_name(name, offset) or name, weight, bias)

    return make


# name patterns of the HF checkpoints the decoder reads (hasten/model/weights.py)
_LAYER = re.compile(r"model\.layers\.\d+\.(.+)\.(weight|bias)$")
_ROWS = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
         "mlp.gate_proj": "inter", "mlp.up_proj": "inter"}
_COLUMNS = {"self_attn.o_proj": "q", "mlp.down_proj": "inter"}


class ShardedState(Mapping[str, torch.Tensor]):
    """The checkpoint tensors as tensor-parallel rank `plan.rank` of pipeline stage `stage` holds them,
    read lazily (safetensors slices). The names are the stage's: its layers numbered from 0.

    A row-parallel layer's bias is kept by TP rank 0 only (the all-reduce would add it N times). The
    embedding is empty on the stages that do not use it (all but the first, and the last when lm_head
    is tied to it), and so is lm_head before the last stage."""

    def __init__(self, folder: Path, plan: ShardPlan, stage: StagePlan | None = None):
        self.plan = plan
        self.stage = stage
        lo, hi = stage.layers() if stage is not None else (0, plan.cfg.num_layers)
        self._offset, self._count = lo, hi - lo
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"tensor parallelism reads safetensors checkpoints; none in {folder}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, int] = {}
        for i, h in enumerate(self._handles):
            for name in h.keys():
                self._where[name] = i

    def __contains__(self, name: object) -> bool:
        name = global_layer_name(name, self._offset, self._count) if isinstance(name, str) else None
        if name is None or name not in self._where:
            return False
        m = _LAYER.match(name)
        # row-parallel biases live on rank 0 only
        return not (m and m.group(1) in _COLUMNS and m.group(2) == "bias" and self.plan.rank != 0)

    def __iter__(self) -> Iterator[str]:
        return iter([])  # the decoder asks by name only

    def __len__(self) -> int:
        return 0

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor, by its checkpoint name (used transiently, e.g. for a row-parallel int8 layer's
        per-row scales)."""
        return self._handles[self._where[name]].get_tensor(name)

    def _slice(self, name: str):
        return self._handles[self._where[name]].get_slice(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        p, st = self.plan, self.stage
        if st is not None:
            uses_embed = st.first or (st.last and p.cfg.tie_word_embeddings)
            if (name == "model.embed_tokens.weight" and not uses_embed) or (name == "lm_head.weight" and not st.last):
                return torch.empty(0, p.cfg.hidden_size)
        name = global_layer_name(name, self._offset) or name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            lo, hi = p.vocab_rows()
            return self._slice(name)[lo:hi]
        m = _LAYER.match(name)
        if m is None:  # final norm and anything else: whole
            return self.full(name)
        part, kind = m.group(1), m.group(2)
        if part in _ROWS:
            lo, hi = self._range(_ROWS[part])
            return self._slice(name)[lo:hi]
        if part in _COLUMNS:
            if kind == "bias":
                return self.full(name)
            lo, hi = self._range(_COLUMNS[part])
            return self._slice(name)[:, lo:hi]
        if part == "self_attn.qkv_proj":  # Phi-3's fused [q; k; v]
            c = p.cfg
            q_len, kv_len = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return self._fused_rows(name, [(0, p.q_rows()), (q_len, p.kv_rows()), (q_len + kv_len, p.kv_rows())])
        if part == "mlp.gate_up_proj":  # Phi-3's fused [gate; up]
            rows = p.inter_rows()
            return self._fused_rows(name, [(0, rows), (p.cfg.intermediate_size, rows)])
        return self.full(name)  # norms

    def _range(self, kind: str) -> tuple[int, int]:
        p = self.plan
        return p.q_rows() if kind == "q" else p.kv_rows() if kind == "kv" else p.inter_rows()

    def _fused_rows(self, name: str, parts: list[tuple[int, tuple[int, int]]]) -> torch.Tensor:
        sl = self._slice(name)
        return torch.cat([sl[base + lo : base + hi] for base, (lo, hi) in parts])


def row_parallel_source(linear_name: str) -> str | None:
    """The HF weight behind a row-parallel projection the decoder names ("layers.3.o_proj"), else None."""
    m = re.fullmatch(r"layers\.(\d+)\.(o_proj|down_proj)", linear_name)
    if m is None:
        return None
    part = "self_attn.o_proj" if m.group(2) == "o_proj" else "mlp.down_proj"
    return f"model.layers.{m.group(1)}.{part}.weight"
