"""Where a sweep's points run: chunks of points handed to an executor, rows handed back to the one writer
(the driver, :func:`fadev.sweep.run`) as each chunk finishes.

* ``"local"``: the calling process (``workers=1``), else a pool of ``workers`` spawned processes, which
  exit when the driver is gone (a driver killed with SIGKILL leaves no worker or resource tracker behind);
* ``"ray"``: one Ray task per chunk (``ray.init(address=address)`` unless Ray is already initialised:
  None starts a local instance, "auto", "host:port" or "ray://host:port" joins a cluster, whose address
  must accept a connection within :data:`CONNECT_TIMEOUT_S`, else ConnectionError); points on device "cuda"
  ask for ``gpus_per_point`` GPUs (default 1; a fraction lets several tasks share a GPU). A task whose
  worker or node dies is retried by Ray, at most :data:`MAX_RETRIES` times;
* any ``concurrent.futures.Executor`` (Dask's ``client.get_executor()``, ...): a chunk whose future fails
  (its worker died) is resubmitted, at most :data:`MAX_RETRIES` times.

A point that raises becomes a *failed row* (its parameters, ``error``: "Type: message") and the sweep goes
on; a chunk whose retries run out gives failed rows for each of its points. Rows are computed by the same
function everywhere, so their metrics are identical bit for bit whichever executor ran them.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import socket
import threading
import time
from concurrent.futures.process import BrokenProcessPool

from .. import __version__, set_num_threads

MAX_RETRIES = 3
"""Retries of a chunk whose worker died (Ray's ``max_retries``; resubmissions on other executors)."""

DRIVER_POLL_S = 0.5
"""How often a local pool worker checks that its driver is alive (it exits when the driver is gone)."""

CONNECT_TIMEOUT_S = 5.0
"""How long a Ray address given as HOST:PORT may take to accept a connection before the sweep gives up."""

RAY_INSTALL = "pip install 'fadev[ray]' (or pip install ray)"


def failed_row(key, point, error):
    """The row of a point that raised: key, its parameters and ``error`` ("Type: message" of an exception,
    or the text given)."""
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return {"key": key, **point, "error": text, "fadev_version": __version__}


def evaluate_chunk(fn, key, points):
    """[fn(point) or its failed row] for each point: a point that raises does not stop the others."""
    rows = []
    for p in points:
        try:
            rows.append(fn(p))
        except Exception as e:
            rows.append(failed_row(key(p), p, e))
    return rows


def _ray_chunk(fn, key, points):
    set_num_threads(1)  # one core per task, as Ray's scheduler assumes (num_cpus=1)
    return evaluate_chunk(fn, key, points)


def _worker_init(driver):
    set_num_threads(1)
    threading.Thread(target=_exit_without, args=(driver,), name="fadev-driver-watch", daemon=True).start()


def _exit_without(driver):
    """End this pool worker once its driver (process ``driver``) is gone: a driver killed with SIGKILL
    cannot shut its pool down, whose workers (and with them multiprocessing's resource tracker) would
    otherwise wait for work forever. Checked every DRIVER_POLL_S seconds."""
    while os.getppid() == driver:
        time.sleep(DRIVER_POLL_S)
    os._exit(1)


def import_ray():
    """The ray module, or ImportError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError(f"executor 'ray' needs Ray, which is not installed: {RAY_INSTALL}") from None
    return ray


def check(executor, workers, address, gpus_per_point):
    """ValueError naming the argument unless the executor options make sense together."""
    if isinstance(executor, str):
        if executor not in ("local", "ray"):
            raise ValueError(f"executor must be 'local', 'ray' or a concurrent.futures.Executor, got {executor!r}")
    elif not isinstance(executor, concurrent.futures.Executor):
        raise ValueError(f"executor must be 'local', 'ray' or a concurrent.futures.Executor, got "
                         f"{type(executor).__name__}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if address is not None and executor != "ray":
        raise ValueError(f"address applies to executor='ray' only, got address={address!r} with executor={executor!r}")
    if address is not None:
        _host_port(address)
    if gpus_per_point is not None:
        if executor != "ray":
            raise ValueError(f"gpus_per_point applies to executor='ray' only, got {gpus_per_point!r}")
        if isinstance(gpus_per_point, bool) or not isinstance(gpus_per_point, (int, float)) or not gpus_per_point > 0:
            raise ValueError(f"gpus_per_point must be a number > 0 (a fraction shares a GPU), got {gpus_per_point!r}")


def _host_port(address):
    """(host, port) of a Ray address "HOST:PORT" or "ray://HOST:PORT", None for "auto"; TypeError /
    ValueError naming address otherwise."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a string (auto, HOST:PORT or ray://HOST:PORT), got "
                        f"{type(address).__name__} {address!r}")
    if address == "auto":
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be auto, HOST:PORT or ray://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _check_reachable(address):
    """ConnectionError naming address, within CONNECT_TIMEOUT_S, when nothing listens at a Ray address
    (ray.init itself would retry for minutes)."""
    where = _host_port(address) if address is not None else None
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(f"address {address!r}: no Ray cluster answers there ({e or type(e).__name__}); start "
                              f"one with `ray start --head` or give the address it printed") from None


