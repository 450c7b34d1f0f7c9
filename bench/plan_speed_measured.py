"""Plans that weigh speed, measured: one model over two hosts of unequal speed, decoded
through the memory-weighted plan and the speed-weighted one, in one run.

The hosts are real daemons on loopback, each pinned to a CPU of its own with ``taskset``
(its stage worker inherits the pinning):

- fast: 127.0.0.2 on the first CPU this process may use;
- slow: 127.0.0.3 on the second, held to a fraction of it by a cgroup CPU quota
  (``--quota FRACTION``, 0.25 by default where a cgroup can be made: ``bench/cpuquota.py``,
  cgroup v1 or v2, 10 ms quota periods).

Under a quota each daemon (the coordinator's too) joins a fresh cgroup of its own before
it runs (a shell writes its pid into the cgroup, then execs it), so its workers and the
child that measures its compute units run in it too; each cgroup is weighted 100x the
default, so that other load on the machine does not take the hosts' CPU (a quota is a
ceiling only: at a load average of 5 on 2 CPUs, unweighted, the fast host measured 0.31
units, the slow one at a 0.25 quota 0.309). The cgroups are removed at the end, after the
processes are ended by pid. Where no cgroup can be made (not root, a read-only
``/sys/fs/cgroup``, no cpu controller) the bench says why and slows the host by a busy
neighbour instead (``--no-quota`` chooses that): a Python loop spinning on its CPU,
started before the daemon and killed by pid at the end, so that the slow host gets about
half a core on a machine otherwise idle.

A coordinator on 127.0.0.1 (not pinned; the client and the router share the machine with
the rest) dials both (``--cluster-peers``). Each peer measures its own compute units when
its agent starts (``discovery/speed.py``; ``MLXCELD_TEST_COMPUTE_UNITS`` is removed from
their environment), under the same pinning and neighbour as its decode.

Memory is declared (``MLXCELD_TEST_MEMORY_AVAILABLE``, which caps what an inventory
reports) so that the memory rule gives the slow host more layers: the fast host offers
enough for all but one layer (so that any split by speed fits), the slow host more, found
by the planner itself (``cluster/plan/solver.py``, run here over the same profile and
addresses) as the least memory with which the split by memory gives it at least
``--slow-share`` of the layers. (A stage's reserve includes 512 MiB of activations, so
both hosts offer over half a GiB for a model of tens of MiB.)

The two plans, over the same daemons:

- speed: each peer's measured units (they differ, so the planner splits by speed), or
  the ``--units FAST,SLOW`` declared in their configs instead;
- memory: both peers declare ``[daemon] compute_units = 1`` (``mlxctl reload``), so the
  units tell no peer from the other and the memory rule applies.

A switch waits for the coordinator's next poll of the peers' inventories (every 20 s,
``discovery/poller.py``; ``SWITCH_S`` at most) by asking ``mlxctl cluster plan --json``
until its split rule is the one wanted; the plan it shows is the one ``mlxctl cluster
activate`` then pushes (``ACTIVATE_S`` at most). After one warm-up request, ``--requests``
greedy completions of ``--max-tokens`` tokens each are streamed through the
coordinator's OpenAI port; a plan's decode tok/s is their median (the first token,
prefill's, excluded). ``mlxctl cluster deactivate`` ends it. ``--rounds`` repeats the pair
(speed, then memory), so that a drift of the machine's load falls on both.

The measurement is the daemon's 0.2 s product at start. A neighbour makes the hosts
unequal only against a machine otherwise idle: other load that is not pinned is moved by
the kernel off the CPU the neighbour keeps busy, onto the fast host's, so on a loaded
machine the two hosts can measure alike, or the "slow" one faster, and decode so too
(seen on a shared 2-CPU machine at a load average of 10: more neighbours made it worse).
The quota holds the slow host to its fraction whatever the rest does, and the weights
keep the rest from taking the hosts' CPU. ``--units`` declares the ratio instead
of the measurement, ``--neighbours N`` puts N busy loops beside the slow host (default 0
under a quota, 1 without).

``--quick`` (for tests/bench/test_plan_speed_bench.py): the tiny fixture made 8 layers
deep, 8 tokens, 1 request, 1 round. The default model is the ``small`` preset (8 layers,
hidden 512, bfloat16), written by our fixture writer.

    .venv/bin/python bench/plan_speed_measured.py [--quick] [--max-tokens 64]
        [--requests 3] [--rounds 2] [--units FAST,SLOW] [--quota 0.25 | --no-quota]
        [--neighbours N] [--slow-share 0.75]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cpuquota import PERIOD_US, WEIGHT, CpuGroup, QuotaUnavailable, probe
from loopback import Cluster, free_port, in_scratch, listening, stream_once

PROMPT = "The quick brown fox"
FAST, SLOW = "127.0.0.2", "127.0.0.3"
START_S = 60.0  # a daemon's control socket, and its compute units measured (5 s budget)
SWITCH_S = 60.0  # the coordinator's next poll of the peers comes within 20 s
ACTIVATE_S = 300.0  # mlxctl's own waits (90 s assignment, 180 s router) fit inside
DEACTIVATE_S = 60.0
ANSWER_S = 60.0  # the router answering its first completion after activation
DEFAULT_QUOTA = 0.25  # of one CPU, the slow host's, where a cgroup quota can be made


@dataclass(frozen=True)
class Settings:
    """One run's knobs (``main`` makes them from the command line)."""

    quick: bool = False
    max_tokens: int = 64
    requests: int = 3
    rounds: int = 2
    slow_share: float = 0.75
    neighbours: int = 1
    units: list[float] | None = None  # FAST,SLOW declared for the speed plan; None: measured
    quota: float | None = None  # the slow host's CPU quota (a cgroup); None: neighbours only

    @property
    def model_name(self) -> str:
        return "tiny, 8 layers" if self.quick else "small"


