#!/usr/bin/env python3
"""The fault check of the containerized cluster (cluster.py): what an orchestrator and the
network do to pods, done to containers under load, with the chaos suite's rule for outcomes.

Clients stream greedy chat answers through the routers the way a Service sends them: only to a
router whose /ready answers 200 (polled every 0.2 s, as endpoints follow readiness); a 429 is
retried after its Retry-After at most twice, as the official openai client does, and the check
reports how many there were (admission refuses new streams while a decode worker's step time,
slowed by a container starting beside it on these two cores, leaves no ITL headroom). Every answer
must equal the undisturbed answer to its prompt (taken first, through both routers). A typed error
would count only where a fault outlasts a stated timeout, and none here does, so any error fails
the scenario; the one exception is a stream whose own router is killed: its client's connection
dies with the process, as with any server, and the check counts those separately (at most the
streams that router held). Scenarios, each under load:

  kill-decode      SIGKILL a decode worker mid-stream, restart it: streams migrate
  kill-prefill     SIGKILL a prefill worker mid-prefill, restart it: prefills are retried
  kill-router      SIGKILL a router, restart it: the other router serves every new request
  partition-decode disconnect a decode worker's network for 4 s, reconnect it
  roll-decode      a rolling update of the decode pool as the manifests' strategy runs it (maxSurge
                   1, maxUnavailable 0): a new container, ready; SIGTERM to an old one, whose
                   /ready must answer 503 while it still runs; it drains and exits: no request fails
  roll-routers     the same for the routers
  scale-prefill    scale the prefill pool from 1 to 2 containers while serving: the new one is
                   found through the pool's DNS name and serves prefills (of prompts the old
                   one has not cached, sent several at once), no request fails
  settled          no fault: after all of the above the cluster serves as at first

Afterwards no decode worker holds a KV block or a sequence. Ends with `N passed, N failed`.
Usage: check.py [SCENARIO ...]   (all when none is named; the cluster is started and removed)
"""

import http.client
import itertools
import json
import os
import signal
import sys
import threading
import time

import cluster

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write one sentence about the sea.",
    "What do bees make?",
    "Give a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Name a planet in the solar system.",
]
MAX_TOKENS = 40
CLIENTS = 4
REQUEST_TIMEOUT = 60.0
CONNECT_TIMEOUT = 2.0
RETRIES_AFTER_429 = 2


