"""engine.depthwise_conv: the kernel's arithmetic on the CPU through Triton's
interpreter (the eager convolution is the oracle), and on a GPU every candidate
against a float64 convolution at NASNet's shapes and the timing against cuDNN."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import interpreted_output
import torch

from opara_core.engine import depthwise_conv
from opara_core.engine.depthwise_conv import DepthwiseConfig

ROOT = Path(__file__).resolve().parents[1]

# NASNet's filter sizes and strides, with ragged edges: channels not a multiple of a
# tile, pixels over the batch not a multiple of BLOCK_P, padding on and off, dilation;
# in each dtype its arguments name: every tiling in float32, one a case in half precision
INTERPRETED = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F
    from opara_core.engine.depthwise_conv import DepthwiseConfig, depthwise_conv2d
    cases = [  # (N, C, H, W), kernel, stride, padding, dilation
        ((2, 42, 13, 11), 5, 2, 2, 1), ((1, 21, 9, 9), 3, 1, 1, 1), ((3, 10, 8, 7), 7, 1, 3, 1),
        ((2, 17, 10, 12), 3, 2, 0, 1), ((1, 12, 11, 11), 3, 1, 2, 2), ((2, 33, 6, 6), (3, 5), (1, 2), (1, 2), 1),
    ]
    # one-column tiles, and groups of 4 and 2 neighbouring outputs (rows of 7, 11 and 12 outputs: ragged groups)
    configs = (DepthwiseConfig(16, 16), DepthwiseConfig(8, 32, 2), DepthwiseConfig(32, 8), DepthwiseConfig(8, 16, 4, 4), DepthwiseConfig(16, 8, 2, 2))
    for name in sys.argv[1:]:
        dtype, generator, worst = getattr(torch, name), torch.Generator().manual_seed(0), 0.0
        for i, (shape, k, stride, padding, dilation) in enumerate(cases):
            kh, kw = (k, k) if isinstance(k, int) else k
            x = torch.randn(*shape, generator=generator).to(dtype)
            weight = torch.randn(shape[1], 1, kh, kw, generator=generator).to(dtype)
            # every other case with a bias, and with a weight view of other strides
            b = torch.randn(shape[1], generator=generator).to(dtype) if i % 2 else None
            w = weight.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1) if i % 2 else weight
            exact = F.conv2d(x.double(), weight.double(), None if b is None else b.double(), stride, padding, dilation, groups=shape[1])
            channels_last = x.contiguous(memory_format=torch.channels_last)
            # fp32: channels-last (fused lanes' layout) with every tiling, contiguous with one; half precision
            # (the same index arithmetic, other loads and stores): channels-last with one tiling per case, in turn
            runs = [(channels_last, c) for c in configs] + [(x, configs[i % len(configs)])] if name == "float32" else [(channels_last, configs[i % len(configs)])]
            for rows, config in runs:
                got = depthwise_conv2d(rows, w, b, stride, padding, dilation, config)
                assert got.shape == exact.shape, (got.shape, exact.shape)
                assert got.is_contiguous(memory_format=torch.channels_last) and got.dtype == dtype
                worst = max(worst, float((got.double() - exact).abs().max() / exact.abs().max()))
        print(name, worst)
    """
)


@pytest.fixture(scope="module")
def worst_errors() -> dict[str, float]:
    """Each dtype's worst error of the interpreted kernel against float64, one process for all three (an
    interpreter process costs seconds of imports before its first kernel)."""
    lines = interpreted_output(INTERPRETED, "float32", "float16", "bfloat16")
    return {name: float(worst) for name, worst in (line.split() for line in lines[-3:])}


def test_the_kernel_computes_the_depthwise_convolution_for_every_tiling_and_layout(worst_errors):
    # Triton's interpreter runs the kernel on the CPU: its index arithmetic and masks
    assert worst_errors["float32"] <= 1e-6


@pytest.mark.parametrize("dtype, bound", [("float16", 2**-11), ("bfloat16", 2**-7)])
def test_in_half_precision_it_sums_in_fp32_and_rounds_once(worst_errors, dtype, bound):
    # exact: the float64 convolution of the same half-precision values, so only the output's rounding is left:
    # at most half a unit in the last place of fp16 (2^-11 of an entry); bf16's is 2^-8 on a GPU, but the
    # interpreter truncates to bf16 (a whole unit, 2^-7). Summing in the half dtype itself would err more
    # (NASNet's 7x7 filters: 49 roundings).
    assert worst_errors[dtype] <= bound


