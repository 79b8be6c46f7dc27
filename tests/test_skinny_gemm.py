"""engine.skinny_gemm: the split-K kernel's arithmetic (on the CPU through Triton's
interpreter), the choice against cuBLAS, and on a GPU the kernel, the choices on
disk and the custom op inside captures and Inductor's code."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
from conftest import interpreted_worst_error
import torch
from hypothesis import given
from hypothesis import strategies as st

from opara_core.engine import shape_choices, skinny_gemm
from opara_core.engine.skinny_gemm import SkinnyConfig

ROOT = Path(__file__).resolve().parents[1]

# shapes (M, K, N) with ragged edges everywhere: rows below a tile, K not a
# multiple of BLOCK_K or of the slices, N not a multiple of BLOCK_N
INTERPRETED = textwrap.dedent(
    """
    import torch
    from opara_core.engine.skinny_gemm import SkinnyConfig, skinny_mm
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for m, k, n in [(1, 429, 40), (5, 100, 33), (16, 96, 64), (40, 300, 70), (70, 64, 20)]:
        x = torch.randn(m, k, generator=generator)
        weight = torch.randn(n, k, generator=generator)
        bias = torch.randn(n, generator=generator)
        product = x.double() @ weight.t().double()
        # split-K tiles, and a large-row tile of its own height (the interpreter runs
        # tf32x3 products as fp32 ones: the index arithmetic is what it checks)
        tall = SkinnyConfig(32, 32, 1, num_warps=8, block_m=32, precision="tf32x3", weight_layout="nk")
        for config in [SkinnyConfig(16, 32, 1), SkinnyConfig(32, 64, 4), SkinnyConfig(64, 32, 16, num_warps=2), tall]:
            # the weight stored transposed (the kernel's layout), a view of it as
            # nn.Linear stores it, and x a non-contiguous view; with and without
            # a bias (added by the kernel itself with one slice, by the sum of slices with several)
            for w in (weight.t().contiguous(), weight.t()):
                for rows in (x, x.t().contiguous().t()):
                    for b, exact in ((None, product), (bias, product + bias.double())):
                        got = skinny_mm(rows, w, config, b)
                        assert got.shape == (m, n) and got.dtype == torch.float32
                        worst = max(worst, float((got.double() - exact).abs().max() / exact.abs().max()))
    print(worst)
    """
)


def test_the_kernel_computes_the_product_for_every_tiling_and_layout():
    # Triton's interpreter runs the kernels' Python on the CPU: the same index
    # arithmetic, masks and slice sums the GPU runs
    assert interpreted_worst_error(INTERPRETED) <= 1e-6


@given(st.integers(1, 5000), st.sampled_from(skinny_gemm.CANDIDATES + skinny_gemm.LARGE_CANDIDATES))
def test_the_slices_cover_k_exactly_once(k, config):
    per, count = skinny_gemm.slices(k, config)
    assert per % config.block_k == 0 and 1 <= count <= config.split_k
    assert (count - 1) * per < k <= count * per  # no empty slice, none missing


def test_the_kernel_is_chosen_only_where_it_beats_the_faster_cublas_layout_by_the_margin():
    fast, slow = SkinnyConfig(32, 64, 4), SkinnyConfig(16, 64, 1)
    cublas, nn = skinny_gemm.CUBLAS, skinny_gemm.CUBLAS_NN
    assert skinny_gemm.best_of({cublas: 10.0, nn: 11.0, fast: 9.0, slow: 12.0}) == fast
    assert skinny_gemm.best_of({cublas: 10.0, nn: 11.0, fast: 9.6, slow: 12.0}) == cublas  # 4% is within noise
    # against the stored transpose's cuBLAS time when that is the faster layout
    assert skinny_gemm.best_of({cublas: 10.0, nn: 9.2, fast: 9.0, slow: 12.0}) == nn
    assert skinny_gemm.best_of({cublas: 10.0, nn: 9.0, fast: 8.5}) == fast
    # above MAX_ROWS only the two layouts are timed
    assert skinny_gemm.best_of({cublas: 10.0, nn: 9.9}) == nn
    assert skinny_gemm.best_of({cublas: 10.0, nn: 10.1}) == cublas
    assert skinny_gemm.best_of({cublas: 10.0}) == cublas
    # with a bias: addmm on either layout, or mm then an add
    plus, nn_plus = skinny_gemm.CUBLAS_ADD, skinny_gemm.CUBLAS_NN_ADD
    assert skinny_gemm.best_of({cublas: 31.0, nn: 37.0, plus: 22.0, nn_plus: 21.6, fast: 20.6}) == nn_plus
    assert skinny_gemm.best_of({cublas: 31.0, nn: 37.0, plus: 22.0, nn_plus: 21.6, fast: 20.0}) == fast
    assert skinny_gemm.best_of({cublas: 10.0, nn: 9.0, plus: 9.0, nn_plus: 9.5}) == nn  # a tie: the fewer kernels


def test_large_row_candidates_keep_fp32_accuracy_and_a_single_tf32_product_would_not():
    # above MAX_ROWS the candidates are tensor-core tiles; errors relative to a float64
    # product as run 14 measured them at 16 x 768 x 2304 (H100): cuBLAS 1.3e-7, tf32x3 1.7e-7;
    # one TF32 product keeps 10 mantissa bits (~1e-3 relative)
    assert skinny_gemm.candidates_for(skinny_gemm.MAX_ROWS) == skinny_gemm.CANDIDATES
    large = skinny_gemm.candidates_for(skinny_gemm.MAX_ROWS + 1)
    assert large == skinny_gemm.LARGE_CANDIDATES and {c.weight_layout for c in large} == {"kn", "nk"}
    assert all(c.precision in ("ieee", "tf32x3") for c in large)
    assert skinny_gemm.accurate_enough(1.7e-7, 1.3e-7)
    # plain fp32 tiles summing in another order: 2.4e-6 against cuBLAS's 2.4e-7 (H200, 128 x 2048 x 512)
    assert skinny_gemm.accurate_enough(2.4e-6, 2.4e-7)
    assert not skinny_gemm.accurate_enough(1e-3, 1.3e-7)
    assert not skinny_gemm.accurate_enough(1e-4, 1e-6)  # TF32's class even where cuBLAS errs most
    assert skinny_gemm.accurate_enough(8e-7, 1e-9)  # cuBLAS exact by luck: the floor


def test_on_the_cpu_the_op_is_a_matrix_product():
    op = skinny_gemm.skinny_mm_op()
    x, weight, bias = torch.randn(5, 7), torch.randn(3, 7), torch.randn(3)
    assert torch.equal(op(x, weight, weight.t().contiguous()), torch.mm(x, weight.t()))
    assert torch.equal(op(x, weight, weight.t().contiguous(), bias), torch.addmm(bias, x, weight.t()))


def test_linear_layers_swapped_share_their_parameters_and_leave_the_module_as_it_was():
    """`with_skinny_linears`: every fp32 nn.Linear, at any depth, becomes a
    SkinnyLinear of the same parameters (its transposed weight a buffer), a
    float64 one and other modules stay; the original tree is untouched and
    answers as the swapped one."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 4, bias=False))
    module = torch.nn.ModuleDict({"block": inner, "norm": torch.nn.LayerNorm(4), "wide": torch.nn.Linear(4, 4).double()})
    swapped = skinny_gemm.with_skinny_linears(module)
    assert isinstance(module["block"][0], torch.nn.Linear) and isinstance(module["block"][2], torch.nn.Linear)
    first, last = swapped["block"][0], swapped["block"][2]
    assert isinstance(first, skinny_gemm.SkinnyLinear) and isinstance(last, skinny_gemm.SkinnyLinear)
    assert first.weight is inner[0].weight and first.bias is inner[0].bias and last.bias is None
    assert torch.equal(first.weight_t, inner[0].weight.t())
    assert swapped["norm"] is module["norm"] and swapped["wide"] is module["wide"]
    names = {name for name, _ in swapped.named_buffers()}
    assert names == {"block.0.weight_t", "block.2.weight_t"}
    x = torch.randn(2, 3, 6)  # leading dimensions are kept
    with torch.inference_mode():
        assert torch.allclose(swapped["block"](x), inner(x), atol=1e-6)


