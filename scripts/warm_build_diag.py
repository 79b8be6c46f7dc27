"""Why a model's warm build does work a cold build should have left done (GPU).

T5's first build in a new process after its cold build took 13.1-14.8 s, the
next one 5.5-6.3 s (docs/benchmarks.md runs 30-32): it compiled 27 Triton
kernels the cold build had not left in the cache. This script named the cause
(run 33: the cold build compiled the engine's kernels under another ptxas than
Inductor's, fixed in `inductor_cache.pin_triton_ptxas`). It runs the model's
serving build three times in an empty cache, each in a new process (`python -m
opara_core.bench --build-only`): cold, warm, warm again; and reports

- each build's seconds and what it loaded or compiled (the bench's report);
- the Triton cache folders each warm build added;
- for every kernel of those folders, how its Triton metadata (options,
  specialization, target) differs from the cold build's kernels of the same
  name, field by field: which of the key's inputs changed;
- the kernels each build compiled into Triton's default cache (~/.triton/cache)
  instead, where a kernel compiled before the engine points Triton at the
  Inductor cache lands and a later process does not look;
- every specialization of a `@triton.jit` kernel (the engine's own) that a
  build asked for, logged by Triton's JIT cache hook, and those the first warm
  build asked for that the cold one never did;
- every Inductor kernel a build benchmarked at its first call (a runtime
  autotune, which Inductor's autotune cache should spare a warm build), with
  its configurations, seconds and what that cache said of it;
- each build's garbage collections: how many, their seconds, and the
  seconds of the slower ones (generations 1 and 2) by the engine's function
  they interrupted;
- with --profile, where the second warm build's time went (its main thread's
  stack sampled every millisecond: OUT/MODEL_warm2.stacks, collapsed stacks
  in milliseconds as flame graph tools read them, and its functions by
  inclusive seconds in OUT/MODEL_warm2_profile.txt); the first warm build,
  what a server started on a cache filled ahead of time does, keeps its real
  seconds. (cProfile's cumulative times of NASNet's warm build under Python
  3.12 were wrong: 0 s in segment_compiler.load_saved of a 6.3 s load, run 36.)
- with --bytecode, two more warm builds that read torch's, Triton's and
  torchvision's bytecode, compiled first into a folder of its own
  (PYTHONPYCACHEPREFIX, CACHE/bytecode: 55 MB, too much for --out, which a
  GPU call brings back): what a pip install, which writes bytecode, builds
  in. The GPU machine's image has none and compiles their source in every
  process (NASNet's first warm build 8.8 s there with its fusion, 7.6 s with
  bytecode, docs/benchmarks.md run 39).

    python scripts/warm_build_diag.py t5 --out diag/        # about 4 minutes for T5 on an H200

Writes OUT/MODEL_diag.json and prints a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import json
import linecache
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from opara_core.cpus import usable_cpus  # noqa: E402 - torch-free

BUILDS = ("cold", "warm1", "warm2")
BYTECODE_BUILDS = ("bytecode1", "bytecode2")  # --bytecode
BYTECODE_PACKAGES = ("torch", "triton", "torchvision")
JIT_LOG_ENV = "OPARA_DIAG_JIT_LOG"
AUTOTUNE_LOG_ENV = "OPARA_DIAG_AUTOTUNE_LOG"
PROFILE_ENV = "OPARA_DIAG_PROFILE"
GC_LOG_ENV = "OPARA_DIAG_GC_LOG"
PROFILE_LINES = 40
REPO = str(Path(__file__).resolve().parents[1])


def install_jit_log(path: str) -> None:
    """Append one JSON line per in-memory cache miss of a `@triton.jit` kernel
    (before Triton looks on disk): its name, specialization data, the
    engine's functions it was called from (innermost last) and the TRITON_*
    environment variables at that moment."""

    def hook(**call) -> bool:  # Triton's keywords: key, repr, fn, compile, is_manual_warmup, already_compiled
        try:
            where = [f"{Path(f.filename).stem}.{f.name}" for f in traceback.extract_stack() if "opara_core" in f.filename][-6:]
            env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}  # e.g. a PTXAS or LIBDEVICE path Inductor set meanwhile
            entry = {"name": call["fn"].name, "repr": call.get("repr"), "specialization": (call.get("compile") or {}).get("specialization_data"), "where": where, "env": env}
            with open(path, "a") as log:
                log.write(json.dumps(entry, default=str) + "\n")
        except Exception as error:  # noqa: BLE001 - a diagnostic must not break the build it watches
            print(f"warm_build_diag: JIT log entry not written: {error!r}", file=sys.stderr)
        return False  # True would tell Triton to skip the compile

    try:
        from triton import knobs

        knobs.runtime.jit_cache_hook = hook
    except ImportError:  # Triton before 3.4
        from triton.runtime.jit import JITFunction

        JITFunction.cache_hook = hook


def timed_benchmarks(benchmark_all_configs, path: str):
    """`CachingAutotuner.benchmark_all_configs` that also appends a JSON line per
    call: the kernel, how many configurations it timed, the seconds, what
    Inductor's autotune cache said of it when the kernel was set up ("miss"; none
    where it was not consulted), whether the choice will be saved there (where
    a warm build would find it), and the file it is kept in: its path, the
    kernel's configurations' hash, and the file's content before and after the
    call (NASNet's warm builds timed the same 5 kernels again although the cold
    build saved its choices, run 34: absent, overwritten or another hash)."""

    def benchmark(self, *args, **kwargs):
        cache = getattr(getattr(self, "save_cache_hook", None), "__self__", None)  # the hook is AutotuneCache.save
        local = getattr(cache, "local_cache", None)
        kept_in = local[1] if local else None
        before = best_config_file(kept_in)
        start = time.perf_counter()
        timings = benchmark_all_configs(self, *args, **kwargs)
        try:
            meta = getattr(self, "inductor_meta", None) or {}
            entry = {"kernel": meta.get("kernel_name", getattr(getattr(self, "fn", None), "__name__", "?")), "configs": len(timings),
                     "seconds": round(time.perf_counter() - start, 4), "cache_state": (getattr(self, "autotune_cache_info", None) or {}).get("autotune_cache_state"),
                     "saved": getattr(self, "save_cache_hook", None) is not None, "kept_in": kept_in, "configs_hash": getattr(cache, "configs_hash", None),
                     "file_before": before, "file_after": best_config_file(kept_in)}  # fmt: skip
            with open(path, "a") as log:
                log.write(json.dumps(entry) + "\n")
        except Exception as error:  # noqa: BLE001 - a diagnostic must not break the build it watches
            print(f"warm_build_diag: autotune log entry not written: {error!r}", file=sys.stderr)
        return timings

    return benchmark


def best_config_file(path: str | None):
    """An autotune cache file's content (JSON where it parses), or None where there is none."""
    try:
        text = Path(path).read_text() if path else None
    except (OSError, TypeError):  # read before the benchmark, outside its guard: never raises into the build
        return None
    try:
        return json.loads(text) if text is not None else None
    except ValueError:
        return text[:300]


