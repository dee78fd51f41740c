"""Incremental detokenization that is safe for multi-byte UTF-8 and never leaks past a stop string.

Decoding each new token alone breaks characters split across tokens and word-boundary
spaces, so we decode a short window: the text of tokens[prefix:] minus the text of
tokens[prefix:read] is what the newest tokens added. While that ends in U+FFFD (an
incomplete UTF-8 sequence) we wait for more tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all text decoded so far (may run past a stop string until it is found)
    prefix_offset: int = 0
    read_offset: int = 0
    emitted: int = 0  # characters of `text` already handed out

    @property
    def _holdback(self) -> int:
        return max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if it completed one (text is then truncated)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            start = max(0, len(self.text) - self._holdback)
            self.text += delta
            return self._check_stop(start)
        return None

    def flush(self) -> None:
        """At the end of a sequence, add whatever is still pending (even an incomplete character)."""
        if self.read_offset < len(self.token_ids):
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset = len(self.token_ids)

    def _check_stop(self, search_from: int) -> str | None:
        found = [(pos, s) for s in self.stop if (pos := self.text.find(s, search_from)) != -1]
        if not found:
            return None
        pos, s = min(found)
        self.text = self.text[: pos + len(s) if self.include_stop_str_in_output else pos]
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, hold back what could still start a stop string."""
        limit = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted : limit]
        self.emitted = limit
        return delta