@dataclass
class Host:
    """A peer daemon: its address, CPU, config file and control socket."""

    name: str
    ip: str
    cpu: int
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    agent: str = ""
    units: float = 0.0  # measured

    @property
    def socket(self) -> Path:
        return self.root / "ctl.sock"

    @property
    def config(self) -> Path:
        return self.root / "mlxceld.toml"


@dataclass
class Measured:
    """One plan's run: its stages (as ``cluster plan --json`` shows them) and tok/s."""

    rule: str
    stages: list[dict[str, Any]]
    tps: list[float] = field(default_factory=list)

    def split(self) -> str:
        return " + ".join(f"{s['layers'][1] - s['layers'][0]}" for s in self.stages)


def ctl(socket: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxctl", "--socket", str(socket), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def status(socket: Path) -> dict[str, Any] | None:
    """The daemon's ``/v1/status``, or None while its control socket does not answer."""
    if not listening(socket):
        return None
    transport = httpx.HTTPTransport(uds=str(socket))
    with (httpx.Client(transport=transport, base_url="http://mlxceld", timeout=5) as c,
          contextlib.suppress(httpx.HTTPError, ValueError)):
        answer: dict[str, Any] = c.get("/v1/status").json()
        return answer
    return None


def launch(cluster: Cluster, name: str, root: Path, args: list[str], *, cpu: int | None,
           env: dict[str, str], group: CpuGroup | None = None) -> subprocess.Popen[bytes]:
    """Start a daemon (under ``taskset -c CPU`` when ``cpu`` is given, in ``group``'s cgroup
    from its first instruction when given), registered in ``cluster`` for its clean-up by
    pid."""
    root.mkdir(mode=0o700, exist_ok=True)
    config = root / "mlxceld.toml"
    if not config.exists():
        config.write_text("")
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    argv = [*pin, sys.executable, "-m", "mlxceld", "--config", str(config), "--state-dir",
            str(root / "state"), "--socket", str(root / "ctl.sock"), "--log-level",
            "warning", *args]
    with (root / "daemon.log").open("ab") as log:
        proc = subprocess.Popen(argv if group is None else group.wrap(argv),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    cluster.daemons.append(proc)
    return proc


def wait_until(what: str, deadline_s: float, probe: Any, every: float = 0.3) -> Any:
    """``probe()``'s first truthy answer within ``deadline_s``; else exit naming ``what``."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        answer = probe()
        if answer:
            return answer
        time.sleep(every)
    raise SystemExit(f"{what}: not within {deadline_s:g} s")


def start_peer(cluster: Cluster, host: Host, model: Path, secret: Path,
               env: dict[str, str], group: CpuGroup | None) -> None:
    host.proc = launch(cluster, host.name, host.root,
                       ["--pp-peer", "--model", str(model), "--cluster-secret-file",
                        str(secret), "--agent-addr", f"{host.ip}:0"],
                       cpu=host.cpu, env=env, group=group)


def measured(host: Host) -> bool:
    """Whether ``host``'s daemon runs with its compute units measured (its agent's address
    and units kept); exits if it died or the measurement failed."""
    assert host.proc is not None
    if host.proc.poll() is not None:
        tail = (host.root / "daemon.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"the {host.name} daemon exited with {host.proc.returncode}:\n{tail}")
    s = status(host.socket)
    if s is None or not s["agent"]["address"]:
        return False
    units = s["daemon"]["compute_units"]
    if units["source"] == "unmeasured":
        raise SystemExit(f"the {host.name} host's compute units: {units['error']}")
    host.agent, host.units = str(s["agent"]["address"]), float(units["units"] or 0)
    return bool(units["source"] == "measured")


def memory_caps(model: Path, slow_share: float) -> tuple[int, int]:
    """The bytes available the fast and slow hosts declare (the module docstring)."""
    from mlxceld.cluster.plan.model import SAFETY_FRACTION, Reserve, usable_memory
    from mlxceld.cluster.plan.solver import PlanNode, plan_stages
    from mlxceld.models.profile import layer_profile

    profile = layer_profile(model)
    layers = len(profile.layer_bytes)
    reserve = Reserve()
    fixed = profile.embed_bytes + profile.head_bytes + profile.norm_bytes + profile.other_bytes
    fast_usable = (fixed + sum(profile.layer_bytes[:-1])
                   + reserve.stage_bytes(profile, layers - 1))

    def available(usable: int) -> int:
        n = int(usable / (1 - SAFETY_FRACTION)) + 1
        while usable_memory(n) < usable:
            n += 1
        return n

    fast = available(fast_usable)
    want = max(1, min(layers - 1, round(layers * slow_share)))
    step = max(1, fast // 200)
    for slow in range(fast, 20 * fast, step):
        nodes = [PlanNode("fast", f"{FAST}:19000", usable_memory(fast), 19100),
                 PlanNode("slow", f"{SLOW}:19000", usable_memory(slow), 19100)]
        start, end = plan_stages(profile, 2, nodes, reserve=reserve).stages[1].layers
        if end - start >= want:
            return fast, slow
    raise SystemExit(f"no memory up to 20x the fast host's gives the slow one {want} layers")


def declare(hosts: list[Host], units: list[float] | None) -> None:
    """Write each host's ``[daemon] compute_units`` (None: none, so the measured units
    count) into its config, and ``mlxctl reload`` it."""
    for i, h in enumerate(hosts):
        h.config.write_text("" if units is None
                            else f"[daemon]\ncompute_units = {units[i]}\n")
        out = ctl(h.socket, "reload")
        if out.returncode != 0:
            raise SystemExit(f"reload of the {h.name} host failed: {out.stderr}{out.stdout}")


def planned(coord: Path, model: Path, rule: str) -> list[dict[str, Any]] | None:
    """The stages ``cluster plan`` shows, once they are split by ``rule``; else None."""
    out = ctl(coord, "cluster", "plan", "--model", str(model), "--stages", "2", "--json")
    if out.returncode != 0:
        raise SystemExit(f"cluster plan failed: {out.stderr}{out.stdout}")
    stages: list[dict[str, Any]] = json.loads(out.stdout)["plan"]["stages"]
    return stages if all(s["split_rule"] == rule for s in stages) else None


def run_plan(cluster: Cluster, coord: Path, model: Path, rule: str,
             args: Settings) -> Measured:
    stages = wait_until(f"a plan split by {rule}", SWITCH_S,
                        lambda: planned(coord, model, rule), every=2.0)
    run = Measured(rule, stages)
    print(f"[{rule}] activating {run.split()} layers", flush=True)
    out = ctl(coord, "cluster", "activate", "--model", str(model), "--stages", "2",
              timeout=ACTIVATE_S)
    if out.returncode != 0:
        raise SystemExit(f"cluster activate ({rule}) failed: {out.stderr}{out.stdout}")
    try:
        deadline = time.monotonic() + ANSWER_S
        while True:  # the router connects to its stages on the first request
            try:
                models = cluster.http.get(f"{cluster.url}/models")
                models.raise_for_status()
                cluster.model_id = models.json()["data"][0]["id"]
                stream_once(cluster, PROMPT, 4)
                break
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for _ in range(args.requests):
            s = stream_once(cluster, PROMPT, args.max_tokens)
            if s.tokens < args.max_tokens:
                print(f"  note: stopped after {s.tokens} tokens (EOS)")
            run.tps.append(s.decode_tps)
        print(f"[{rule}] decode tok/s {[round(t, 2) for t in run.tps]}", flush=True)
    finally:
        out = ctl(coord, "cluster", "deactivate", timeout=DEACTIVATE_S)
        if out.returncode != 0:
            print(f"cluster deactivate failed: {out.stderr}{out.stdout}", file=sys.stderr)
    return run


def report(runs: list[Measured], hosts: list[Host], caps: tuple[int, int],
           args: Settings, held: list[str]) -> str:
    by: dict[str, list[float]] = {"memory": [], "speed": []}
    for r in runs:
        by[r.rule] += [round(t, 2) for t in r.tps]
    a, b = statistics.median(by["memory"]), statistics.median(by["speed"])
    names = {h.agent: h for h in hosts}
    speeds = {s["node_address"]: s["compute_units"]  # the units the speed plan weighed
              for s in next(r for r in runs if r.rule == "speed").stages}
    lines = [f"model {args.model_name}, {args.max_tokens} tokens x {args.requests} requests "
             f"x {args.rounds} round(s), greedy; load average now "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
             f"hosts: fast {FAST} on CPU {hosts[0].cpu} ({hosts[0].units:g} units measured, "
             f"{caps[0] >> 20} MiB available), slow {SLOW} on CPU {hosts[1].cpu} {held[0]} "
             f"({hosts[1].units:g} units, {caps[1] >> 20} MiB); speed plan's units: "
             f"{'measured' if args.units is None else f'declared {args.units}'}",
             *held[1:],
             f"{'plan':8}{'stage':9}{'host':6}{'layers':>10}{'units':>8}{'pred ms':>9}"
             f"{'decode tok/s (median)':>24}   (pred ms: weights / the speed plan's units)"]
    for rule in ("memory", "speed"):
        r = next(r for r in runs if r.rule == rule)
        for i, s in enumerate(r.stages):
            host = names.get(s["node_address"])
            pred = f"{s['weight_bytes'] / (speeds[s['node_address']] * 1e6):.2f}"
            tps = f"{statistics.median(by[rule]):24.2f}" if i == 0 else ""
            lines.append(f"{rule if i == 0 else '':8}{s['stage']:9}"
                         f"{host.name if host else '?':6}"
                         f"{tuple(s['layers'])!s:>10}{s['compute_units'] or 0:8.3g}"
                         f"{pred:>9}{tps}")
    lines += [f"each request's tok/s, in order: {rule}: {by[rule]}"
              for rule in ("memory", "speed")]
    lines += [f"memory-weighted (A) {a:.2f} tok/s, speed-weighted (B) {b:.2f} tok/s, "
              f"B/A {b / a:.3f}"]
    return "\n".join(lines)


def bench(root: Path, args: Settings) -> tuple[list[Measured], str]:
    """Both plans measured (the module docstring): the runs, and their table."""
    from mlxceld.models import fixture_cache, preset
    from mlxceld.privatefile import write_private

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or not shutil.which("taskset"):
        raise SystemExit("needs two CPUs and taskset (util-linux) to pin the hosts")
    model = fixture_cache(preset("tiny", layers=8) if args.quick else preset("small"))
    caps = memory_caps(model, args.slow_share)
    secret = root / "secret"
    write_private(secret, (secrets.token_bytes(32).hex() + "\n").encode())
    base = {k: v for k, v in os.environ.items() if k != "MLXCELD_TEST_COMPUTE_UNITS"}
    hosts = [Host("fast", FAST, cpus[0], root / "fast"), Host("slow", SLOW, cpus[1],
                                                               root / "slow")]
    cluster = Cluster(root, [])
    groups: dict[str, CpuGroup] = {}  # each daemon's, under a quota (the module docstring)
    neighbours: list[subprocess.Popen[bytes]] = []
    try:
        quotas = {"fast": None, "slow": args.quota, "coordinator": None}
        for name, fraction in quotas.items() if args.quota is not None else ():
            try:
                groups[name] = CpuGroup.make(f"mxspeed-{os.getpid()}-{name}", fraction)
            except QuotaUnavailable as exc:
                raise SystemExit(f"a cgroup for the {name} daemon: {exc}") from None
        neighbours += [subprocess.Popen(["taskset", "-c", str(cpus[1]), sys.executable, "-c",
                                         "while True: pass"], stdin=subprocess.DEVNULL)
                       for _ in range(args.neighbours)]
        for h, cap in zip(hosts, caps, strict=True):
            start_peer(cluster, h, model, secret,
                       {**base, "MLXCELD_TEST_MEMORY_AVAILABLE": str(cap)}, groups.get(h.name))
        for h in hosts:
            wait_until(f"the {h.name} host's compute units measured", START_S,
                       lambda h=h: measured(h))
            print(f"{h.name} host: {h.units:g} compute units measured", flush=True)
        if args.units is None and hosts[0].units == hosts[1].units:
            raise SystemExit(f"both hosts measured {hosts[0].units:g} compute units: no "
                             "split by speed; declare them (--units FAST,SLOW)")
        port = free_port("127.0.0.1")
        launch(cluster, "coordinator", root / "coordinator",
               ["--cluster-secret-file", str(secret), "--agent-addr",
                f"127.0.0.1:{free_port('127.0.0.1')}", "--port", str(port),
                "--cluster-peers", ",".join(h.agent for h in hosts)], cpu=None, env=base,
               group=groups.get("coordinator"))
        coord = root / "coordinator" / "ctl.sock"
        wait_until("the coordinator's control socket", START_S, lambda: status(coord))
        cluster.url = f"http://127.0.0.1:{port}/v1"
        runs: list[Measured] = []
        for _ in range(args.rounds):
            for rule, units in (("speed", args.units), ("memory", [1.0, 1.0])):
                declare(hosts, units)
                runs.append(run_plan(cluster, coord, model, rule, args))
        held = [f"with {args.neighbours} busy neighbour(s)"]
        if groups:
            slow = groups["slow"]
            held = [f"held to {slow.fraction:g} CPU by a cgroup quota, {held[0]}",
                    f"cgroup v{slow.version}: each daemon in its own, weighted {WEIGHT}x the "
                    f"default; the slow host's quota in {PERIOD_US // 1000} ms periods, "
                    f"{slow.throttled()} of them throttled"]
        return runs, report(runs, hosts, caps, args, held)
    finally:
        cluster.stop()
        for n in neighbours:
            n.kill()
            n.wait()
        for g in groups.values():
            g.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the tiny fixture, 8 layers deep; 8 tokens, 1 request, 1 round")
    parser.add_argument("--max-tokens", type=int, help="per request (default 64; quick: 8)")
    parser.add_argument("--requests", type=int, help="per plan and round (default 3; quick: 1)")
    parser.add_argument("--rounds", type=int, help="speed then memory (default 2; quick: 1)")
    parser.add_argument("--slow-share", type=float, default=0.75,
                        help="the layers the split by memory gives the slow host, at least")
    parser.add_argument("--neighbours", type=int,
                        help="busy loops sharing the slow host's CPU (default 0 under a "
                        "quota, else 1)")
    held = parser.add_mutually_exclusive_group()
    held.add_argument("--quota", type=float, metavar="FRACTION",
                      help="hold the slow host to FRACTION of a CPU by a cgroup CPU quota "
                      f"(default {DEFAULT_QUOTA} where one can be made)")
    held.add_argument("--no-quota", action="store_true",
                      help="no quota: the slow host is slowed by its busy neighbours only")
    parser.add_argument("--units", type=lambda v: [float(u) for u in v.split(",")],
                        help="FAST,SLOW compute units the speed plan declares instead of "
                        "the measured ones")
    args = parser.parse_args()
    for name, full, quick in (("max_tokens", 64, 8), ("requests", 3, 1), ("rounds", 2, 1)):
        if getattr(args, name) is None:  # --quick sets what the command line does not
            setattr(args, name, quick if args.quick else full)
    if args.units is not None and (len(args.units) != 2 or min(args.units) <= 0
                                   or args.units[0] == args.units[1]):
        parser.error("--units: two positive numbers that differ, FAST,SLOW")
    if args.quota is not None:
        if not 0 < args.quota <= 1:
            parser.error(f"--quota: a fraction of a CPU in (0, 1], not {args.quota:g}")
        if (why := probe()) is not None:
            parser.error(f"--quota: no cgroup CPU quota can be made here: {why}")
    elif not args.no_quota:
        if (why := probe()) is None:
            args.quota = DEFAULT_QUOTA
        else:
            print(f"no CPU quota for the slow host ({why}); busy neighbours instead",
                  flush=True)
    del args.no_quota
    if args.neighbours is None:
        args.neighbours = 0 if args.quota is not None else 1
    if args.neighbours < 0:
        parser.error("--neighbours: 0 or more")
    if min(args.max_tokens, args.requests, args.rounds) < 1 or not 0 < args.slow_share < 1:
        parser.error("--max-tokens, --requests, --rounds are 1 or more; --slow-share in (0, 1)")
    command = " ".join(["bench/plan_speed_measured.py", *sys.argv[1:]])

    def work(root: Path) -> None:
        print(f"{command}\n{bench(root, Settings(**vars(args)))[1]}")

    in_scratch("mxspeed", work)


if __name__ == "__main__":
    main()
