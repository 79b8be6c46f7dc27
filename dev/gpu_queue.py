"""Jobs for the GPU machine's 10-minute calls: one queue, every GPU of the
machine taking the next job when its last one ends, until a deadline. A job the
deadline cuts runs again in the next call and does only what is left, so a
table too large for one call (seven models at three batch sizes) fills up over
several. (Engine runs 12-15 in docs/benchmarks.md used the `benchgrid` step
of dev/gpu_checks.sh, which this replaced.)

    python3 dev/gpu_queue.py --limit 565 --done done/ JOB [JOB ...]

JOB is one of
  bench:MODEL[:BATCHES[:COLUMNS[:ARGS]]]
                                   `python -m opara_core.bench` for those batches (default
                                   1,8,32) that no JSON under --done, or of this call, holds a
                                   row of yet, with --cache-dir CACHE/MODEL: the model's first job
                                   on the machine (that folder empty) times the serving build cold
                                   and warm there (the bench's "build s" column), later ones add
                                   --no-plan-capture and reuse its traces and compiled segments;
                                   COLUMNS as --columns takes them (quote the job: they hold spaces),
                                   ARGS more bench arguments, e.g.
                                   'bench:resnet50:1:compile max-autotune:--compile-autotune resnet50';
                                   rows count only from runs with the same ARGS, and a --cache-dir
                                   among them is the job's cache folder instead of CACHE/MODEL;
                                   a MODEL that is a model directory under --model-repository (one
                                   `python -m opara_core add-model` wrote) is timed from there
  tests:ARG[,ARG...]               pytest over those arguments (files, node ids, `--deselect`
                                   NODE: a heavy test can run as a job of its own), the tests
                                   marked gpu among them
  run:NAME=COMMAND                 a shell command; "{out}" in it is this call's output folder

A job that exits 0 leaves NAME.done in the output folder, and one whose
NAME.done lies under --done is skipped (a bench job's too, even where the model
lacks a column it names, so that its rows never hold that column). Each job logs to
OUT/NAME.log and runs with CUDA_VISIBLE_DEVICES set to its GPU and, on a machine
of several GPUs, on its GPU's share of the CPU cores (see cpu_shares). At the end
everything under OUT is moved into OUT/queue.tgz, which is then the folder's
only file (a device call returns only its first 8 files), and a summary is
printed: job, GPU, exit status ("cut" at the deadline), seconds. Unpack each
call's queue.tgz into the folder the next call gets as --done.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from opara_core.cpus import usable_cpus  # noqa: E402 - torch-free

FULL_ROW = ("eager", "compile", "auto")  # a bench row with all its columns has these


@dataclass(frozen=True)
class Job:
    spec: str
    name: str  # file-name safe: its log, its marker
    command: str | None  # None: nothing left to do


# the options job_for gives a bench job before its ARGS, in that order (True: takes a value)
QUEUE_OPTIONS = (("--models", True), ("--batch", True), ("--no-plan-capture", False), ("--cache-dir", True), ("--json", True), ("--columns", True))


def bench_rows(folders: list[Path], extra: list[str]) -> dict[tuple[str, int], set[str]]:
    """(model, batch) -> the columns measured, over the bench JSONs in the
    folders whose run had these ARGS (`extra`: a row measured with
    --fused-lanes-autotune is not one measured without). A JSON from before the
    bench recorded its arguments counts for any."""
    rows: dict[tuple[str, int], set[str]] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                data = json.loads(path.read_text())
                if extra_arguments(data.get("meta", {}).get("argv")) not in (None, extra):
                    continue
                for row in data["rows"]:
                    rows.setdefault((row["model"], int(row["batch"])), set()).update(row["timings"])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not a bench JSON
    return rows


def extra_arguments(argv: list[str] | None) -> list[str] | None:
    """A bench run's arguments after those job_for writes itself (QUEUE_OPTIONS):
    its job's ARGS. None where the run did not record its arguments."""
    if argv is None:
        return None
    at = 0
    for option, takes_value in QUEUE_OPTIONS:
        if argv[at : at + 1] == [option]:
            at += 2 if takes_value else 1
    return list(argv[at:])


def _option(arguments: list[str], name: str) -> str | None:
    """The value of the last `name VALUE` in `arguments` (argparse keeps the last)."""
    values = [arguments[i + 1] for i, a in enumerate(arguments[:-1]) if a == name]
    return values[-1] if values else None


def job_name(spec: str) -> str:
    """The file-name safe name of a job: its spec, cut to 80 characters plus a hash
    of the whole spec where it is longer, so that two long specs sharing their first
    80 characters (the six parameter cases of one test, a bench job's column lists)
    never share a `.done` marker: one finished would skip the others unrun."""
    name = re.sub(r"[^\w.-]+", "_", spec)
    return name if len(name) <= 80 else f"{name[:80]}_{hashlib.sha1(spec.encode()).hexdigest()[:10]}"