# ---- on a GPU ------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(skinny_gemm, "_choices", {})
    return tmp_path


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, k, n",
    [(1, 429, 400), (16, 768, 2304), (16, 3072, 768), (32, 512, 2048), (100, 768, 768), (128, 2048, 512), (300, 512, 2048), (1024, 768, 3072), (4096, 3072, 768)],
)
def test_every_candidate_equals_the_float64_product_on_the_gpu(m, k, n):
    x = torch.randn(m, k, device="cuda")
    weight = torch.randn(n, k, device="cuda") / k**0.5
    stored = {"kn": weight.t().contiguous(), "nk": weight.t()}
    exact = x.double() @ weight.t().double()
    cublas = shape_choices.relative_error(torch.mm(x, weight.t()), exact)
    candidates = skinny_gemm.candidates_for(m)
    errors = {c: shape_choices.relative_error(skinny_gemm.skinny_mm(x, stored[c.weight_layout], c), exact) for c in candidates}
    bias = torch.randn(n, device="cuda")
    with_bias = exact + bias.double()
    for c in candidates:  # the bias added by the kernel (one slice) or by the sum of slices
        errors[c, "bias"] = shape_choices.relative_error(skinny_gemm.skinny_mm(x, stored[c.weight_layout], c, bias), with_bias)
    # fp32 sums of up to 3,072 products: cuBLAS's own error is 1e-7 to 1e-6; tf32x3 products
    # (above MAX_ROWS) must stay in that class, which the chooser's accuracy rule also demands
    assert max(errors.values()) <= max(10 * cublas, 2e-6), (errors, cublas)
    assert all(skinny_gemm.accurate_enough(e, cublas) for c, e in errors.items() if c in candidates), (errors, cublas)


