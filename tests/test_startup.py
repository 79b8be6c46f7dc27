"""The startup log: tritonserver's output in, progress lines out.

The Triton lines below are copied from a real tritonserver 2.51 start on the
CPU machine (`make serve`, 2026-11-23); tests/test_launcher.py checks the same
lines come out of a real `make serve`.
"""

from __future__ import annotations

import io
import re

from hypothesis import given
from hypothesis import strategies as st

from opara_core.serving.startup import MODEL_LINE, NO_GPU_NOTE, READY, StartupLog, model_log_format, ready_line

TRITON_CPU_START = [
    'W1123 06:28:41.613813 6863 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned memory '
    'pool will not be available: CUDA driver version is insufficient for CUDA runtime version"',
    'I1123 06:28:41.613893 6863 cuda_memory_manager.cc:117] "CUDA memory pool disabled"',
    'E1123 06:28:41.613987 6863 server.cc:241] "CudaDriverHelper has not been initialized."',
    'I1123 06:28:41.629791 6863 model_lifecycle.cc:472] "loading: deepfm:1"',
    'I1123 06:28:41.629898 6863 model_lifecycle.cc:472] "loading: bert:1"',
    'I1123 06:28:54.251585 6863 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize: bert_0_0 (CPU device 0)"',
]
DEEPFM_READY = "INFO opara_core.serving.triton_backend: " + ready_line("deepfm", "cpu", 19.42, "eager")
PINNED_FALLBACK = (
    'W1123 06:29:13.789104 6863 pinned_memory_manager.cc:170] "failed to allocate pinned system memory: no pinned memory '
    'pool, falling back to non-pinned system memory"'
)
DEEPFM_LOADED = 'I1123 06:29:13.927683 6863 model_lifecycle.cc:839] "successfully loaded \'deepfm\'"'
BERT_FAILED = (
    "E1123 06:29:57.823643 6863 model_lifecycle.cc:642] \"failed to load 'bert' version 1: Internal: "
    'TritonModelException: model bert: unknown parameters [\'polcy\']"'
)


def fed(lines: list[str], expected=("bert", "deepfm"), hide=True) -> list[str]:
    out = io.StringIO()
    log = StartupLog(out, expected, hide_no_gpu_noise=hide)
    for line in lines:
        log.feed(line + "\n")
    log.announce_ready("HTTP http://127.0.0.1:8000")
    return out.getvalue().splitlines()


def test_a_loaded_model_gets_one_line_with_what_it_built():
    out = fed([*TRITON_CPU_START, DEEPFM_READY, DEEPFM_LOADED])
    progress = [line for line in out if line.startswith("loaded ")]
    assert len(progress) == 1
    assert re.fullmatch(r"loaded 1/2: deepfm \(eager on cpu, 19\.4 s to initialize; \d+ s after start\)", progress[0])
    assert out.index(progress[0]) == out.index(DEEPFM_LOADED) + 1
    assert re.fullmatch(r"ready after \d+ s: 1 of 2 models loaded; HTTP http://127.0.0.1:8000", out[-1])


def test_every_line_passes_but_the_cpu_noise_which_becomes_one_note():
    lines = [*TRITON_CPU_START, DEEPFM_READY, PINNED_FALLBACK, DEEPFM_LOADED]
    out = fed(lines)
    assert out.count(NO_GPU_NOTE) == 1
    assert not any("CudaDriverHelper" in line and line != NO_GPU_NOTE for line in out)
    assert not any("pinned memory pool" in line for line in out)
    kept = [line for line in lines if line not in (*TRITON_CPU_START[:3], PINNED_FALLBACK)]
    assert [line for line in out if line in lines] == kept


def test_on_a_gpu_host_the_cuda_lines_stay():
    out = fed(TRITON_CPU_START, hide=False)
    assert NO_GPU_NOTE not in out
    assert out[:6] == TRITON_CPU_START


def test_a_failed_model_is_counted_and_named():
    out = fed([DEEPFM_READY, DEEPFM_LOADED, BERT_FAILED])
    assert "failed to load 2/2: bert (Internal: TritonModelException: model bert: unknown parameters ['polcy']; " in out[-2]
    assert "1 of 2 models loaded, 1 failed (bert)" in out[-1]


def test_without_a_known_total_the_count_stands_alone():
    out = fed([DEEPFM_READY, DEEPFM_LOADED], expected=None)
    assert any(line.startswith("loaded 1: deepfm (eager on cpu") for line in out)
    assert ": 1 models loaded;" in out[-1]


def test_a_model_without_a_ready_line_still_counts():
    out = fed([DEEPFM_LOADED])
    assert any(re.fullmatch(r"loaded 1/2: deepfm \(\d+ s after start\)", line) for line in out)


def test_a_restart_counts_again():
    out = io.StringIO()
    log = StartupLog(out, ["deepfm"], hide_no_gpu_noise=True)
    for _ in range(2):
        log.restart()
        log.feed(DEEPFM_LOADED)
    assert [line.split(":")[0] for line in out.getvalue().splitlines() if line.startswith("loaded")] == ["loaded 1/1"] * 2


text = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=40)


@given(
    model=st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True),
    device=st.sampled_from(["cpu", "cuda:0", "cuda:7"]),
    seconds=st.floats(0, 1e5),
    built=text.filter(lambda t: "|" not in t and t == t.strip()),
    details=st.lists(text, max_size=4),
)
def test_the_ready_line_reads_back(model, device, seconds, built, details):
    match = READY.search("INFO opara_core.serving.triton_backend: " + ready_line(model, device, seconds, built, details))
    assert match is not None
    assert (match["model"], match["device"], match["built"]) == (model, device, built)
    assert float(match["seconds"]) == round(seconds, 1) or abs(float(match["seconds"]) - seconds) <= 0.05


def test_with_a_full_log_the_terminal_gets_what_a_person_reads_and_the_file_everything():
    terminal, whole = io.StringIO(), io.StringIO()
    log = StartupLog(terminal, ["bert", "deepfm"], hide_no_gpu_noise=True, full_log=whole)
    warning = "WARNING [deepfm] opara_core.engine.build: multi-stream graph failed, falling back to a sequential graph: x"
    chatter = "INFO [deepfm] opara_core.engine.build: bucket 1: capturing and timing 6 candidates"
    # seen on an H200 (2026-12-01): torch's warnings, each with its source line
    torch_warning = ["/usr/lib/python3.12/copyreg.py:99: FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated", "  return cls.__new__(cls, *args)"]
    for line in [*TRITON_CPU_START, *torch_warning, chatter, "", warning, "   ", DEEPFM_READY, DEEPFM_LOADED, BERT_FAILED]:
        log.feed(line + "\n")
    log.announce_ready("HTTP http://127.0.0.1:8000")
    shown, kept = terminal.getvalue().splitlines(), whole.getvalue().splitlines()
    assert all(line.strip() for line in shown), shown  # Triton's blank lines stay in the file
    assert chatter not in shown and TRITON_CPU_START[3] not in shown and DEEPFM_LOADED not in shown
    assert not set(torch_warning) & set(shown) and all(any(k.endswith(w) for k in kept) for w in torch_warning)
    assert warning in shown and BERT_FAILED in shown  # warnings and errors reach the terminal
    assert [line.split(":")[0] for line in shown if line.startswith(("loaded", "failed"))] == ["loaded 1/2", "failed to load 2/2"]
    assert shown[-1].startswith("ready after ")
    stamps = [re.fullmatch(r" *(\d+\.\d\d) (.*)", line) for line in kept]
    assert all(stamps), kept  # each line after the seconds since the start
    assert [float(m[1]) for m in stamps] == sorted(float(m[1]) for m in stamps)
    for line in [*TRITON_CPU_START, chatter, warning, DEEPFM_LOADED, BERT_FAILED, shown[-1]]:
        assert line in [m[2] for m in stamps]  # the file has every line, the launcher's own too


def test_a_pending_model_is_named_with_what_it_last_said():
    log = StartupLog(io.StringIO(), ["bert", "deepfm", "nasnet"], hide_no_gpu_noise=True)
    log.feed('I1123 06:28:41.629791 6863 model_lifecycle.cc:472] "loading: nasnet:1"\n')
    log.feed("INFO [bert] opara_core.engine.build: profiling the kernels of a graph of 312 ops\n")
    log.feed(DEEPFM_READY.replace("INFO ", "INFO [deepfm] ") + "\n")
    log.feed(DEEPFM_LOADED + "\n")
    pending = log.pending()
    assert [p.split(":")[0] for p in pending] == ["bert", "nasnet"]
    assert re.fullmatch(r"bert: profiling the kernels of a graph of 312 ops \(\d+ s ago\)", pending[0])
    assert re.fullmatch(r"nasnet: loading \(\d+ s ago\)", pending[1])
    out = io.StringIO()
    log.out = out
    log.announce_waiting()
    assert re.fullmatch(r"still loading after \d+ s \(1 of 3 loaded\): bert: profiling .*; nasnet: loading \(\d+ s ago\)\n", out.getvalue())


def test_a_model_not_started_yet_is_queued_and_nothing_is_said_once_all_are_in():
    log = StartupLog(io.StringIO(), ["deepfm", "t5"], hide_no_gpu_noise=True)
    assert log.pending()[1].startswith("t5: queued")
    log.feed(DEEPFM_LOADED + "\n")
    log.feed(BERT_FAILED.replace("'bert'", "'t5'") + "\n")
    assert log.pending() == []
    out = io.StringIO()
    log.out = out
    log.announce_waiting()
    assert out.getvalue() == ""


@given(model=st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True), message=text)
def test_a_model_line_reads_back(model, message):
    import logging

    record = logging.LogRecord("opara_core.engine.build", logging.INFO, __file__, 1, message, None, None)
    line = logging.Formatter(model_log_format(model)).format(record)
    match = MODEL_LINE.match(line)
    assert match is not None and match["model"] == model and match["message"] == message