def job_for(spec: str, out: Path, done: Path, cache: Path, repository: Path | None = None) -> Job:
    """The command that does what is left of `spec` (see the module docstring)."""
    kind, _, rest = spec.partition(":")
    name = job_name(spec)
    if kind == "bench":
        model, batches, columns, more = (rest.split(":", 3) + ["", "", ""])[:4]
        if not re.fullmatch(r"\w+", model) or not re.fullmatch(r"(\d+,)*\d+|", batches):
            raise ValueError(f"job {spec!r}: bench:MODEL[:BATCHES[:COLUMNS[:ARGS]]], BATCHES like 1,8,32")
        try:
            extra = shlex.split(more)
        except ValueError as error:
            raise ValueError(f"job {spec!r}: its bench arguments: {error}") from None
        wanted = set(columns.split(",")) if columns else set(FULL_ROW)
        have = bench_rows([done, out], extra)
        left = [b for b in (batches or "1,8,32").split(",") if not wanted <= have.get((model, int(b)), set())]
        # a run of it that ended well is done too: a column the model has not (`fused opara
        # cudnn` for a transformer) is never in its rows
        if not left or any((folder / f"{name}.done").exists() for folder in (done, out)):
            return Job(spec, name, None)
        # the model's first job on this machine times its serving build, cold then warm, in the
        # empty cache folder; later jobs (a cut one's rest, other batches) reuse what it compiled
        # (ARGS may name a --cache-dir of its own: a setting that compiles other code, such as
        # --fused-lanes-autotune, next to a job of the same model without it)
        cold = not any(path.is_file() for path in Path(_option(extra, "--cache-dir") or cache / model).rglob("*"))
        ref = repository / model if repository is not None and (repository / model / "config.pbtxt").is_file() else model
        command = (f"python3 -m opara_core.bench --models {ref} --batch {','.join(left)}{'' if cold else ' --no-plan-capture'} "
                   f"--cache-dir {cache / model} --json {out / name}_b{'-'.join(left)}.json")
        command += f" --columns {shlex.quote(columns)}" if columns else ""
        return Job(spec, name, command + "".join(f" {shlex.quote(arg)}" for arg in extra))
    if kind == "run":
        name, _, command = rest.partition("=")
        if not name or not command or re.search(r"[^\w.-]", name):
            raise ValueError(f"job {spec!r}: run:NAME=COMMAND, NAME of letters, digits, '_', '.', '-'")
        command = command.replace("{out}", str(out))
    elif kind == "tests":
        command = f"python3 -m pytest -p no:cacheprovider -m gpu -q -rfE --durations=10 {' '.join(map(shlex.quote, rest.split(',')))}"
    else:
        raise ValueError(f"job {spec!r}: bench:, tests: or run:")
    return Job(spec, name, None if (done / f"{name}.done").exists() else command)


