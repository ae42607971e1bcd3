#!/usr/bin/env python3
"""Renders the panels of ops/grafana-dashboard.json from a real run of the payments demo, for when Grafana
cannot run (it is not packaged here). Starts nothing itself: point it at a running demo.

    cargo run --example payments &                  # prints its port and its Redis URL
    python3 ops/render_dashboard.py --url http://127.0.0.1:8080 --redis-port <port> --out docs/dashboard.png

It sends a realistic mix for --seconds (new keys, client retries, concurrent duplicates, key reuse with
another payload), pauses the demo's Redis for a few seconds midway (CLIENT PAUSE, to show the fallback
panel move), scrapes /metrics every 2 s, and draws the same queries as the dashboard (rates over 10 s).
Needs matplotlib (pip install matplotlib).
"""
import argparse
import json
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$')


def scrape(url):
    """Parses a Prometheus text page into {(name, frozenset(labels)): value}."""
    page = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    samples = {}
    for line in page.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        pairs = frozenset(re.findall(r'(\w+)="([^"]*)"', labels or ""))
        samples[(name, pairs)] = float(value)
    return samples


def total(samples, name, **labels):
    wanted = set(labels.items())
    return sum(v for (n, l), v in samples.items() if n == name and wanted <= set(l))


def post(url, key, tenant, amount, delay_ms=0):
    body = json.dumps({"amount": amount, "currency": "EUR", "customer": "cus_1"}).encode()
    request = urllib.request.Request(url + "/payments", data=body, method="POST", headers={
        "Authorization": "Bearer " + tenant, "Content-Type": "application/json",
        "Idempotency-Key": key, "X-Demo-Delay-Ms": str(delay_ms)})
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def traffic(url, stop, worker):
    """New keys, retries of earlier keys, concurrent duplicates and, rarely, a reused key."""
    rng = random.Random(worker)
    sent = []
    n = 0
    while not stop.is_set():
        n += 1
        roll = rng.random()
        if roll < 0.55 or not sent:
            key = f"w{worker}-{n}"
            sent.append(key)
            post(url, key, "acme", 1200, delay_ms=rng.choice([0, 0, 0, 150]))
        elif roll < 0.90:
            post(url, rng.choice(sent[-50:]), "acme", 1200)
        elif roll < 0.98:
            key = f"w{worker}-dup-{n}"
            threads = [threading.Thread(target=post, args=(url, key, "acme", 1200, 300)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            post(url, rng.choice(sent[-50:]), "acme", 9900)


def redis_pause(port, millis):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        command = f"*3\r\n$6\r\nCLIENT\r\n$5\r\nPAUSE\r\n${len(str(millis))}\r\n{millis}\r\n"
        conn.sendall(command.encode())
        conn.recv(64)


def quantile(samples, q, tier):
    buckets = sorted((float(dict(l)["le"]), v) for (n, l), v in samples.items()
                     if n == "idemstore_claim_duration_seconds_bucket" and dict(l).get("tier") == tier)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    previous_le, previous_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return previous_le
            width = count - previous_count
            return previous_le + (le - previous_le) * ((rank - previous_count) / width if width else 1)
        previous_le, previous_count = le, count
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--redis-port", type=int, required=True)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--out", default="docs/dashboard.png")
    args = parser.parse_args()

    stop = threading.Event()
    workers = [threading.Thread(target=traffic, args=(args.url, stop, w), daemon=True) for w in range(6)]
    for worker in workers:
        worker.start()
    snapshots = []
    started = time.time()
    paused = False
    while time.time() - started < args.seconds:
        snapshots.append((time.time() - started, scrape(args.url)))
        if not paused and time.time() - started > args.seconds / 2:
            redis_pause(args.redis_port, 4000)
            paused = True
        time.sleep(2)
    stop.set()
    for worker in workers:
        worker.join()
    render(snapshots, args.out)


def render(snapshots, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 5  # snapshots, 10 s
    def rate(name, **labels):
        points = []
        for i in range(window, len(snapshots)):
            (t0, a), (t1, b) = snapshots[i - window], snapshots[i]
            points.append((t1, (total(b, name, **labels) - total(a, name, **labels)) / (t1 - t0)))
        return points

    def ratio(numerators, denominator):
        top = [sum(v) for v in zip(*[[v for _, v in rate(*n[:1], **n[1])] for n in numerators])]
        bottom = rate(*denominator[:1], **denominator[1])
        return [(t, (x / d) if d else 0) for (t, d), x in zip(bottom, top)]

    outcomes = ("idemstore_outcomes_total", {})
    panels = [
        ("Duplicate rate", [("replayed + in flight", ratio([("idemstore_outcomes_total", {"outcome": "replayed"}),
                                                              ("idemstore_outcomes_total", {"outcome": "in_flight"})], outcomes))], "share"),
        ("Conflict rate", [("mismatch", ratio([("idemstore_outcomes_total", {"outcome": "mismatch"})], outcomes))], "share"),
        ("In-flight answers (409)", [("in flight", rate("idemstore_outcomes_total", outcome="in_flight"))], "req/s"),
        ("Redis hit ratio", [("hit", ratio([("idemstore_redis_lookups_total", {"result": "hit"})],
                                           ("idemstore_redis_lookups_total", {})))], "share"),
        ("Redis fallbacks to Postgres", [(reason, rate("idemstore_redis_fallbacks_total", reason=reason))
                                         for reason in ("timeout", "circuit_open", "error", "cluster")], "ops/s"),
        ("Takeovers and reconciliations", [("takeovers", rate("idemstore_lease_takeovers_total")),
                                           ("reconciliations", rate("idemstore_reconciliations_total"))], "ops/s"),
    ]
    fig, axes = plt.subplots(4, 2, figsize=(14, 13))
    for ax, (title, series, unit) in zip(axes.flat, panels):
        for label, points in series:
            ax.plot([t for t, _ in points], [v for _, v in points], label=label)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes.flat[6]
    for tier in ("redis", "postgres"):
        for q in (0.5, 0.99):
            points = [(t, quantile(s, q, tier)) for t, s in snapshots]
            points = [(t, v * 1000) for t, v in points if v is not None]
            ax.plot([t for t, _ in points], [v for _, v in points], label=f"p{int(q * 100)} {tier}")
    ax.set_title("Claim latency p50 / p99 by tier (cumulative)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes.flat[7]
    ax.axis("off")
    indeterminate = total(snapshots[-1][1], "idemstore_indeterminate_records")
    ax.text(0.5, 0.5, f"Indeterminate records\n{indeterminate:.0f}", ha="center", va="center", fontsize=22,
            color="green" if indeterminate == 0 else "red")
    for ax in axes.flat[:7]:
        ax.set_xlabel("seconds into the run")
    fig.suptitle("idemstore dashboard panels, rendered from the payments demo's /metrics "
                 "(Redis paused for 4 s halfway)", fontsize=13)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print("written", out)


if __name__ == "__main__":
    main()
