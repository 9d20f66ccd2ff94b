"""Faults on the scale paths end in bounded time, with one line saying what happened, and leave no process
behind: a rank that stalls (SIGSTOP) or dies (SIGKILL) while the others wait for it; the driver of a sweep
with local worker processes killed with SIGKILL; a Ray address where nothing listens; a chunk whose
executor keeps failing (its points become failed rows, none is dropped). Ranks: gloo on the CPU, 2 processes."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import fadev
from fadev import sweep
from fadev.sweep import executors

import helpers

TESTS = os.path.dirname(os.path.abspath(__file__))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(fadev.__file__)), TESTS,
                                         env.get("PYTHONPATH", "")])
    return env


def _session(sid):
    """The pids of the live processes of session ``sid`` (a child started with start_new_session=True and
    everything it started, whoever their parent is now); zombies are not counted."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _run_bounded(args, limit, cwd):
    """Run a Python child in its own session; (returncode, stderr, seconds, pids of its session left once it
    ended). The test fails past ``limit`` seconds (the whole session killed first: nothing outlives the test)."""
    start = time.monotonic()
    child = subprocess.Popen([sys.executable, *args], env=_env(), cwd=str(cwd), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    left = []
    try:
        _, err = child.communicate(timeout=limit)
        settle = time.monotonic() + 5  # multiprocessing's resource tracker ends once it reads EOF
        while (left := _session(child.pid)) and time.monotonic() < settle:
            time.sleep(0.05)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail(f"still running after {limit} s")
    finally:
        for pid in _session(child.pid):
            os.kill(pid, signal.SIGKILL)
    return child.returncode, err, time.monotonic() - start, left


# ---------------------------------------------------------------- ranks

pytest.importorskip("torch")


@pytest.mark.parametrize("fault", ["stalled", "dying"])
def test_a_stalled_or_dead_rank_ends_the_cli_in_one_line(tmp_path, fault):
    """`fadev ring-dist --spawn 2 --timeout 2` whose rank 1 stops (or dies) while rank 0 waits for it at a
    barrier: the command ends well within a minute (the collective timeout, then spawn's grace), exit 1, its
    whole stderr one line naming the rank (no traceback, no warning), no rank left running. Bounded (90 s
    here) only if distributed.init passes its timeout on (the default would wait 30 minutes)."""
    script = tmp_path / "cli.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import faulty
        from fadev.__main__ import main
        from fadev.experiments import ring_dist
        ring_dist._study = faulty.{fault}_study
        if __name__ == "__main__":
            sys.exit(main(["ring-dist", "--spawn", "2", "--Ws", "1,2", "--Ls", "1", "--timeout", "2", "--out", "rd",
                           "--no-progress"]))
    """))
    code, err, seconds, left = _run_bounded([str(script)], 90, tmp_path)
    ours = err.strip().splitlines()
    assert code == 1 and len(ours) == 1 and ours[0].startswith("fadev ring-dist: ") and not left, (err, left)
    if fault == "stalled":  # about 15 s here (2 processes start, a 2 s timeout, 2 x 3 s of grace)
        assert ours[0].startswith("fadev ring-dist: rank 0 failed: RuntimeError:") and "2 s timeout" in ours[0]
    else:
        assert ours[0] == "fadev ring-dist: rank 1 died (signal SIGKILL); the other ranks were stopped", ours


def test_spawn_ends_every_rank_within_its_grace(tmp_path):
    """fadev.distributed.spawn (timeout 1 s, grace 0.5 s): rank 1 dies, or stops, before its ring call while
    rank 0's ring waits for it: RankError, no rank left. The stopped rank costs about the timeout and two
    graces more than the dead one (not torch's 30 s wait for a SIGTERM a stopped process never handles)."""
    seconds = {}
    for fault, want in (("kill", "RankError: rank 1 died (signal SIGKILL); the other ranks were stopped (rank 1)"),
                        ("stop", "RankError: rank 0 failed: RuntimeError: ")):
        script = tmp_path / f"{fault}.py"
        script.write_text(textwrap.dedent(f"""
            import faulty
            from fadev import distributed as fd
            if __name__ == "__main__":
                try:
                    fd.spawn(faulty.ring_with_a_fault, 2, {fault!r}, timeout=1, grace=0.5)
                except fd.RankError as e:
                    raise SystemExit(f"RankError: {{e}} (rank {{e.rank}})")
        """))
        code, err, seconds[fault], left = _run_bounded([str(script)], 90, tmp_path)
        assert code == 1 and err.strip().splitlines()[-1].startswith(want) and not left, (err, left)
    assert seconds["stop"] - seconds["kill"] < 15, seconds  # 1 + 2 x 0.5 s, and noise


def _trace(error):
    return f'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\n{error}\n'


def test_rank_error_names_the_cause_not_its_knock_on_effects(tmp_path):
    """Several ranks raised (torch reports whichever it noticed first): the one-line error names the rank
    that failed for a reason of its own, even if a knock-on error (a closed connection, a timeout) was
    written first; with knock-on errors only, the earliest."""
    import pickle
    import torch.multiprocessing as mp
    from fadev import distributed as fd
    errors = {1: "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4", 2: "KeyError: 'w'",
              3: "RuntimeError: Timed out waiting 2000ms for recv operation to complete"}
    ctx = type("Ctx", (), {"error_files": [str(tmp_path / f"rank{r}") for r in range(4)]})()
    for r, when in ((1, 100), (2, 300), (3, 200)):
        with open(ctx.error_files[r], "wb") as fh:
            pickle.dump(_trace(errors[r]), fh)
        os.utime(ctx.error_files[r], ns=(when, when))
    noticed = mp.ProcessRaisedException("-- Process 1 terminated with the following error:\n" + _trace(errors[1]), 1, 9)
    e = fd._rank_error(noticed, ctx, 2.0)
    assert (str(e), e.rank, e.details) == ("rank 2 failed: KeyError: 'w'", 2, _trace(errors[2]))
    os.remove(ctx.error_files[2])
    e = fd._rank_error(noticed, ctx, 2.0)
    assert str(e).startswith("rank 1 failed: RuntimeError: [pair.cc:553] Connection closed by peer") and e.rank == 1
    os.remove(ctx.error_files[1])
    assert str(fd._rank_error(noticed, ctx, 2.0)) == f"rank 3 failed: {errors[3]} (a collective waited more than " \
        "the 2 s timeout: another rank stalled or died; raise the timeout if a rank legitimately works that long)"


def test_timeouts_are_checked(tmp_path, capsys):
    from fadev import distributed as fd
    from fadev.__main__ import main
    for bad in (0, -1, float("inf"), float("nan"), "60", True, None):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            fd.init(timeout=bad)
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            fd.spawn(print, 1, timeout=bad)
    with pytest.raises(ValueError, match="grace must be a number of seconds > 0"):
        fd.spawn(print, 1, grace=0)
    capsys.readouterr()
    assert main(["ring-dist", "--spawn", "2", "--Ws", "1,2", "--timeout", "0", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "fadev ring-dist: timeout must be a number of seconds > 0, got 0.0\n"


# ---------------------------------------------------------------- sweep drivers and executors

def test_killing_the_driver_of_a_local_pool_leaves_no_process(tmp_path):
    """A sweep on 2 local worker processes, its driver SIGKILLed mid-sweep (the documented kill-and-rerun):
    within a few seconds no process it started is left (the pool's workers and multiprocessing's resource
    tracker end with it), though there were 3 while it ran; the rerun then finishes every point once."""
    n, out = 24, tmp_path / "killed.jsonl"
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import helpers
        from fadev import sweep
        if __name__ == "__main__":
            pts = sweep.validate(sweep.expand({{"seed": list(range({n}))}}, base={{"N": 16, "D": 8}}))
            sweep.drive({{sweep.point_key(p): p for p in pts}}, helpers.slow_evaluate, sweep.point_key, {str(out)!r},
                        workers=2, progress=False)
    """))
    child = subprocess.Popen([sys.executable, str(script)], env=_env(), cwd=str(tmp_path), start_new_session=True)
    try:
        started = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out.exists() and out.read_bytes().count(b"\n") >= 2):
            started = [p for p in _session(child.pid) if p != child.pid]
            time.sleep(0.01)
        assert len(started) >= 3, f"expected 2 pool workers and the resource tracker, found {started}"
        helpers.kill_when(child, out, 2)
        deadline = time.monotonic() + 3 * executors.DRIVER_POLL_S + 10
        while time.monotonic() < deadline and _session(child.pid):
            time.sleep(0.05)
        left = _session(child.pid)
        assert not left, f"{len(left)} processes outlived their driver: {left}"
    finally:
        for pid in _session(child.pid):
            os.kill(pid, signal.SIGKILL)
    pts = sweep.validate(sweep.expand({"seed": list(range(n))}, base={"N": 16, "D": 8}))
    df = sweep.run(pts, out, progress=False)
    assert len(df) == n and sweep.load(out)["key"].is_unique and len(sweep.load(out)) == n


class FlakyExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose first ``fails`` submissions of every chunk fail as a lost worker would."""

    def __init__(self, fails):
        super().__init__(2)
        self.fails, self.tries = fails, {}

    def submit(self, fn, *args, **kwargs):
        chunk = tuple(p["seed"] for p in args[2])
        self.tries[chunk] = self.tries.get(chunk, 0) + 1
        if self.tries[chunk] <= self.fails:
            lost = concurrent.futures.Future()
            lost.set_exception(ConnectionResetError("worker lost"))
            return lost
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("fails", [executors.MAX_RETRIES, executors.MAX_RETRIES + 1])
def test_a_chunk_whose_retries_run_out_becomes_failed_rows(fails):
    """Through a custom Executor: a chunk that fails MAX_RETRIES times still runs; one more failure and each
    of its points is a failed row naming the cause; no point is dropped or run twice."""
    pts = {sweep.point_key(p): p for p in sweep.validate(sweep.expand({"seed": list(range(6))},
                                                                      base={"N": 8, "D": 4}))}
    with FlakyExecutor(fails) as pool:
        rows = sweep.drive(pts, sweep.evaluate, sweep.point_key, None, executor=pool, workers=2, progress=False)
    assert sorted(rows) == sorted(pts)
    assert all(n == min(fails, executors.MAX_RETRIES) + 1 for n in pool.tries.values()) and len(pool.tries) >= 2
    errors = [r.get("error") for r in rows.values()]
    if fails <= executors.MAX_RETRIES:
        assert errors == [None] * len(pts)
    else:
        assert errors == ["ConnectionResetError: worker lost"] * len(pts)


def test_ray_address_errors_are_fast_and_clear(monkeypatch):
    pytest.importorskip("ray")
    pts = sweep.expand(base={"N": 8, "D": 4})
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ray", None)  # checked before Ray is imported, before any file is opened
        with pytest.raises(TypeError, match=r"^address must be a string .* got int 5"):
            sweep.run(pts, executor="ray", address=5)
    for bad in ("nonsense", "host:port", "127.0.0.1:0", "ray://:10001", ""):
        with pytest.raises(ValueError, match="address must be auto, HOST:PORT or ray://HOST:PORT"):
            sweep.run(pts, executor="ray", address=bad)
    for unreachable in ("127.0.0.1:1", "ray://127.0.0.1:1"):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=f"address '{unreachable}': no Ray cluster answers there"):
            sweep.run(pts, executor="ray", address=unreachable, progress=False)
        assert time.monotonic() - start < executors.CONNECT_TIMEOUT_S + 5
    with pytest.raises(TypeError, match=r"^out must be the path of a .jsonl or .csv results file .* got int 5"):
        sweep.run(pts, 5)
    with pytest.raises(TypeError, match=r"^path: a results file is a str or os.PathLike path, got int 5"):
        sweep.load(5)