def job_env(gpu: int, gpus: int) -> dict[str, str]:
    """A job's environment: its GPU, and its share of the CPU cores for OpenMP's
    threads unless OMP_NUM_THREADS is set. Each process's OpenMP pool is as large
    as the machine, so four jobs at once on 64 cores run 4 x 64 threads: the
    likely reason why four NASNet benches took ~227 s before reading their
    cached trace, steps (two builds of the timm model, the read) that take ~38 s
    on the 2-core CPU machine (docs/benchmarks.md run 26; there, four NASNet
    builds at once took 21-25 s each with 2 threads per process, 11.3-11.7 with one)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // max(1, gpus))))
    return env


def cpu_shares(gpus: int) -> list[set[int]] | None:
    """Each GPU's cores: this process's cores cut into `gpus` equal shares, so
    that the job on one GPU (a cold build's compile workers on every core) cannot
    take the cores the job on another GPU times its replays and warm builds with.
    Run 40 (docs/benchmarks.md) ran unpinned on two H200s: DeepFM's per-call
    replays at 8 measured 0.076 ms beside NASNet's job against run 31's 0.062,
    while the build's own back-to-back timing read 0.056-0.057 in both, and
    NASNet's warm build took 10.7 s beside Inception-v3's cold build (loading its
    431 segments 5.8 s) against 8.8 s alone in run 39 (loading them 4.0-4.2 s).
    Hyperthreads of one core stay in one share (`core_groups`). None with one
    GPU, or fewer cores than GPUs."""
    if not hasattr(os, "sched_setaffinity"):  # no affinity on this platform
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if gpus < 2 or len(cpus) < gpus:
        return None
    groups = core_groups(cpus)
    if len(groups) < gpus:  # fewer physical cores than GPUs: share them by hyperthread
        groups = [[cpu] for cpu in cpus]
    size = len(groups) // gpus
    return [{cpu for group in groups[gpu * size : (gpu + 1) * size] for cpu in group} for gpu in range(gpus)]


def core_groups(cpus: list[int]) -> list[list[int]]:
    """`cpus` grouped by physical core (Linux's thread siblings), in the order
    of (socket, first CPU): contiguous groups then share a socket where they can."""
    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            siblings = _cpu_list((topology / "thread_siblings_list").read_text())
            socket = int((topology / "physical_package_id").read_text())
        except (OSError, ValueError):
            siblings, socket = [cpu], 0
        groups.setdefault((socket, min(siblings)), []).append(cpu)
    return [groups[key] for key in sorted(groups)]


def _cpu_list(text: str) -> list[int]:
    """Linux's CPU list format: "0-3,8,10-11"."""
    cpus = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def run_queue(
    specs: list[str], gpus: int, limit: float, out: Path, done: Path, cache: Path, repository: Path | None = None
) -> list[tuple[str, int, str, float]]:
    """Run the jobs, each GPU one at a time, until `limit` seconds have passed."""
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        job_for(spec, out, done, cache, repository)  # a malformed job stops the call before anything runs
    deadline = time.monotonic() + limit
    queue, lock, summary = list(specs), threading.Lock(), []
    shares = cpu_shares(gpus)
    # made before the workers pin themselves: usable_cpus reads the calling thread's cores
    envs = [job_env(gpu, gpus) for gpu in range(gpus)]

    def worker(gpu: int) -> None:
        if shares:  # this thread's affinity: the processes it starts inherit it
            os.sched_setaffinity(0, shares[gpu])
        cores = f" (CPUs {','.join(map(str, sorted(shares[gpu])))})" if shares else ""
        while True:
            with lock:
                if not queue or time.monotonic() >= deadline:
                    return
                job = job_for(queue.pop(0), out, done, cache, repository)  # now: an earlier job may have done part of it
            if job.command is None:
                summary.append((job.spec, gpu, "done before", 0.0))
                continue
            print(f"== {time.strftime('%H:%M:%S')} GPU {gpu}{cores}: {job.spec}: {job.command}", flush=True)
            start = time.monotonic()
            with open(out / f"{job.name}.log", "a") as log:
                process = subprocess.Popen(job.command, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=envs[gpu])
                try:
                    status = str(process.wait(timeout=max(deadline - time.monotonic(), 0.1)))
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGTERM)
                    try:
                        process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
                    status = "cut"
            if status == "0":
                (out / f"{job.name}.done").touch()
            summary.append((job.spec, gpu, status, round(time.monotonic() - start, 1)))
            print(f"== {time.strftime('%H:%M:%S')} GPU {gpu}: {job.spec}: exit {status}", flush=True)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in range(gpus)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    summary += [(spec, -1, "not started", 0.0) for spec in queue]
    pack(out)
    return summary


def pack(out: Path) -> None:
    """Move everything under `out` into out/queue.tgz: a device call returns the
    first 8 files of its output folder in name order, so the tarball must be alone
    there (run 17 lost a profile's JSON when 12 files came before it)."""
    packed = [path for path in sorted(out.rglob("*")) if path.is_file() and path.name != "queue.tgz"]
    with tarfile.open(out / "queue.tgz", "w:gz") as tar:
        for path in packed:
            tar.add(path, arcname=str(path.relative_to(out)))
    for path in packed:
        path.unlink()
    for folder in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()


def gpu_count() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"error: cannot list the GPUs with nvidia-smi ({error}); say how many with --gpus") from None
    return len([line for line in listed.splitlines() if line.startswith("GPU ")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", nargs="+", metavar="JOB")
    parser.add_argument("--limit", type=float, default=565, help="seconds until the jobs still running are cut (default 565)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")), help="output folder (default $OUT)")
    parser.add_argument("--done", type=Path, default=Path("done"), help="outputs of earlier calls: their bench rows and .done markers")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/benchcache"), help="bench build caches, one folder per model")
    parser.add_argument("--model-repository", type=Path, help="where bench jobs find models of no zoo: MODEL as a directory of it")
    parser.add_argument("--gpus", type=int, help="how many GPUs (default: as nvidia-smi lists them)")
    args = parser.parse_args(argv)
    try:
        summary = run_queue(args.jobs, args.gpus or gpu_count(), args.limit, args.out, args.done, args.cache, args.model_repository)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("| job | GPU | exit | s |\n|---|---:|---|---:|")
    for spec, gpu, status, seconds in summary:
        print(f"| {spec} | {gpu if gpu >= 0 else '-'} | {status} | {seconds} |")
    return 0 if all(status in ("0", "done before") for _, _, status, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
