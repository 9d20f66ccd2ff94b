"""Sweeps on Ray vs the local process pool: parallel efficiency and Ray's overhead per point (validate first).

    python benchmarks/bench_cluster.py                       # reproduce --full CPU experiments, 16 workers
    python benchmarks/bench_cluster.py --size quick --workers 2 --only seqlen
    python benchmarks/bench_cluster.py --gpu                 # also GPU points, fractional GPUs per point
    python benchmarks/bench_cluster.py --size quick --ray-serial   # also Ray on 1 worker: its own cost per point

Needs Ray (pip install 'fadev[ray]'). Validation: a small sweep through the local process (1 thread), the
local pool and Ray gives the same rows bit for bit (timings aside). Then each experiment of --only (the
ones that run on the sweep engine) at --size runs three times into fresh folders -- local, 1 worker (one
kernel thread); local pool, W workers; Ray, W workers (a local Ray instance with W CPUs, started before
the clock, or --address) -- and their raw rows are checked equal again. Printed per experiment and in
total: wall seconds, speed-up over 1 worker, parallel efficiency = T1 / (W * T_W) (goal >= 0.8), and the
overhead per point = (W * T_W - sum of the points' own wall_s) / points, also as a share of the mean
point time (goal for Ray: < 5% of a quick point). --gpu: the same GPU sweep through Ray with 1, 0.5 and
0.25 GPUs per point (points per second; more points share the one GPU as the fraction shrinks).
"""
import argparse
import os
import shutil
import tempfile
import time

import fadev
from fadev import experiments, sweep

TIMING = ("wall_s", "test_s")
SWEEP_EXPERIMENTS = ("precision", "seqlen", "algorithm", "attribution", "kernels")


def _values(df):
    """Rows by key without timings, columns sorted, for bit comparisons (NaN == NaN)."""
    df = df.drop(columns=[c for c in TIMING if c in df.columns]).set_index("key").sort_index()
    return df[sorted(df.columns)]


def _same(a, b, what):
    a, b = _values(a), _values(b)
    assert list(a.index) == list(b.index) and list(a.columns) == list(b.columns), f"{what}: different rows"
    assert a.astype(object).where(a.notna(), None).equals(b.astype(object).where(b.notna(), None)), \
        f"{what}: values differ"


def validate(workers):
    pts = sweep.expand({"policy": ["paper:bf16", "fa2:fp16"], "block_kv": [16, 32], "seed": [0, 1, 2]},
                       base={"N": 128, "D": 32, "heads": 2, "ref_kernel": "baseline", "lse": True})
    fadev.set_num_threads(1)
    serial = sweep.run(pts, progress=False)
    pool = sweep.run(pts, workers=workers, progress=False)
    ray_rows = sweep.run(pts, executor="ray", workers=workers, progress=False)
    _same(pool, serial, "local pool vs serial")
    _same(ray_rows, serial, "Ray vs serial")
    print(f"validated: {len(pts)} points, local serial == local pool ({workers}) == Ray ({workers}) bit for bit")


def timed(name, size, workers, cluster, out):
    """(seconds, raw rows) of one experiment run into a fresh folder."""
    if os.path.exists(out):
        shutil.rmtree(out)
    start = time.perf_counter()
    experiments.run(name, size=size, out=out, workers=workers, cluster=cluster)
    seconds = time.perf_counter() - start
    return seconds, sweep.load(os.path.join(out, f"{name}.jsonl"))