def install_autotune_log(path: str) -> None:
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    CachingAutotuner.benchmark_all_configs = timed_benchmarks(CachingAutotuner.benchmark_all_configs, path)


class StackSampler:
    """The calling thread's Python stack sampled from a thread of its own every
    `interval` seconds, each sample weighted by the seconds since the one
    before (a sample waits for the GIL, and the wait counts for the stack it
    then finds): seconds per stack, which stay right where cProfile's did not."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.seconds: Counter[tuple[str, ...]] = Counter()
        self._target = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._target)
            now = time.perf_counter()
            if frame is not None:
                self.seconds[stack_of(frame)] += now - last
            last = now

    def write(self, path: Path) -> None:
        """Collapsed stacks, root first, with their milliseconds."""
        path.write_text("".join(f"{';'.join(stack)} {seconds * 1000:.1f}\n" for stack, seconds in self.seconds.most_common()))


def stack_of(frame) -> tuple[str, ...]:
    """`file:line(function)` of each frame, the outermost first; files under
    site-packages or this repository by their path there. The code objects are
    collected first: the main thread runs again at the first call that
    releases the GIL, and a generator it finishes meanwhile loses its parents."""
    codes = []
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    return tuple(_frame_name(code) for code in reversed(codes))


@functools.cache
def _frame_name(code) -> str:
    path = code.co_filename.split("site-packages/")[-1].removeprefix(f"{REPO}/")
    return f"{path}:{code.co_firstlineno}({code.co_name})"


def top_functions(stacks: Path, lines: int = PROFILE_LINES) -> str:
    """The functions of a collapsed-stacks file by inclusive seconds (each
    function once per stack, however deep it recurses), with their own; what
    went wrong instead where the file holds none: the rest of the report stands."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    try:
        for line in stacks.read_text().splitlines():
            stack, _, ms = line.rpartition(" ")
            frames = stack.split(";")
            for name in set(frames):
                inclusive[name] += float(ms) / 1000
            own[frames[-1]] += float(ms) / 1000
    except (OSError, ValueError) as error:
        return f"no profile in {stacks}: {error}\n"
    if not inclusive:
        return f"no profile in {stacks}: no samples\n"
    rows = [f"{'inclusive s':>11} {'own s':>7}  function"]
    rows += [f"{seconds:11.3f} {own[name]:7.3f}  {name}" for name, seconds in inclusive.most_common(lines)]
    return "\n".join(rows) + "\n"


