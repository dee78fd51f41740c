"""Optional token counting with a Hugging Face `tokenizer.json` (the `tokenizers` package).

Without a tokenizer the bench estimates prompt lengths (one token per generated word,
four characters per token for ShareGPT text) and counts output tokens from the server's
`usage`, falling back to one token per content chunk.
"""

from __future__ import annotations

from typing import Protocol


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


class HFTokenizer:
    """Counts tokens with a `tokenizer.json`, without special tokens."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer  # imported lazily: optional

        self._tok = Tokenizer.from_file(path)
        self.path = path

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def count_many(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def estimate_tokens(text: str) -> int:
    """Rough token count for English text when no tokenizer is available (~4 chars/token)."""
    return max(1, (len(text) + 3) // 4)