def bench_cpu(names, size, workers, address, ray_serial=False):
    """ray_serial: also Ray with 1 worker, whose extra time over the local 1-worker run, per point, is Ray's
    own cost per point (task submission, scheduling, result transfer, the driver's write), free of the load
    imbalance that the W-worker overhead column also counts."""
    ray = {"executor": "ray", "address": address}
    configs = (("local, 1 worker", 1, None),) + ((("Ray, 1 worker", 1, ray),) if ray_serial else ()) + \
        ((f"local pool, {workers}", workers, None), (f"Ray, {workers}", workers, ray))
    print(f"\n{'experiment':<12} {'executor':<16} {'points':>6} {'wall s':>9} {'speed-up':>8} {'efficiency':>10} "
          f"{'overhead/pt ms':>14} {'% of mean pt':>12}")
    totals = {label: [0.0, 0.0, 0] for label, _, _ in configs}
    root = tempfile.mkdtemp(prefix="bench_cluster.")
    try:
        for name in names:
            results = {}
            for label, w, cluster in configs:
                fadev.set_num_threads(1)  # the 1-worker baseline: one kernel thread, like every pool worker
                results[label] = timed(name, size, w, cluster, os.path.join(root, label.split(",")[0]))
            base_s, base_rows = results[configs[0][0]]
            for label, w, _ in configs:
                seconds, rows = results[label]
                _same(rows, base_rows, f"{name}: {label} vs 1 worker")
                _row(name, label, w, seconds, base_s, rows)
                totals[label][0] += seconds
                totals[label][1] += float(rows["wall_s"].sum())
                totals[label][2] += len(rows)
            if ray_serial:
                extra = (results["Ray, 1 worker"][0] - base_s) / len(base_rows)
                mean_pt = float(base_rows["wall_s"].mean())
                print(f"{name:<12} Ray's own cost per point (Ray 1 worker - local 1 worker): {1e3 * extra:.2f} ms, "
                      f"{100 * extra / mean_pt:.1f}% of the mean point ({1e3 * mean_pt:.1f} ms)")
        base_s = totals[configs[0][0]][0]
        for label, w, _ in configs:
            seconds, busy, n = totals[label]
            _print(f"{'total':<12} {label:<16}", n, seconds, base_s, w, busy)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _row(name, label, w, seconds, base_s, rows):
    _print(f"{name:<12} {label:<16}", len(rows), seconds, base_s, w, float(rows["wall_s"].sum()))


def _print(head, n, seconds, base_s, w, busy):
    overhead = (w * seconds - busy) / n
    print(f"{head} {n:>6} {seconds:>9.2f} {base_s / seconds:>8.2f} {base_s / (w * seconds):>10.2f} "
          f"{1e3 * overhead:>14.2f} {100 * overhead / (busy / n):>11.1f}%")


def bench_gpu(address, n_points):
    if not fadev.cuda_available():
        print("\n--gpu: no CUDA device fadev can use; skipped")
        return
    pts = sweep.expand({"seed": list(range(n_points))},
                       base={"N": 2048, "D": 64, "heads": 8, "device": "cuda", "policy": "paper:bf16",
                             "ref_kernel": "baseline", "ref_policy": "naive:bf16"})
    reference = sweep.run(pts, executor="ray", address=address, gpus_per_point=1, progress=False)
    print(f"\n{'GPUs per point':>14} {'points':>6} {'wall s':>8} {'points/s':>9}")
    for g in (1, 0.5, 0.25):
        start = time.perf_counter()
        rows = sweep.run(pts, executor="ray", address=address, gpus_per_point=g, progress=False)
        seconds = time.perf_counter() - start
        _same(rows, reference, f"GPU sweep, {g} GPUs per point")
        print(f"{g:>14} {len(rows):>6} {seconds:>8.2f} {len(rows) / seconds:>9.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("quick", "full"), default="full")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--only", default=",".join(SWEEP_EXPERIMENTS), help="comma-separated experiments")
    ap.add_argument("--address", default=None, help="a running Ray cluster (default: a local instance)")
    ap.add_argument("--gpu", action="store_true", help="also GPU points with fractional GPUs per point")
    ap.add_argument("--gpu-points", type=int, default=32)
    ap.add_argument("--ray-serial", action="store_true",
                    help="also Ray with 1 worker: Ray's own cost per point, free of load imbalance")
    args = ap.parse_args()
    import ray
    start = time.perf_counter()
    ray.init(address=args.address, num_cpus=None if args.address else args.workers, include_dashboard=False,
             log_to_driver=False)
    print(f"Ray {ray.__version__} up in {time.perf_counter() - start:.1f} s: {ray.cluster_resources()}")
    validate(args.workers)
    bench_cpu([n.strip() for n in args.only.split(",") if n.strip()], args.size, args.workers, args.address,
              args.ray_serial)
    if args.gpu:
        bench_gpu(args.address, args.gpu_points)


if __name__ == "__main__":
    main()
