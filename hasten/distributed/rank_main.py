"""`python -m hasten.distributed.rank_main RANK WORLD INIT_METHOD TIMEOUT_S TP`: one worker rank.

Rank 0 starts its local ranks this way (a fresh interpreter running this module) rather than
through multiprocessing's spawn, which would re-import the caller's main script: a script that
builds `LLM(tensor_parallel_size=2)` then needs no `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    rank, world, init_method, timeout_s, tp = argv
    from hasten.distributed.worker import worker_main

    worker_main(int(rank), int(world), init_method, float(timeout_s), int(tp))


if __name__ == "__main__":
    main(sys.argv[1:])
