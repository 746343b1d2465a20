#!/usr/bin/env python3
"""Summarises a `perf record --call-graph dwarf` profile of a jetrunner service.

Reads `perf script` output on stdin and prints two tables, each as a share of the samples:
- by task: the outermost recognisable frame of each stack (which part of the service the CPU
  was spent for: the facade's HTTP server, forge calls, the NATS connection, the projector...);
- by work: what the innermost frames were doing (kernel network and scheduling, allocation,
  copies, CBOR, JSON, logging, hashing...).

    perf script -i scheduler-r1.data -F period,ip,sym | scripts/perf_summary.py
"""

import re
import sys
from collections import Counter

# Outermost match wins: searched from the root of the stack towards the leaf.
TASKS = [
    ("facade: HTTP server (executor calls)", r"jr_facade::server|hyper::proto::h1::dispatch::Server"),
    ("forge intake (fetch, keepalive, commands)", r"jr_gitea_intake|jr_github_intake|jr_intake::"),
    ("worker: driver", r"jr_worker::driver|jr_worker::run::.*driver"),
    ("worker: publish lanes", r"jr_worker::lanes"),
    ("worker: backend observe/list", r"observe::run|pod_worker::backend|vm_worker::backend|kube_runtime"),
    ("reconciler: projector", r"reconciler::projector"),
    ("reconciler: planner/commands", r"reconciler::planner|reconciler::commands|reconciler::service"),
    ("NATS connection (socket I/O, parsing)", r"async_nats::connect_with_options|async_nats::ConnectionHandler"),
    ("HTTP client connections", r"hyper::proto::h1::dispatch::Client|hyper_util::client"),
    ("Postgres connection", r"sqlx_core|sqlx_postgres"),
    ("runtime idle (epoll, park)", r"Context::park|Driver::turn|epoll_wait"),
]
WORK = [
    ("kernel: network", r"^(tcp_|__tcp|ip_|__ip|sock_|__sys_send|__sys_recv|skb|__skb|__x64_sys_(sendto|recvfrom|writev|readv|write|read)|inet_|net_rx|__netif|loopback|__napi|process_backlog|__dev_)"),
    ("kernel: scheduling, wakeups, epoll", r"^(finish_task_switch|_raw_spin|schedule|__schedule|try_to_wake_up|ep_|do_epoll|__x64_sys_epoll|futex|__futex|irqentry|syscall_exit|do_syscall|entry_SYSCALL|exit_to_user)"),
    ("allocation", r"^(_?mi_|mi_|malloc|free|realloc|calloc|__rust_alloc|__rust_dealloc|alloc::alloc)"),
    ("memory copies", r"^__mem(move|cpy|set|cmp)|^memcpy|^memmove"),
    ("CBOR", r"ciborium"),
    ("JSON / protobuf", r"serde_json|prost::"),
    ("logging and spans", r"^tracing|tracing_subscriber|tracing_core"),
    ("hashing", r"sip::Hasher|hash_one|ahash|fxhash"),
    ("time", r"clock_gettime|Instant::now|SystemTime::now|__vdso"),
    ("crypto (seal, HMAC, SHA)", r"sha2|hmac|chacha|aead|ring::|aws_lc"),
    ("UTF-8 checks, formatting", r"from_utf8|core::fmt|alloc::fmt"),
]


def samples(lines):
    stack, period = [], 1
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            if stack:
                yield period, stack
            stack, period = [], 1
            continue
        if not line.startswith(("\t", " ")):
            parts = line.split()
            period = int(parts[-1]) if parts and parts[-1].isdigit() else 1
            continue
        parts = line.strip().split(" ", 1)
        stack.append(parts[1] if len(parts) > 1 else "")
    if stack:
        yield period, stack


def main():
    tasks, work, total = Counter(), Counter(), 0
    task_rules = [(n, re.compile(p)) for n, p in TASKS]
    work_rules = [(n, re.compile(p)) for n, p in WORK]
    for period, stack in samples(sys.stdin):
        total += period
        task = "other"
        for frame in reversed(stack):  # root first
            hit = next((n for n, r in task_rules if r.search(frame)), None)
            if hit:
                task = hit
                break
        tasks[task] += period
        kind = "other (jetrunner and library code)"
        for frame in stack[:3]:  # the leaf and its inlined callers
            hit = next((n for n, r in work_rules if r.search(frame)), None)
            if hit:
                kind = hit
                break
        work[kind] += period
    if not total:
        print("no samples")
        return
    for title, table in (("by task", tasks), ("by work", work)):
        print(f"  {title}:")
        for name, n in table.most_common():
            print(f"    {100.0 * n / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
