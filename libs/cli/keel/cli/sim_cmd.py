"""``keel sim``: ETTR on a simulated fleet, Keel's real controller against the baselines on the same trace.

    keel sim                                       1,200 machines (9,600 GPUs), 30 days, seed 1, every system
    keel sim --nodes 64 --days 7 --systems keel,conventional,oracle --json out.json
    keel sim --nodes 32 --days 3 --log fleet.jsonl --verify
    keel sim --nodes 64 --days 7 --charts charts/

``keel.sim`` (docs/fleet-sim.md) draws a failure trace from the mix (``--mix``, default: the packaged
``failures.yaml`` of published figures), then runs each system over it: Keel and its ablations through the
real controller's decider on a simulated clock, the conventional, torchelastic and oracle stacks as cost models.
It prints one line per system (ETTR, the worst 1-hour window, hours lost) and, with ``--json``, writes the whole
run (lost time by mechanism and phase, incidents by rung, standby use). ``--charts DIR`` draws the run
(``keel.sim.charts``): ``ettr.svg`` and ``lost_time.svg``, and their PNGs where Debian's headless Chromium is
installed (without it the SVGs only, said on stderr).

``--log PATH`` runs Keel once more with its log recorded (every input and decision, one JSON envelope per line,
as the bus carries them); ``--verify`` folds that log (read back from the file, with ``--log``) through a fresh
controller with the simulation's policy, as
``keel replay --verify`` folds a stored log, and exits 1 when any decision differs. A recorded log holds every
event of the run: keep the fleet small for these (32 machines for 3 days is about a thousand events).

Needs no servers: nothing here touches NATS or PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from keel.cli.common import CliError, Subparsers
from keel.infra.config import Settings

if TYPE_CHECKING:
    from keel.sim.config import Calibration, FailureMix


def register(sub: Subparsers) -> None:
    sim = sub.add_parser("sim", help="ETTR on a simulated fleet: Keel's real controller against the baselines")
    sim.add_argument("--nodes", type=int, default=1200, help="machines of the job (8 GPUs each by default: "
                                                             "the calibration's job.gpus_per_node); default 1,200")
    sim.add_argument("--days", type=float, default=30.0, help="simulated days (default 30)")
    sim.add_argument("--seed", type=int, default=1, help="the trace's seed (default 1): same seed, same trace")
    sim.add_argument("--systems", default="all",
                     help="comma-separated systems (default all): keel, its ablations, conventional, torchelastic, "
                          "oracle")
    sim.add_argument("--mix", type=Path, help="a failure mix YAML (default: keel.sim's failures.yaml)")
    sim.add_argument("--calibration", type=Path, help="a calibration YAML (default: keel.sim's calibration.yaml)")
    sim.add_argument("--json", type=Path, help="write the run here (JSON)")
    sim.add_argument("--charts", type=Path, metavar="DIR",
                     help="write ettr.svg and lost_time.svg here (and their PNGs with a headless Chromium)")
    sim.add_argument("--log", type=Path, help="record Keel's run and write its log here (JSON lines)")
    sim.add_argument("--verify", action="store_true",
                     help="replay Keel's recorded log through a fresh controller; exit 1 on any divergence")
    sim.set_defaults(func=cmd_sim)


def cmd_sim(args: argparse.Namespace, settings: Settings) -> int:
    from keel.sim.config import ConfigError, load_calibration, load_mix
    from keel.sim.run import SYSTEMS, run_all, table

    if args.nodes < 1:
        raise CliError(f"--nodes must be at least 1, not {args.nodes}")
    if not args.days > 0:
        raise CliError(f"--days must be above 0, not {args.days:g}")
    systems = SYSTEMS if args.systems == "all" else tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise CliError(f"unknown system(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SYSTEMS)}")
    try:
        mix, cal = load_mix(args.mix), load_calibration(args.calibration)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    run = run_all(mix, cal, nodes=args.nodes, days=args.days, seed=args.seed, systems=systems)
    gpus = args.nodes * int(cal.job["gpus_per_node"])
    print(f"{run['failures']} failures on {gpus:,} GPUs over {args.days:g} days (seed {args.seed})")
    print(table(run))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"gpus": gpus, "calibration_sources": list(cal.sources), **run}, indent=2)
                             + "\n")
        print(f"wrote {args.json}")
    if args.charts:
        from keel.sim.charts import write_charts

        written = write_charts({"gpus": gpus, **run}, args.charts)
        print("wrote " + ", ".join(str(p) for p in written))
    if args.log is None and not args.verify:
        return 0
    return _recorded_run(args, mix, cal)


def _recorded_run(args: argparse.Namespace, mix: FailureMix, cal: Calibration) -> int:
    """Keel's run once more, recorded: its log written (``--log``) and replayed (``--verify``)."""
    from keel.controller.decider import ControllerDecider
    from keel.events.envelope import REGISTRY
    from keel.kernel.replay import verify
    from keel.sim.engine import VARIANTS, KeelSim
    from keel.sim.trace import generate

    sim = KeelSim(generate(mix, nodes=args.nodes, days=args.days, seed=args.seed), cal, variant=VARIANTS["keel"],
                  seed=args.seed, record=True)
    sim.run()
    log = sim.log
    if args.log is not None:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        with open(args.log, "wb") as out:
            for event in log:
                out.write(event.to_json() + b"\n")
        print(f"wrote {len(log):,} events of Keel's run to {args.log}")
        if args.verify:  # what is replayed is what was written, read back as any log would be
            log = [REGISTRY.parse_envelope(json.loads(line)) for line in args.log.read_bytes().splitlines()]
    if not args.verify:
        return 0
    report = verify(ControllerDecider(sim.policy), log)
    print(f"replay of Keel's recorded log: {report.summary()}")
    if not report.clean:
        print(report.details())
        return 1
    return 0