class GarbageCollections:
    """Every garbage collection of this process (gc.callbacks): how many and
    their seconds per generation, and the seconds of those of generations 1
    and 2 by the innermost function of this repository's engine they
    interrupted (a collection runs at whatever allocation crossed its threshold)."""

    def __init__(self):
        self.count: Counter[int] = Counter()
        self.seconds: Counter[int] = Counter()
        self.by_function: Counter[str] = Counter()
        self.full: list[dict] = []  # each full collection: where it started, what was frozen, its seconds
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        generation = info["generation"]
        if phase == "start":
            self._start = time.perf_counter()
            if generation == 2:
                self.full.append(self._full_collection())
            return
        spent = time.perf_counter() - self._start
        self.count[generation] += 1
        self.seconds[generation] += spent
        if generation == 2:
            self.full[-1]["seconds"] = round(spent, 4)
        if generation:
            frame = sys._getframe(0).f_back  # None where no Python frame triggered it
            while frame is not None and "opara_core" not in frame.f_code.co_filename:
                frame = frame.f_back
            self.by_function[f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}" if frame else "(outside the engine)"] += spent

    def report(self) -> dict:
        return {
            "collections": {str(g): n for g, n in sorted(self.count.items())},
            "seconds": {str(g): round(s, 4) for g, s in sorted(self.seconds.items())},
            "slow_ones_by_function": {name: round(s, 4) for name, s in self.by_function.most_common()},
            "full": self.full,
        }

    @staticmethod
    def _full_collection() -> dict:
        """Whether the build's policy held (objects frozen, gc's generation-2
        threshold) and the Python line that set it off: an explicit
        `gc.collect()` names itself there."""
        try:
            frame = sys._getframe(2)  # past this and __call__: the code running when it started
        except ValueError:  # set off where no Python code runs
            frame = None
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}({frame.f_code.co_name})" if frame else "(no Python frame)"
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() if frame else ""
        return {"where": where, "line": line, "frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()[2]}


def triton_folders(cache: Path) -> dict[str, list[str]]:
    """Triton cache folder (relative path) -> the names of its files."""
    folders: dict[str, list[str]] = defaultdict(list)
    for path in cache.rglob("*"):
        if path.is_file() and path.parent.parent.name == "0" and path.parent.parent.parent.name == "triton":
            folders[str(path.parent.relative_to(cache))].append(path.name)
    return dict(folders)


def default_cache_kernels(home: Path = Path.home()) -> dict[str, list[str]]:
    """Folder -> kernel names in Triton's default cache, ~/.triton/cache."""
    root = home / ".triton" / "cache"
    if not root.is_dir():
        return {}
    return {folder.name: sorted(kernel_metadata(folder)) for folder in root.iterdir() if folder.is_dir()}


def kernel_metadata(folder: Path) -> dict[str, dict]:
    """Kernel name -> its Triton metadata (the folder's `NAME.json`, not the
    `__grp__` group file), plus two fields of ours: the `tt.func` lines of its
    `.ttir` (the arguments' specialization, e.g. `tt.divisibility`) and its
    `.cubin`'s size in bytes (the same size: very likely the same machine code)."""
    found = {}
    for path in folder.glob("*.json"):
        if path.name.startswith("__grp__"):
            continue
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        ttir, cubin = path.with_suffix(".ttir"), path.with_suffix(".cubin")
        meta["_ttir_signature"] = [line.strip() for line in ttir.read_text().splitlines() if "tt.func" in line] if ttir.exists() else None
        meta["_cubin_bytes"] = cubin.stat().st_size if cubin.exists() else None
        found[path.stem] = meta
    return found


def differing_fields(new: dict, old: dict, ignore: tuple[str, ...] = ("hash",)) -> dict[str, list]:
    """Top-level fields whose values differ: field -> [new, old]."""
    return {k: [new.get(k), old.get(k)] for k in sorted(set(new) | set(old)) if k not in ignore and new.get(k) != old.get(k)}


def compare_new_kernels(cache: Path, new_folders: list[str], cold_folders: list[str]) -> list[dict]:
    """For each kernel of `new_folders`: the fields in which it differs from
    each cold-build kernel of the same name (fewest differences first)."""
    cold_by_name: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for folder in cold_folders:
        for name, meta in kernel_metadata(cache / folder).items():
            cold_by_name[name].append((folder, meta))
    out = []
    for folder in new_folders:
        for name, meta in kernel_metadata(cache / folder).items():
            against = sorted(({"cold_folder": f, "differs": differing_fields(meta, m)} for f, m in cold_by_name.get(name, [])), key=lambda d: len(d["differs"]))
            out.append({"kernel": name, "folder": folder, "cold_kernels_of_that_name": len(against), "closest": against[:3]})
    return out


def read_json_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def new_specializations(warm: list[dict], cold: list[dict]) -> list[dict]:
    """Entries of `warm` whose (name, specialization) the cold build never asked for."""
    seen = {_identity(e) for e in cold}
    return [e for e in warm if _identity(e) not in seen]


def _identity(entry: dict) -> tuple:
    """A request's kernel and specialization (its repr where this Triton gives no specialization data)."""
    return entry["name"], entry["specialization"] or entry["repr"]


def compile_bytecode(prefix: Path, env: dict) -> dict:
    """BYTECODE_PACKAGES byte-compiled into `prefix` (PYTHONPYCACHEPREFIX), as a
    pip install writes their bytecode: where, which folders, the seconds and
    compileall's exit status (1 where some file does not compile; the rest is
    still written)."""
    shutil.rmtree(prefix, ignore_errors=True)
    specs = [importlib.util.find_spec(name) for name in BYTECODE_PACKAGES]
    folders = [str(Path(spec.origin).parent) for spec in specs if spec is not None and spec.origin]
    start = time.perf_counter()
    # the job's cores: "-j 0" takes every core of the machine
    run = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", str(usable_cpus()), *folders], env={**env, "PYTHONPYCACHEPREFIX": str(prefix)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    return {"prefix": str(prefix), "folders": folders, "seconds": round(time.perf_counter() - start, 1), "exit": run.returncode}


def _child(argv: list[str]) -> None:
    """A build process: the logs installed, then the bench's `--build-only`
    (its stack sampled where asked)."""
    if os.environ.get(JIT_LOG_ENV):
        install_jit_log(os.environ[JIT_LOG_ENV])
    if os.environ.get(AUTOTUNE_LOG_ENV):
        install_autotune_log(os.environ[AUTOTUNE_LOG_ENV])
    collections = GarbageCollections()
    gc.callbacks.append(collections)
    sys.argv = ["opara_core.bench", *argv]
    sampler = StackSampler() if os.environ.get(PROFILE_ENV) else contextlib.nullcontext()
    try:
        with sampler:
            runpy.run_module("opara_core.bench", run_name="__main__", alter_sys=True)
    finally:
        gc.callbacks.remove(collections)
        if os.environ.get(GC_LOG_ENV):
            Path(os.environ[GC_LOG_ENV]).write_text(json.dumps(collections.report()))
        if isinstance(sampler, StackSampler):
            sampler.write(Path(os.environ[PROFILE_ENV]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, help="the build cache to use (emptied first; default: a new temporary folder)")
    parser.add_argument("--profile", action="store_true", help="sample the second warm build's stack (a little slower: its seconds are then not quite the build's)")
    parser.add_argument("--bytecode", action="store_true", help="then two more warm builds reading torch's bytecode, compiled first into a folder of its own (CACHE/bytecode)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache or Path(tempfile.mkdtemp(prefix=f"warmdiag_{args.model}_"))
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env = {**os.environ, "OPARA_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    env.pop("TRITON_CACHE_DIR", None)  # the engine points Triton at the Inductor cache's triton/0
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    # Inductor points Triton at torch's own ptxas, where the wheel has one, at its first compile in a process
    result: dict = {"model": args.model, "cache": str(cache), "torch_bundled_ptxas": (torch_dir / "bin" / "ptxas").exists(), "builds": {}, "garbage_collections": {}}
    folders: dict[str, dict[str, list[str]]] = {}
    logs: dict[str, list[dict]] = {}
    autotuned: dict[str, list[dict]] = {}
    outside = default_cache_kernels()
    builds = BUILDS + (BYTECODE_BUILDS if args.bytecode else ())
    for build in builds:
        if build == BYTECODE_BUILDS[0]:
            result["bytecode"] = compile_bytecode(cache / "bytecode", env)  # not under --out: 55 MB for torch's
            env["PYTHONPYCACHEPREFIX"] = result["bytecode"]["prefix"]
        jit_log, autotune_log, gc_log, profile = (args.out / f"{args.model}_{build}{suffix}" for suffix in ("_jit.jsonl", "_autotune.jsonl", "_gc.json", ".stacks"))
        for stale in (jit_log, autotune_log, gc_log, profile):
            stale.unlink(missing_ok=True)
        logged = {JIT_LOG_ENV: str(jit_log), AUTOTUNE_LOG_ENV: str(autotune_log), GC_LOG_ENV: str(gc_log)}
        logged |= {PROFILE_ENV: str(profile)} if args.profile and build == BUILDS[-1] else {}
        command = [sys.executable, __file__, "--child", "--build-only", args.model]
        with open(args.out / f"{args.model}_{build}.log", "w") as stderr:
            run = subprocess.run(command, env={**env, **logged}, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=1800)
        if run.returncode != 0:
            print(f"{build} build failed (exit {run.returncode}); its log: {args.out / f'{args.model}_{build}.log'}", file=sys.stderr)
            return 1
        result["builds"][build] = json.loads(run.stdout.strip().splitlines()[-1])
        folders[build] = triton_folders(cache)
        now = default_cache_kernels()
        result[f"default_cache_added_by_{build}"] = sorted(name for folder in set(now) - set(outside) for name in now[folder])
        outside = now
        logs[build] = read_json_lines(jit_log)
        autotuned[build] = read_json_lines(autotune_log)
        result["garbage_collections"][build] = json.loads(gc_log.read_text()) if gc_log.exists() else None
        if profile.exists():
            (args.out / f"{args.model}_{build}_profile.txt").write_text(top_functions(profile))
    for before, after in zip(builds, builds[1:]):
        added = sorted(set(folders[after]) - set(folders[before]))
        result[f"added_by_{after}"] = {"folders": len(added), "kernels": compare_new_kernels(cache, added, list(folders["cold"]))}
        result[f"new_jit_specializations_{after}"] = new_specializations(logs[after], [e for b in builds[: builds.index(after)] for e in logs[b]])
    result["jit_requests"] = {build: len(entries) for build, entries in logs.items()}
    result["autotuned_at_first_call"] = autotuned
    path = args.out / f"{args.model}_diag.json"
    path.write_text(json.dumps(result, indent=1))
    for build in builds:
        seconds = result["builds"][build]["seconds"]
        print(f"{build}: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + f"; {result['builds'][build]['inductor']}")
    for build in builds:
        collected = result["garbage_collections"][build]
        if collected:
            slow = ", ".join(f"{name} {s:.2f}" for name, s in list(collected["slow_ones_by_function"].items())[:5])
            print(f"{build}: garbage collections per generation {collected['collections']}, seconds {collected['seconds']}; generations 1-2 in {slow or 'none'}")
            for full in collected.get("full", []):
                print(f"  full collection {full.get('seconds', 0.0):.2f} s, {full['frozen']} objects frozen, threshold {full['threshold']}: {full['where']}: {full['line']}")
    print(f"torch's own ptxas: {'yes' if result['torch_bundled_ptxas'] else 'no'}")
    if "bytecode" in result:
        compiled = result["bytecode"]
        print(f"bytecode for {', '.join(Path(f).name for f in compiled['folders'])} compiled into {compiled['prefix']} in {compiled['seconds']:.1f} s (exit {compiled['exit']}) before {', '.join(BYTECODE_BUILDS)}")
    for build in builds:
        print(f"{build}: {len(result[f'default_cache_added_by_{build}'])} kernels into ~/.triton/cache: {', '.join(sorted(set(result[f'default_cache_added_by_{build}'])))}")
    for build in builds:
        timed = autotuned[build]
        states = Counter(str(entry["cache_state"]) for entry in timed)
        unsaved = sum(not entry["saved"] for entry in timed)
        print(f"{build}: {len(timed)} Inductor kernels autotuned at their first call ({sum(e['seconds'] for e in timed):.1f} s; autotune cache "
              + ", ".join(f"{state} {n}" for state, n in sorted(states.items())) + f"; {unsaved} whose choice is not saved)")
        for entry in timed:
            if entry.get("file_before") is not None:  # a choice was kept for it, and it was timed anyway
                kept = entry["file_before"]
                print(f"  {entry['kernel']}: its file held {kept} (configs hash now {entry.get('configs_hash')})")
    for after in builds[1:]:
        added = result[f"added_by_{after}"]
        print(f"{after}: {added['folders']} new Triton folders, {len(result[f'new_jit_specializations_{after}'])} new @triton.jit specializations")
        for entry in result[f"new_jit_specializations_{after}"]:
            print(f"  jit {entry['repr']} from {' < '.join(reversed(entry['where']))}")
        for kernel in added["kernels"]:
            closest = kernel["closest"][0]["differs"] if kernel["closest"] else "no cold kernel of that name"
            print(f"  {kernel['kernel']}: {closest}")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
    else:
        sys.exit(main())