def ask(ip, prompt):
    """One streamed greedy answer through the router at `ip`: ("ok", text), ("error", why) for
    an HTTP error or an error event, ("busy", (Retry-After, why)) for a 429, ("refused", why)
    when no connection was made (nothing was sent: the client may try another router), ("lost", why) when the connection broke, ("hang",
    why) past REQUEST_TIMEOUT."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    # A short connect timeout: a killed router's address answers nothing at all.
    conn = http.client.HTTPConnection(ip, 8080, timeout=CONNECT_TIMEOUT)
    try:
        conn.connect()
    except OSError as e:
        return "refused", f"{type(e).__name__}: {e}"
    conn.sock.settimeout(REQUEST_TIMEOUT)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        if r.status == 429:
            return "busy", (float(r.getheader("retry-after") or 1), r.read()[:300].decode(errors="replace"))
        if r.status != 200:
            return "error", f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"
        text, done = [], False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return "error", json.dumps(event["error"])[:300]
            for choice in event.get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
        conn.close()
        return ("ok", "".join(text)) if done else ("lost", "the stream ended without [DONE]")
    except TimeoutError:
        return "hang", f"no answer within {REQUEST_TIMEOUT:.0f} s"
    except (OSError, http.client.HTTPException, RuntimeError) as e:
        return "lost", f"{type(e).__name__}: {e}"


class Load:
    """CLIENTS threads sending requests, each to a ready router, until stopped."""

    def __init__(self, references, routers):
        self.references = references
        self.routers = routers  # the router pool, changed in place by the scenarios
        self.outcomes = []  # (router, started, ended, kind, detail)
        self.busy = []  # the message of each 429 (the request retried after Retry-After)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.ready = {}  # router -> its address while /ready answers 200
        self.known = {}  # router -> its last known address
        self.poll_once()
        self.threads = [threading.Thread(target=self.poll, daemon=True)]
        self.threads += [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(CLIENTS)]
        self.turn = itertools.count()

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for t in self.threads:
            t.join(REQUEST_TIMEOUT + 5)

    def poll_once(self):
        """Readiness by address (podman waits on a container that is stopping, a probe does
        not); the address looked up again when the old one does not answer."""
        for r in list(self.routers):
            ip = self.known.get(r)
            status = cluster.probe_address(ip, 8080) if ip else None
            if status is None:
                try:
                    ip = self.known[r] = cluster.address(r) if cluster.running(r) else None
                except RuntimeError:
                    ip = None
                status = cluster.probe_address(ip, 8080) if ip else None
            self.ready[r] = ip if status == 200 else None
        for r in set(self.ready) - set(self.routers):
            del self.ready[r]

    def poll(self):
        while not self.stopping.is_set():
            self.poll_once()
            time.sleep(0.2)

    def client(self, i):
        prompts = itertools.cycle(PROMPTS[i:] + PROMPTS[:i])
        retried, prompt, started = 0, None, 0.0
        while not self.stopping.is_set():
            ready = [(r, ip) for r, ip in list(self.ready.items()) if ip]
            if not ready:
                time.sleep(0.1)
                continue
            router, ip = ready[next(self.turn) % len(ready)]
            if retried == 0:
                prompt, started = next(prompts), time.monotonic()
            kind, detail = ask(ip, prompt)
            if kind == "refused":
                time.sleep(0.1)
                continue
            if kind == "busy":
                # As the official openai client does: up to two retries after Retry-After.
                retry_after, why = detail
                with self.lock:
                    self.busy.append(why)
                if retried < RETRIES_AFTER_429:
                    retried += 1
                    time.sleep(min(retry_after, 5.0))
                    continue
                kind, detail = "error", f"HTTP 429 {RETRIES_AFTER_429 + 1} times: {why}"
            retried = 0
            if kind == "ok":
                expected = self.references[prompt]
                kind, detail = ("identical", "") if detail == expected else ("different", f"{detail!r} != {expected!r}")
            with self.lock:
                self.outcomes.append((router, started, time.monotonic(), kind, f"{prompt!r}: {detail}"))


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def total(name, metric):
    return sum(v for k, v in cluster.metrics(name).items() if k.split("{")[0] == metric)


def idle_kv(decoders):
    """Every decode worker back to no KV block and no sequence held (within 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        held = {d: (total(d, "pd_kv_cache_usage_ratio"), total(d, "pd_running_decode_sequences")) for d in decoders}
        if all(v == (0, 0) for v in held.values()) or time.monotonic() > deadline:
            return held


class Check:
    def __init__(self, spec, references):
        self.spec, self.references = spec, references
        self.results = []
        # The containers of each pool now; a new one gets the next free number.
        self.pools = {role: [f"pd-{role}-{i}" for i in (0, 1)] for role in cluster.ROLES}
        self.numbers = itertools.count(2)

    def scenario(self, name, fault, warm=1.5, after=2.5):
        """Runs `fault` under load, `warm` seconds in, and the load `after` seconds more. What
        `fault` returns is reported; its `require` entries must hold; its `killed` (a router,
        when its kill was issued and when it returned) allows that router's own streams to be
        lost."""
        began = time.monotonic()
        problems, facts = [], {}
        try:
            with Load(self.references, self.pools["router"]) as load:
                time.sleep(warm)
                facts = fault() or {}
                time.sleep(after)
            outcomes, busy = load.outcomes, load.busy
        except Exception as e:  # a podman or probe failure fails the scenario, not the run
            outcomes, busy, problems = [], [], [f"{type(e).__name__}: {e}"]
        killed = facts.pop("killed", None)
        # Streams through the killed router that began before its kill returned and ended
        # after it was issued.
        lost = [o for o in outcomes if o[3] == "lost" and killed and o[0] == killed[0] and o[1] < killed[2] and o[2] > killed[1]]
        bad = [o for o in outcomes if o[3] != "identical" and o not in lost]
        identical = sum(o[3] == "identical" for o in outcomes)
        problems += [f"{o[3]} via {o[0]}: {o[4]}" for o in bad[:5]]
        if identical < CLIENTS:
            problems.append(f"only {identical} answers completed")
        for key, ok in facts.pop("require", {}).items():
            if not ok:
                problems.append(f"not seen: {key}")
        summary = f"{identical} identical, {len(bad)} failed, {len(lost)} lost with their router"
        if busy:
            summary += f", {len(busy)} retried after 429 (first: {busy[0][:160]})"
        extra = ", ".join(f"{k} {v}" for k, v in facts.items())
        status = "ok" if not problems else "FAILED"
        print(f"check: {name:<17} {status:<6} {summary}{'; ' + extra if extra else ''} ({time.monotonic() - began:.1f} s)")
        for p in problems:
            print(f"check:   {p}")
        self.results.append((name, not problems))

    def restart(self, name):
        """The same container started again (as the kubelet restarts a pod's container)."""
        cluster.podman("start", name)
        cluster.wait_ready(name)

    def migrations(self):
        return sum(total(r, "pd_migrations_total") for r in self.pools["router"])

    def kill_decode(self):
        before, victim = self.migrations(), self.pools["decode"][0]
        cluster.podman("kill", "-s", "KILL", victim)
        time.sleep(1.0)
        self.restart(victim)
        migrations = self.migrations() - before
        return {"migrations": int(migrations), "require": {"a migration": migrations > 0}}

    def kill_prefill(self):
        victim = self.pools["prefill"][0]
        cluster.podman("kill", "-s", "KILL", victim)
        time.sleep(1.0)
        self.restart(victim)
        return {}

    def kill_router(self):
        victim = self.pools["router"][0]
        issued = time.monotonic()
        cluster.podman("kill", "-s", "KILL", victim)
        killed = (victim, issued, time.monotonic())
        time.sleep(1.0)
        self.restart(victim)
        return {"killed": killed}

    def partition_decode(self):
        before, victim = self.migrations(), self.pools["decode"][-1]
        cluster.podman("network", "disconnect", cluster.NETWORK, victim)
        time.sleep(4.0)
        cluster.podman("network", "connect", "--alias", "pd-decode", cluster.NETWORK, victim)
        cluster.wait_ready(victim)
        return {"migrations": int(self.migrations() - before)}

    def roll(self, role, grace):
        """A rolling update as the manifests' strategy makes it (maxSurge 1, maxUnavailable 0):
        for each container, a new one first, ready; then SIGTERM to the old one (a decode
        worker once it runs streams), whose /ready must answer 503 (so it still runs) before
        it exits within its grace period."""
        pool = self.pools[role]
        unready_first, problems_in_roll = {}, []
        for old in list(pool):
            new = f"pd-{role}-{next(self.numbers)}"
            cluster.start(new, self.spec)
            cluster.wait_ready(new)
            pool.append(new)
            ip, port = cluster.address(old), 8080 if role == "router" else 9090
            if role == "decode":
                # Something to drain: an idle decode worker exits at once, before any probe.
                deadline = time.monotonic() + 15
                while total(old, "pd_running_decode_sequences") == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
            # As the kubelet does: SIGTERM to the container's process (straight from here, no
            # podman start-up delay between the decision and the signal), then the grace period,
            # then SIGKILL.
            pid = int(cluster.podman("inspect", "-f", "{{.State.Pid}}", old).stdout)
            os.kill(pid, signal.SIGTERM)
            seen, deadline = False, time.monotonic() + grace
            while alive(pid) and time.monotonic() < deadline:
                seen = seen or cluster.probe_address(ip, port) == 503
            if alive(pid):
                cluster.podman("kill", "-s", "KILL", old)
                problems_in_roll.append(f"{old} exiting within its {grace} s grace period")
            unready_first[old] = seen
            pool.remove(old)
            cluster.podman("rm", "-f", old)
        require = {f"/ready 503 while {n} drains": ok for n, ok in unready_first.items()}
        require.update({p: False for p in problems_in_roll})
        return {"require": require}

    def scale_down_prefill(self):
        """Before scale-prefill: the pool down to one container (SIGTERM, drained, removed)."""
        last = self.pools["prefill"].pop()
        cluster.podman("stop", "-t", "45", last)
        cluster.podman("rm", "-f", last)

    def scale_prefill(self):
        new = f"pd-prefill-{next(self.numbers)}"
        served = lambda: total(new, "pd_request_prefill_time_seconds_count")  # noqa: E731
        cluster.start(new, self.spec)
        cluster.wait_ready(new)
        self.pools["prefill"].append(new)
        # By now the old worker caches every reference prompt, and the routers rightly send
        # those there (nothing left to compute); what a new worker is for is prompts never
        # seen, several at once, so that the old worker's queue sends work to the new one.
        routers = [cluster.address(r) for r in self.pools["router"]]
        fresh, n = [], 0
        deadline = time.monotonic() + 20
        while served() == 0 and time.monotonic() < deadline:
            batch = [(routers[(n + i) % len(routers)], f"Count from {n + i} to {n + i + 40} in words, then name "
                      f"{n % 7 + 3} animals of the sea and {i + 2} rivers.") for i in range(6)]
            n += len(batch)
            threads = [threading.Thread(target=lambda a: fresh.append(ask(*a)), args=(b,)) for b in batch]
            for t in threads:
                t.start()
            for t in threads:
                t.join(REQUEST_TIMEOUT + 5)
        failed = [f"{kind}: {detail}" for kind, detail in fresh if kind != "ok"]
        return {
            "prefills by the new worker": int(served()),
            "fresh prompts": len(fresh),
            "require": {"the new worker serving": served() > 0, f"every fresh prompt answered {failed[:2]}": not failed},
        }


def main(chosen):
    began = time.monotonic()
    spec = cluster.up()
    print(f"check: {len(cluster.DEFAULT)} containers ready in {time.monotonic() - began:.1f} s")
    try:
        references = {}
        for p in PROMPTS:
            answers = {r: ask(cluster.address(r), p) for r in ("pd-router-0", "pd-router-1")}
            kinds = {a[0] for a in answers.values()}
            texts = {a[1] for a in answers.values()}
            if kinds != {"ok"} or len(texts) != 1:
                print(f"check: the undisturbed answers to {p!r} disagree or failed: {answers}")
                print("0 passed, 1 failed")
                return 1
            references[p] = texts.pop()
        check = Check(spec, references)
        scenarios = {
            "baseline": lambda: {},
            "kill-decode": check.kill_decode,
            "kill-prefill": check.kill_prefill,
            "kill-router": check.kill_router,
            "partition-decode": check.partition_decode,
            "roll-decode": lambda: check.roll("decode", 45),
            "roll-routers": lambda: check.roll("router", 120),
            "scale-prefill": check.scale_prefill,
            "settled": lambda: {},
        }
        unknown = [c for c in chosen if c not in scenarios]
        if unknown:
            sys.exit(f"check.py: unknown scenario {unknown}; choose from {list(scenarios)}")
        for name, fault in scenarios.items():
            if chosen and name not in chosen:
                continue
            if name == "scale-prefill":
                check.scale_down_prefill()
            check.scenario(name, fault)
        held = idle_kv(check.pools["decode"])
        kv_ok = all(v == (0, 0) for v in held.values())
        print(f"check: {'no KV held':<17} {'ok' if kv_ok else 'FAILED':<6} (usage ratio, sequences) {held}")
        check.results.append(("no KV held", kv_ok))
        passed = sum(ok for _, ok in check.results)
        failed = len(check.results) - passed
        if failed:
            warnings(sum(check.pools.values(), []))
        print(f"check: done in {time.monotonic() - began:.0f} s")
        print(f"{passed} passed, {failed} failed")
        return 1 if failed else 0
    finally:
        cluster.down()


def warnings(names):
    """The last warnings and errors each container logged (for a failed check)."""
    for name in names:
        logs = cluster.podman("logs", name, check=False)
        lines = [line for line in (logs.stdout + logs.stderr).splitlines() if '"WARN"' in line or '"ERROR"' in line]
        for line in lines[-5:]:
            print(f"check: {name}: {line[:400]}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
