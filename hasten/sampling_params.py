"""Per-request generation settings, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """What to generate and how to pick each token.

    temperature == 0 means greedy. `seed` makes sampling reproducible for this request
    regardless of what else shares the batch. `logprobs=k` returns the sampled token's
    log-probability plus the top-k alternatives (from the raw model distribution);
    `prompt_logprobs=k` does the same for every prompt token after the first.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # token id -> value added to its logit before sampling (OpenAI / vLLM `logit_bias`, within [-100, 100])
    logit_bias: dict[int, float] | None = None
    # Filled in by structured-output support; a callable(token_ids) -> allowed-token mask.
    logits_processors: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0:
                    bad(f"logit_bias keys must be token ids (non-negative integers), got {tok!r}")
                if not -100.0 <= bias <= 100.0:  # also rejects NaN
                    bad(f"logit_bias values must be in [-100, 100], got {bias!r} for token {tok}")

    def token_ids_out_of_range(self, vocab_size: int) -> list[tuple[str, int]]:
        """(field, id) for every token id these params carry that is not below ``vocab_size``."""
        bad = [("stop_token_ids", t) for t in self.stop_token_ids or [] if t >= vocab_size]
        bad += [("logit_bias", t) for t in self.logit_bias or {} if t >= vocab_size]
        return bad

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    def clone(self, **changes) -> SamplingParams:
        from dataclasses import replace

        return replace(self, **changes)