@pytest.mark.gpu
def test_a_candidate_less_accurate_than_cublas_is_not_timed():
    # one TF32 product per fp32 one (~1e-3) is dropped; three (tf32x3) keep fp32's accuracy and are timed
    tf32x3 = skinny_gemm.LARGE_CANDIDATES[0]
    tf32 = dataclasses.replace(tf32x3, precision="tf32")
    timings = skinny_gemm.time_shape(1024, 768, 768, torch.device("cuda"), candidates=(tf32, tf32x3))
    assert tf32 not in timings and tf32x3 in timings and skinny_gemm.CUBLAS in timings


@pytest.mark.gpu
def test_choices_are_timed_once_and_kept_on_disk(cache):
    device = torch.device("cuda")
    choices = skinny_gemm.choices_for(device)
    chosen = choices.choose(16, 768, 768)
    above = choices.choose(4096, 3072, 768)  # BERT's feed-forward down-projection at batch 32: a layout or a tensor-core tile
    assert above in (skinny_gemm.CUBLAS, skinny_gemm.CUBLAS_NN) + skinny_gemm.LARGE_CANDIDATES
    biased = choices.choose(4096, 768, 2304, bias=True)  # BERT's q/k/v at batch 32: timed with its bias
    assert biased in skinny_gemm.LIBRARY + skinny_gemm.LARGE_CANDIDATES
    assert choices.path.is_file() and choices.path.is_relative_to(cache)
    again = skinny_gemm.Choices(device)  # another process: reads the file, times nothing
    assert again.known == {"16,768,768": chosen, "4096,3072,768": above, "4096,768,2304+bias": biased}


@pytest.mark.gpu
@pytest.mark.parametrize("choice", skinny_gemm.LIBRARY)
@pytest.mark.parametrize("bias", [False, True])
def test_every_cublas_way_answers_as_the_linear_layer(cache, choice, bias):
    layer = torch.nn.Linear(3072, 768, bias=bias).cuda()
    x = torch.randn(300, 3072, device="cuda")
    skinny_gemm.choices_for(x.device).known["300,3072,768" + ("+bias" if bias else "")] = choice  # as if timed so
    got = skinny_gemm.linear_mm(x, layer.weight, layer.weight.t().contiguous(), layer.bias)
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("choice", skinny_gemm.LARGE_CANDIDATES[:2])  # one tile on either copy of the weight
@pytest.mark.parametrize("bias", [False, True])
def test_a_large_row_kernel_choice_answers_as_the_linear_layer(cache, choice, bias):
    layer = torch.nn.Linear(768, 3072, bias=bias).cuda()
    x = torch.randn(1000, 768, device="cuda")  # rows not a multiple of any tile
    skinny_gemm.choices_for(x.device).known["1000,768,3072" + ("+bias" if bias else "")] = choice  # as if timed so
    got = skinny_gemm.linear_mm(x, layer.weight, layer.weight.t().contiguous(), layer.bias)
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_a_shape_first_seen_inside_a_capture_runs_cublas(cache):
    op = skinny_gemm.skinny_mm_op()
    x = torch.randn(24, 512, device="cuda")
    weight = torch.randn(640, 512, device="cuda")
    weight_t = weight.t().contiguous()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, weight, weight_t)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.mm(x, weight.t()))
    assert skinny_gemm.choices_for(x.device).known == {}  # nothing timed, nothing remembered


@pytest.mark.gpu
def test_the_op_inside_inductor_code_and_a_cuda_graph_equals_the_linear_layer(cache):
    op = skinny_gemm.skinny_mm_op()
    layer = torch.nn.Linear(768, 3072).cuda()
    weight_t = layer.weight.t().contiguous()

    def forward(x):
        return torch.nn.functional.gelu(op(x, layer.weight, weight_t) + layer.bias)

    x = torch.randn(16, 768, device="cuda")
    with torch.no_grad():
        compiled = torch.compile(forward)
        compiled(x)  # outside a capture: times the shape
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(x)
        graph.replay()
        torch.cuda.synchronize()
        exact = torch.nn.functional.gelu(x.double() @ layer.weight.double().t() + layer.bias.double())
    assert "16,768,3072" in skinny_gemm.choices_for(x.device).known
    assert float((out.double() - exact).abs().max() / exact.abs().max()) <= 1e-5