def chunks(points, workers, group):
    """Consecutive points of one ``group(point)`` (shared inputs: the golden cache) and one device, at most
    8 per chunk and small enough for every worker to get about 4 chunks."""
    size = max(1, min(8, len(points) // (4 * workers)))
    out, current = [], []
    for p in points:
        if current and (len(current) == size or group(p) != group(current[0])
                        or p.get("device") != current[0].get("device")):
            out.append(current)
            current = []
        current.append(p)
    if current:
        out.append(current)
    return out


def execute(points, fn, key, group, *, executor="local", workers=None, address=None, gpus_per_point=None):
    """Yield lists of rows (fn(point) or failed rows) as chunks of ``points`` finish, on ``executor``.
    ``fn`` and ``key`` (point -> its key) must be picklable (module-level functions) for other processes."""
    check(executor, workers, address, gpus_per_point)
    if executor == "ray":
        yield from _on_ray(points, fn, key, group, workers, address, gpus_per_point)
    elif executor == "local" and ((workers or 1) == 1 or len(points) <= 1):
        for p in points:
            yield evaluate_chunk(fn, key, [p])
    elif executor == "local":
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                                                    initargs=(os.getpid(),)) as pool:
            yield from _on_executor(pool, chunks(points, workers, group), fn, key)
    else:
        yield from _on_executor(executor, chunks(points, workers or 4, group), fn, key)


def _on_executor(pool, parts, fn, key):
    """Chunks on a concurrent.futures.Executor, resubmitting a chunk whose future failed."""
    futures = {pool.submit(evaluate_chunk, fn, key, c): (c, 0) for c in parts}
    try:
        while futures:
            done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                part, tries = futures.pop(fut)
                try:
                    yield fut.result()
                except BrokenProcessPool as e:
                    raise RuntimeError("a sweep worker process died (killed, out of memory, or the calling script "
                                       "lacks the `if __name__ == '__main__':` guard that spawned workers need "
                                       "to import it safely)") from e
                except Exception as e:
                    if tries < MAX_RETRIES:
                        futures[pool.submit(evaluate_chunk, fn, key, part)] = (part, tries + 1)
                    else:
                        yield [failed_row(key(p), p, e) for p in part]
    except BaseException:
        for fut in futures:
            fut.cancel()
        raise


_remote = {}


def _on_ray(points, fn, key, group, workers, address, gpus_per_point):
    """One Ray task per chunk; rows come back to the driver with ray.wait as tasks finish."""
    ray = import_ray()
    if not ray.is_initialized():
        _check_reachable(address)
        ray.init(address=address, num_cpus=workers if address is None else None, log_to_driver=False)
    if workers is None:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    task = _remote.get(ray)
    if task is None:
        task = _remote[ray] = ray.remote(_ray_chunk)
    gpus = 1 if gpus_per_point is None else gpus_per_point
    # At most `workers` tasks in flight: the sweep uses the share of the cluster it was given (Ray alone would
    # run every submitted task at once on a larger cluster); the next chunk goes out as one finishes.
    todo, refs = iter(chunks(points, workers, group)), {}

    def submit():
        part = next(todo, None)
        if part is not None:
            options = {"num_cpus": 1, "max_retries": MAX_RETRIES,
                       "num_gpus": gpus if part[0].get("device") == "cuda" else 0}
            refs[task.options(**options).remote(fn, key, part)] = part

    for _ in range(workers):
        submit()
    try:
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1)
            for ref in ready:
                part = refs.pop(ref)
                submit()
                try:
                    rows = ray.get(ref)
                except ray.exceptions.RayError as e:  # retries used up, or the task could not run at all
                    lines = str(e).strip().splitlines() or [""]
                    error = f"{type(e).__name__}: {lines[-1]}"  # the cause, not Ray's whole traceback
                    rows = [failed_row(key(p), p, error) for p in part]
                yield rows
    except BaseException:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise

