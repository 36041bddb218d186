#!/usr/bin/env python3
"""Celery peer of `harness-s bench queue`.

Runs the same workload as the Rust benchmark with Celery (PyPI `celery`) on the same
RabbitMQ: W workers (a thread pool of W), one job slot each (prefetch multiplier 1), acks
after the task ran (`task_acks_late`), persistent messages published with confirms, no
result backend. Every task is a no-op. Two phases, as in the Rust benchmark:

1. throughput: `--jobs` tasks are published before the workers start; jobs/s is measured
   between the first and the last task to finish (worker start-up excluded);
2. latency: `--latency-jobs` tasks are published one by one at `--rate` per second while
   the workers run; each task's latency runs from the moment its publish was issued to
   the end of the task (the ack follows at once).

It prints one JSON line: {"jobs", "workers", "seconds", "jobs_per_s", "latency_jobs",
"rate", "p50_ms", "p99_ms"}.

    pip install celery
    python3 benches/peers/celery_bench.py --jobs 2000 --workers 4 \\
        --broker amqp://guest:guest@127.0.0.1:5672/%2f

The queue it uses (`--queue-name`) is deleted at the end.
"""

import argparse
import json
import math
import os
import sys
import threading
import time
import urllib.parse


def percentile(sorted_values, p):
    """Nearest-rank percentile, as in the Rust benchmark."""
    rank = math.ceil(p / 100.0 * len(sorted_values))
    return sorted_values[min(max(rank, 1), len(sorted_values)) - 1]


def main():
    parser = argparse.ArgumentParser(description="Celery peer of `harness-s bench queue`")
    parser.add_argument("--broker", required=True, help="amqp://user:password@host:5672/%%2f")
    parser.add_argument("--jobs", type=int, default=2000, help="throughput phase: tasks")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--latency-jobs", type=int, default=200, help="latency phase: tasks")
    parser.add_argument("--rate", type=float, default=100.0, help="latency phase: tasks published per second")
    parser.add_argument("--queue-name", default=f"bench-celery-{os.getpid()}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each phase")
    args = parser.parse_args()
    if args.jobs < 2 or args.workers < 1 or args.latency_jobs < 1 or not args.rate > 0:
        print("--jobs must be at least 2, --workers and --latency-jobs at least 1, --rate above 0", file=sys.stderr)
        return 2
    try:
        from celery import Celery
        from celery.contrib.testing.worker import start_worker
    except ImportError:
        print("celery is not installed; install it with `pip install celery`", file=sys.stderr)
        return 3

    # harness-s options (prefix=, max_attempts=, ...) ride in the query; Celery needs none.
    parts = urllib.parse.urlsplit(args.broker)
    broker = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))

    app = Celery("harness_s_peer", broker=broker)
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=args.queue_name,
        broker_transport_options={"confirm_publish": True},
        broker_connection_retry_on_startup=True,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )

    done = {}
    lock = threading.Lock()
    progress = threading.Condition(lock)

    @app.task(name="harness_s_peer.noop")
    def noop(i):
        t = time.perf_counter()
        with lock:
            done[i] = t
            progress.notify_all()

    def wait_for(n):
        with lock:
            if not progress.wait_for(lambda: len(done) >= n, timeout=args.timeout):
                raise SystemExit(f"only {len(done)} of {n} tasks finished within {args.timeout} s")

    total = args.jobs + args.latency_jobs
    issued = [0.0] * total
    try:
        # Phase 1: everything queued before the workers start.
        for i in range(args.jobs):
            noop.apply_async(args=(i,))
        with start_worker(
            app,
            concurrency=args.workers,
            pool="threads",
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=30,
        ):
            wait_for(args.jobs)
            first = min(done[i] for i in range(args.jobs))
            last = max(done[i] for i in range(args.jobs))
            # Phase 2: paced publishing, one task at a time.
            interval = 1.0 / args.rate
            start = time.perf_counter()
            for k in range(args.latency_jobs):
                i = args.jobs + k
                slot = start + k * interval
                now = time.perf_counter()
                if slot > now:
                    time.sleep(slot - now)
                issued[i] = time.perf_counter()
                noop.apply_async(args=(i,))
            wait_for(total)
    finally:
        try:
            with app.connection_for_write() as conn:
                conn.default_channel.queue_delete(args.queue_name)
        except Exception as e:  # cleanup is best effort; the result stands
            print(f"could not delete queue {args.queue_name}: {e}", file=sys.stderr)

    latencies = sorted((done[i] - issued[i]) * 1000.0 for i in range(args.jobs, total))
    seconds = last - first
    print(
        json.dumps(
            {
                "jobs": args.jobs,
                "workers": args.workers,
                "seconds": seconds,
                "jobs_per_s": (args.jobs - 1) / max(seconds, 1e-9),
                "latency_jobs": args.latency_jobs,
                "rate": args.rate,
                "p50_ms": percentile(latencies, 50),
                "p99_ms": percentile(latencies, 99),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
