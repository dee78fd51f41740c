"""/metrics speaks Prometheus with vLLM's names under `hasten:`, and the values move with traffic."""

from __future__ import annotations

import openai
from prometheus_client.parser import text_string_to_metric_families


def scrape(http) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            values[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return values


def get(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


EXPECTED = [
    "hasten:time_to_first_token_seconds_count", "hasten:inter_token_latency_seconds_count",
    "hasten:request_time_per_output_token_seconds_count", "hasten:e2e_request_latency_seconds_count",
    "hasten:request_queue_time_seconds_count", "hasten:request_prefill_time_seconds_count",
    "hasten:request_decode_time_seconds_count", "hasten:request_prompt_tokens_count",
    "hasten:request_generation_tokens_count", "hasten:num_requests_running", "hasten:num_requests_waiting",
    "hasten:kv_cache_usage_perc", "hasten:prefix_cache_queries_total", "hasten:prefix_cache_hits_total",
    "hasten:num_preemptions_total", "hasten:prompt_tokens_total", "hasten:generation_tokens_total",
]


def test_metrics_move(server, client: openai.OpenAI, http) -> None:
    before = scrape(http)
    prompt = "The same prompt, twice, to hit the prefix cache " * 2
    for _ in range(2):
        r = client.completions.create(model="fake-model", prompt=prompt, max_tokens=10, temperature=0)
        assert r.usage.completion_tokens == 10
    list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                        max_tokens=5, stream=True, temperature=0, stop="he"))
    after = scrape(http)
    names = {name for name, _ in after}
    assert not [n for n in EXPECTED if n not in names]

    def delta(name: str, **labels: str) -> float:
        return get(after, name, **labels) - get(before, name, **labels)

    prompt_len = len(prompt)  # one byte = one token in the fake tokenizer
    assert delta("hasten:request_success_total", finished_reason="length") == 2
    assert delta("hasten:request_success_total", finished_reason="stop") == 1
    assert delta("hasten:generation_tokens_total") == 10 + 10 + 3
    assert delta("hasten:prompt_tokens_total") >= 2 * prompt_len
    assert delta("hasten:e2e_request_latency_seconds_count") == 3
    assert delta("hasten:time_to_first_token_seconds_count") == 3
    assert delta("hasten:inter_token_latency_seconds_count") == 9 + 9 + 2
    assert delta("hasten:request_time_per_output_token_seconds_count") == 3
    assert delta("hasten:request_generation_tokens_sum") == 23
    assert delta("hasten:e2e_request_latency_seconds_sum") > 0
    assert delta("hasten:prefix_cache_queries_total") >= 2 * prompt_len
    assert delta("hasten:prefix_cache_hits_total") >= prompt_len - 16
    assert get(after, "hasten:num_requests_running") == 0
    assert get(after, "hasten:kv_cache_usage_perc") == 0


def test_gauges_follow_engine(server, http) -> None:
    engine = server.engine
    with server.client() as c, c.stream("POST", "/v1/completions",
                                        json={"prompt": "x", "max_tokens": 300, "stream": True,
                                              "ignore_eos": True}) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
        next(lines)
        during = scrape(http)
        assert get(during, "hasten:num_requests_running") == 1
        assert get(during, "hasten:kv_cache_usage_perc") > 0
        assert get(during, "hasten:num_requests_waiting") == 0
    assert server.call(lambda: engine.free_blocks) is not None


def test_client_disconnect_counts_as_abort(server, http) -> None:
    before = get(scrape(http), "hasten:request_success_total", finished_reason="abort")
    with server.client() as c, c.stream("POST", "/v1/completions",
                                        json={"prompt": "x", "max_tokens": 300, "stream": True,
                                              "ignore_eos": True}) as r:
        next(r.iter_lines())
    import time

    deadline = time.monotonic() + 3
    while get(scrape(http), "hasten:request_success_total", finished_reason="abort") == before:
        assert time.monotonic() < deadline
        time.sleep(0.01)
