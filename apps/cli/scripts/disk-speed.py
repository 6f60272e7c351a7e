#!/usr/bin/env python3
"""Disk speed of the file system holding FILE, read with O_DIRECT (the page cache is bypassed).

Prints one JSON object:
  seq_mb_s       sequential reads of 4 MiB blocks, MB/s (10^6 bytes per second)
  rand_iops_qd1  4 KiB random reads per second, one at a time
  rand_iops_qd8  4 KiB random reads per second, 8 threads issuing reads (queue depth about 8)
Usage: disk-speed.py FILE [seconds per test, default 3]
"""
import json
import mmap
import os
import random
import sys
import threading
import time

BLOCK = 4096


def open_direct(path):
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def seq(path, secs):
    fd = open_direct(path)
    size = os.fstat(fd).st_size
    buf = mmap.mmap(-1, 4 << 20)
    done, off, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        if off + (4 << 20) > size:
            off = 0
        n = os.preadv(fd, [buf], off)
        if n <= 0:
            break
        done += n
        off += n
    el = time.perf_counter() - t0
    os.close(fd)
    return done / el / 1e6


def rand(path, secs, threads):
    size = os.stat(path).st_size
    blocks = size // BLOCK
    counts = [0] * threads
    stop = time.perf_counter() + secs

    def worker(i):
        fd = open_direct(path)
        buf = mmap.mmap(-1, BLOCK)
        rng = random.Random(i)
        n = 0
        while time.perf_counter() < stop:
            os.preadv(fd, [buf], rng.randrange(blocks) * BLOCK)
            n += 1
        counts[i] = n
        os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    secs = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
    print(json.dumps({
        "seq_mb_s": round(seq(path, secs), 1),
        "rand_iops_qd1": round(rand(path, secs, 1)),
        "rand_iops_qd8": round(rand(path, secs, 8)),
    }))