def test_shapes_it_does_not_take_are_refused_by_name():
    x = torch.randn(1, 8, 5, 5)
    with pytest.raises(ValueError, match=r"weight \(8, 2, 3, 3\) is not \[8, 1, KH, KW\]"):
        depthwise_conv.depthwise_conv2d(x, torch.randn(8, 2, 3, 3), None, 1, 1, 1, DepthwiseConfig(16, 16))
    with pytest.raises(TypeError, match="takes float32, bfloat16 or float16 tensors of one dtype, got torch.float64, torch.float64"):
        depthwise_conv.depthwise_conv2d(x.double(), torch.randn(8, 1, 3, 3).double(), None, 1, 1, 1, DepthwiseConfig(16, 16))
    with pytest.raises(TypeError, match="got torch.bfloat16, torch.float32"):  # a mixed pair: the kernel reads one dtype
        depthwise_conv.depthwise_conv2d(x.bfloat16(), torch.randn(8, 1, 3, 3), None, 1, 1, 1, DepthwiseConfig(16, 16))
    with pytest.raises(ValueError, match=r"bias \(4,\) is not \[8\]"):
        depthwise_conv.depthwise_conv2d(x, torch.randn(8, 1, 3, 3), torch.randn(4), 1, 1, 1, DepthwiseConfig(16, 16))


def test_vector_width_is_what_the_channels_and_every_pixel_stride_allow():
    def width(shape, channels_last=True, view=None):
        x = torch.empty(shape).contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        x = x if view is None else view(x)
        out = torch.empty(x.shape).contiguous(memory_format=torch.channels_last)
        return depthwise_conv.vector_width(x.shape[1], x, out)

    assert width((2, 168, 42, 42)) == 4  # NASNet's: 168 is no multiple of 16, so Triton alone would not know
    assert width((2, 42, 83, 83)) == 2
    assert width((2, 21, 9, 9)) == 1
    assert width((2, 168, 42, 42), channels_last=False) == 1  # NCHW: the pixel stride is 1
    assert width((2, 168, 42, 42), view=lambda x: x[:, :, :, 1:]) == 4  # strides keep 168's multiple; only the base moves
    assert width((2, 168, 42, 42), view=lambda x: x[:, :162]) == 2  # 162 channels of a 168-channel row


def test_used_columns_are_the_input_columns_some_output_of_a_group_reads():
    # output k of a group reads input columns k * stride + t * dilation for taps t
    assert depthwise_conv.used_columns(1, 3, 1, 1) == 0b111
    assert depthwise_conv.used_columns(1, 3, 1, 2) == 0b10101  # dilated: every other column
    assert depthwise_conv.used_columns(4, 5, 1, 1) == 0b11111111  # 4 + 5 - 1 columns, all read
    assert depthwise_conv.used_columns(2, 3, 2, 1) == 0b11111  # 0-2 and 2-4
    assert depthwise_conv.used_columns(2, 1, 3, 1) == 0b1001  # a 1-wide filter with stride 3 skips two


def test_a_group_of_columns_the_kernel_has_no_form_for_is_refused_by_name():
    x = torch.randn(1, 8, 5, 5)
    with pytest.raises(ValueError, match="3 columns per group; the kernel takes 1, 2 or 4"):
        depthwise_conv.depthwise_conv2d(x, torch.randn(8, 1, 3, 3), None, 1, 1, 1, DepthwiseConfig(16, 16, 4, 3))


def test_output_size_is_the_convolutions():
    for size, k, s, p, d in [(21, 3, 1, 1, 1), (169, 5, 2, 2, 1), (171, 7, 2, 0, 1), (11, 3, 1, 2, 2), (8, 3, 2, 1, 1)]:
        x = torch.zeros(1, 1, size, size)
        want = torch.nn.functional.conv2d(x, torch.zeros(1, 1, k, k), None, s, p, d).shape[-1]
        assert depthwise_conv.output_size(size, k, s, p, d) == want


# NASNet-A large's most frequent depthwise shapes (C, H, W), kernel, stride, padding, and its large-image ones
NASNET_SHAPES = [((336, 21, 21), 3, 1, 1), ((672, 11, 11), 5, 1, 2), ((168, 42, 42), 5, 1, 2), ((42, 83, 83), 7, 1, 3), ((96, 171, 171), 7, 2, 0), ((84, 87, 87), 5, 2, 0)]


# the float64 convolution of the same values: fp32 sums; in half precision the output's one rounding (half a unit)
BOUNDS = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(BOUNDS))
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_every_candidate_equals_the_float64_convolution_on_the_gpu(batch, dtype):
    for (c, h, w), k, stride, padding in NASNET_SHAPES:
        x = torch.randn(batch, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        weight = torch.randn(c, 1, k, k, device="cuda", dtype=dtype)
        bias = torch.randn(c, device="cuda", dtype=dtype)
        exact = depthwise_conv.cudnn_conv2d(x.double(), weight.double(), bias.double(), stride, padding, 1)
        for config in depthwise_conv.CANDIDATES:
            got = depthwise_conv.depthwise_conv2d(x, weight, bias, stride, padding, 1, config)
            assert got.dtype == dtype and depthwise_conv.relative_error(got, exact) <= BOUNDS[dtype], (batch, c, h, k, stride, config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_time_shape_times_cudnn_and_the_candidates_that_answer_right(dtype):
    x = torch.randn(8, 336, 21, 21, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(336, 1, 3, 3, device="cuda", dtype=dtype)
    timings, errors = depthwise_conv.time_shape(x, weight, None, 1, 1, candidates=(DepthwiseConfig(32, 64),))
    assert set(timings) == {depthwise_conv.CUDNN, DepthwiseConfig(32, 64)} and all(v > 0 for v in timings.values())
    assert errors[depthwise_conv.CUDNN] <= BOUNDS[dtype] and errors[DepthwiseConfig(32, 64)] <= BOUNDS[dtype]


def test_on_the_cpu_the_op_is_the_convolution_and_its_fake_output_matches_the_real_one():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = depthwise_conv.depthwise_conv_op()
    weight, bias = torch.randn(12, 1, 5, 5), torch.randn(12)
    for x in (torch.randn(2, 12, 9, 11), torch.randn(2, 12, 9, 11).contiguous(memory_format=torch.channels_last)):
        for stride, padding in (([1, 1], [2, 2]), ([2, 2], [0, 0]), ([2, 1], [1, 2])):
            got = op(x, weight, bias, stride, padding, [1, 1])
            want = torch.nn.functional.conv2d(x, weight, bias, stride, padding, 1, groups=12)
            torch.testing.assert_close(got, want)
            with FakeTensorMode() as mode:
                fake = op(mode.from_tensor(x), mode.from_tensor(weight), mode.from_tensor(bias), stride, padding, [1, 1])
            # Inductor lays out what follows by the fake output: the real one must agree
            assert fake.shape == got.shape and fake.stride() == got.stride(), (fake.stride(), got.stride())


def test_the_convolutions_fake_value_stands_for_the_ops_only_where_they_agree():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = depthwise_conv.depthwise_conv_op()
    mode = FakeTensorMode()
    weight = mode.from_tensor(torch.randn(12, 1, 3, 3))
    checked = set()
    for x in (torch.randn(2, 12, 9, 11), torch.randn(2, 12, 9, 11).contiguous(memory_format=torch.channels_last), torch.randn(1, 12, 3, 3)):
        x = mode.from_tensor(x)
        for stride, padding in (([1, 1], [1, 1]), ([2, 2], [0, 0])):
            with mode:
                conv = torch.nn.functional.conv2d(x, weight, None, stride, padding, 1, groups=12)
                ops = op(x, weight, None, stride, padding, [1, 1])
                other = conv.contiguous(memory_format=torch.channels_last) if conv.is_contiguous() else conv.contiguous()
            for out in (conv, other):
                agree = out.shape == ops.shape and out.stride() == ops.stride()
                assert depthwise_conv.fake_output_matches(out, x) == agree, (x.stride(), out.stride(), ops.stride())
                checked.add(agree)
            with mode:
                assert not depthwise_conv.fake_output_matches(ops.double(), x)  # another dtype
    assert checked == {True, False}


def test_the_kernel_is_chosen_unless_cudnn_is_much_faster():
    fast, slow = DepthwiseConfig(32, 64), DepthwiseConfig(64, 32)
    cudnn = depthwise_conv.CUDNN
    assert depthwise_conv.best_of({cudnn: 10.0, fast: 9.0, slow: 12.0}) == fast  # the fastest tile
    assert depthwise_conv.best_of({cudnn: 10.0, fast: 12.0, slow: 14.0}) == fast  # slower, but cuDNN plans every process
    assert depthwise_conv.best_of({cudnn: 10.0, fast: 15.0}) == fast  # at the limit
    assert depthwise_conv.best_of({cudnn: 10.0, fast: 16.0}) == cudnn  # 1.6x: not worth the planning saved
    assert depthwise_conv.best_of({cudnn: 10.0}) == cudnn  # no candidate answered right


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])  # of the largest output: bf16 rounds both ways apart
def test_the_pass_routes_depthwise_convolutions_through_the_op_and_answers_as_eager(tmp_path, monkeypatch, dtype, tolerance):
    from opara_core.engine import fusion
    from opara_core.engine.trace import trace

    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(depthwise_conv, "_choices", {})
    module = torch.nn.Sequential(
        torch.nn.ReLU(), torch.nn.Conv2d(96, 96, 5, padding=2, groups=96, bias=False), torch.nn.Conv2d(96, 64, 1),
        torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, stride=2, groups=64), torch.nn.Conv2d(64, 32, 3),  # the last: dense, left alone
    ).cuda().eval().to(dtype)
    x = torch.randn(8, 96, 21, 21, device="cuda", dtype=dtype)
    graph = trace(module, (x,))
    fused, report = fusion.fuse_graph(graph, torch.device("cuda"), passes=("depthwise_convs",))
    assert report.rewrites["depthwise_convs"] == 2
    targets = [n.target for n in fused.module.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.opara.depthwise_conv2d.default) == 2
    with torch.no_grad():
        assert depthwise_conv.relative_error(fused.module(x), module(x).double()) <= tolerance
    # and inside Inductor's code replayed from a CUDA graph, channels-last as fused lanes run it
    compiled = torch.compile(fused.module, mode="reduce-overhead")
    xl = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(3):
            got = compiled(xl)
        assert depthwise_conv.relative_error(got, module(xl).double()) <= tolerance
    # only channels-last calls are timed: Inductor's code handed the op the layout fused lanes run
    timed = depthwise_conv.choices_for(x.device).known
    assert timed and all("channels_last" in shape for shape in timed), timed
