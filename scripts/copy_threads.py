"""How torch's intra-op threads stretch a request-sized host copy when the cores are busy.

    python scripts/copy_threads.py --threads 1,2 --hogs 1 --rounds 4

Copies one 602 KB image (GoogLeNet's input) into a batch buffer, as the
adapter's host path does, with a pause between copies as between requests,
while `--hogs` processes keep cores busy (standing in for tritonserver's gRPC
threads and the client). torch runs a copy of more than 32K elements as an
OpenMP region over its intra-op threads; the region ends when its slowest
thread does, so a thread the scheduler has put aside stalls the copy. Prints
per round and thread count the copy's p50, p99 and mean in microseconds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import numpy as np
import torch


def hog(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def copy_times(threads: int, copies: int) -> np.ndarray:
    torch.set_num_threads(threads)
    source, batch = torch.randn(1, 3, 224, 224), torch.empty(8, 3, 224, 224)
    seconds = []
    for i in range(copies):
        started = time.perf_counter()
        batch[i % 8 : i % 8 + 1].copy_(source)
        seconds.append(time.perf_counter() - started)
        if i % 10 == 0:
            time.sleep(0.0005)  # the gap between requests, in which idle OpenMP threads go to sleep
    return np.array(seconds) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts to compare")
    parser.add_argument("--hogs", type=int, default=1, help="busy processes beside the copies")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--copies", type=int, default=1500, help="copies per round and thread count")
    args = parser.parse_args()
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    for process in hogs:
        process.start()
    try:
        for round_ in range(args.rounds):
            for threads in (int(t) for t in args.threads.split(",")):
                us = copy_times(threads, args.copies)
                print(f"round {round_} threads {threads}: p50 {np.percentile(us, 50):.0f} us, p99 {np.percentile(us, 99):.0f} us, mean {us.mean():.0f} us")
    finally:
        stop.set()
        for process in hogs:
            process.join()


if __name__ == "__main__":
    main()
