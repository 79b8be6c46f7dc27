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
- with --profile, where the second warm build's time went (cProfile:
  OUT/MODEL_warm2.prof, its top functions by cumulative time in
  OUT/MODEL_warm2_profile.txt); the first warm build, what a server started
  on a cache filled ahead of time does, keeps its real seconds.

    python scripts/warm_build_diag.py t5 --out diag/        # about 4 minutes for T5 on an H200

Writes OUT/MODEL_diag.json and prints a summary.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

BUILDS = ("cold", "warm1", "warm2")
JIT_LOG_ENV = "OPARA_DIAG_JIT_LOG"
AUTOTUNE_LOG_ENV = "OPARA_DIAG_AUTOTUNE_LOG"
PROFILE_ENV = "OPARA_DIAG_PROFILE"
PROFILE_LINES = 40


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


def top_functions(profile: Path, lines: int = PROFILE_LINES) -> str:
    """pstats' table of a profile's functions by cumulative time (what went
    wrong instead, where the file holds none: the rest of the report stands)."""
    text = io.StringIO()
    try:
        pstats.Stats(str(profile), stream=text).sort_stats("cumulative").print_stats(lines)
    except (TypeError, ValueError, EOFError, OSError) as error:
        return f"no profile in {profile}: {error}\n"
    return text.getvalue()


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


def _child(argv: list[str]) -> None:
    """A build process: the logs installed, then the bench's `--build-only`
    (under cProfile where asked)."""
    if os.environ.get(JIT_LOG_ENV):
        install_jit_log(os.environ[JIT_LOG_ENV])
    if os.environ.get(AUTOTUNE_LOG_ENV):
        install_autotune_log(os.environ[AUTOTUNE_LOG_ENV])
    sys.argv = ["opara_core.bench", *argv]
    profiler = cProfile.Profile() if os.environ.get(PROFILE_ENV) else None
    if profiler:
        profiler.enable()
    try:
        runpy.run_module("opara_core.bench", run_name="__main__", alter_sys=True)
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(os.environ[PROFILE_ENV])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, help="the build cache to use (emptied first; default: a new temporary folder)")
    parser.add_argument("--profile", action="store_true", help="run the second warm build under cProfile (slower: its seconds are then not the build's)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache or Path(tempfile.mkdtemp(prefix=f"warmdiag_{args.model}_"))
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env = {**os.environ, "OPARA_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    env.pop("TRITON_CACHE_DIR", None)  # the engine points Triton at the Inductor cache's triton/0
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    # Inductor points Triton at torch's own ptxas, where the wheel has one, at its first compile in a process
    result: dict = {"model": args.model, "cache": str(cache), "torch_bundled_ptxas": (torch_dir / "bin" / "ptxas").exists(), "builds": {}}
    folders: dict[str, dict[str, list[str]]] = {}
    logs: dict[str, list[dict]] = {}
    autotuned: dict[str, list[dict]] = {}
    outside = default_cache_kernels()
    for build in BUILDS:
        jit_log, autotune_log, profile = (args.out / f"{args.model}_{build}{suffix}" for suffix in ("_jit.jsonl", "_autotune.jsonl", ".prof"))
        for stale in (jit_log, autotune_log, profile):
            stale.unlink(missing_ok=True)
        logged = {JIT_LOG_ENV: str(jit_log), AUTOTUNE_LOG_ENV: str(autotune_log), **({PROFILE_ENV: str(profile)} if args.profile and build == BUILDS[-1] else {})}
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
        if profile.exists():
            (args.out / f"{args.model}_{build}_profile.txt").write_text(top_functions(profile))
    for before, after in zip(BUILDS, BUILDS[1:]):
        added = sorted(set(folders[after]) - set(folders[before]))
        result[f"added_by_{after}"] = {"folders": len(added), "kernels": compare_new_kernels(cache, added, list(folders["cold"]))}
        result[f"new_jit_specializations_{after}"] = new_specializations(logs[after], [e for b in BUILDS[: BUILDS.index(after)] for e in logs[b]])
    result["jit_requests"] = {build: len(entries) for build, entries in logs.items()}
    result["autotuned_at_first_call"] = autotuned
    path = args.out / f"{args.model}_diag.json"
    path.write_text(json.dumps(result, indent=1))
    for build in BUILDS:
        seconds = result["builds"][build]["seconds"]
        print(f"{build}: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + f"; {result['builds'][build]['inductor']}")
    print(f"torch's own ptxas: {'yes' if result['torch_bundled_ptxas'] else 'no'}")
    for build in BUILDS:
        print(f"{build}: {len(result[f'default_cache_added_by_{build}'])} kernels into ~/.triton/cache: {', '.join(sorted(set(result[f'default_cache_added_by_{build}'])))}")
    for build in BUILDS:
        timed = autotuned[build]
        states = Counter(str(entry["cache_state"]) for entry in timed)
        unsaved = sum(not entry["saved"] for entry in timed)
        print(f"{build}: {len(timed)} Inductor kernels autotuned at their first call ({sum(e['seconds'] for e in timed):.1f} s; autotune cache "
              + ", ".join(f"{state} {n}" for state, n in sorted(states.items())) + f"; {unsaved} whose choice is not saved)")
        for entry in timed:
            if entry.get("file_before") is not None:  # a choice was kept for it, and it was timed anyway
                kept = entry["file_before"]
                print(f"  {entry['kernel']}: its file held {kept} (configs hash now {entry.get('configs_hash')})")
    for after in BUILDS[1:]:
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
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        _child(sys.argv[2:])
    else:
        sys.exit(main())
