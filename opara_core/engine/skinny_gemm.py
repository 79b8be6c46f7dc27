"""fp32 GEMMs (`x @ w.T`) as a Triton kernel where it was measured faster
than cuBLAS at that shape, as the custom op `opara::skinny_mm`: a split-K
kernel for few rows (M <= 128), tensor-core tiles with fp32 accuracy above.

Why: at small batch the transformers' linear layers are GEMMs of 16-128 rows
against weights of 1-9 MB. cuBLAS's fp32 kernels for them read the weights at
a fraction of the H100's bandwidth (BERT's 16-token cell: 706 of 876 us in
GEMMs, 0.48 TB/s; docs/benchmarks.md, variable lengths run 7). Splitting K as
well as N puts every SM to work; the partial sums are added in a fixed order
by a second kernel, so results do not vary from run to run. Products and sums
stay fp32 ("ieee": no TF32). The kernel reads the weight stored transposed,
[K, N]: with the weight as nn.Linear stores it, it was no faster than cuBLAS
(the probe scripts/skinny_gemm.py, since removed, H100, 2026-11-26).

Above MAX_ROWS the GEMMs fill the GPU and cuBLAS's fp32 kernels are compute
bound without tensor cores (BERT and T5 at batch 8 and 32: 89-96% of
torch.compile's replay in them, H200, docs/benchmarks.md run 17). There the
candidates are larger tiles whose products run as "tf32x3": each fp32 operand
split into a TF32 part and a TF32 remainder, three tensor-core products summed
in fp32 (Triton's `input_precision`), which keeps fp32's accuracy where one
TF32 product would not (run 14's sweep, 16 rows: 1.7e-7 against cuBLAS's
1.3e-7, relative to a float64 product). Every kernel candidate's answer at the
shape is checked against a float64 product before it is timed, and dropped if
its error exceeds ACCURACY_SLACK times cuBLAS's own.

Which is faster depends on the shape and the GPU, so the first call at each
(M, K, N) times cuBLAS and the kernel's candidates on copies of a weight of
that size that together miss L2 (as a model's layers, each read once per call,
do; one weight timed again and again stays in L2 and misleads) and keeps the
winner: in this process, and on disk under $OPARA_CACHE_DIR/skinny (one file
per GPU and software), so later builds do not time again. A call inside a CUDA
graph capture cannot time: an unknown shape there runs cuBLAS (builds warm up
before they capture, so in practice every shape is known by then).

The op takes the weight both ways, as nn.Linear stores it and transposed, so
that where cuBLAS wins it runs the faster of `torch.mm(x, w.t())` (what the
graph ran before: cuBLAS's `tn` kernels) and `torch.mm(x, w_t)` on the stored
transpose (its `nn` kernels, which torch.compile's frozen weights get), timed
at every row count, above MAX_ROWS too (BERT's feed-forward down-projection at
4,096 rows: `tn` 4,569 against `nn` 4,147 us per replay on an H200,
docs/benchmarks.md run 17; the price: the layer's weight twice in memory), and
optionally a bias, where no pointwise work follows that could take the add
(`fusion.skinny_linears`: the GEMMs Inductor would keep as `addmm`): the kernel adds it as it writes, or cuBLAS runs `addmm` or
`mm` then an add, whichever was measured faster at that shape with a bias
(cuBLASLt's fp32 `addmm` lost at 128 and 1,024 rows; at 4,096 it tied for
BERT's q/k/v and lost for its down-projection: H200, docs/benchmarks.md run 18).
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import asdict, dataclass

import torch

from opara_core.engine.shape_choices import ShapeChoices, per_call_ms, relative_error, triton_failures

log = logging.getLogger(__name__)

KERNEL_VERSION = 6  # bump when the kernels or the choices change: the choices on disk are then timed again
MAX_ROWS = 128  # up to this many rows the split-K CANDIDATES, above it LARGE_CANDIDATES (split-K tied or lost at 128 on an H100)
# A kernel candidate's error against a float64 product: at most ACCURACY_SLACK times
# cuBLAS's fp32 error, or ACCURACY_FLOOR where cuBLAS's own happens to be tiny. Plain
# fp32 tiles that sum in another order erred up to 10x cuBLAS (2.4e-6 against 2.4e-7 at
# 128 x 2048 x 512, H200, 2026-11-28), tf32x3 ones 0.2-1x; one TF32 product errs ~1e-3.
ACCURACY_SLACK = 16.0
ACCURACY_FLOOR = 1e-5
CUBLAS, CUBLAS_NN = "cublas", "cublas_nn"  # torch.mm(x, w.t()); torch.mm(x, w_t) on the stored transpose
# with a bias, those two are `torch.addmm` (cuBLASLt adds it in its epilogue), and
# these `torch.mm` then an add in place: cuBLASLt's fp32 kernels with a bias are
# slower at few rows (128 x 768 x 2304 on an H200: 31-37 us against 19 us, 2026-11-27)
CUBLAS_ADD, CUBLAS_NN_ADD = "cublas+add", "cublas_nn+add"
LIBRARY = (CUBLAS, CUBLAS_NN, CUBLAS_ADD, CUBLAS_NN_ADD)
MIN_GAIN = 0.95  # the kernel must take at most this fraction of cuBLAS's time to be chosen
SUM_BLOCK = 1024
L2_MISS_BYTES = 128 * 2**20  # weight copies per timing: together at least this (an H100's L2 holds 50 MB)


@dataclass(frozen=True)
class SkinnyConfig:
    """A kernel configuration: tile widths, K slices, warps, pipeline stages;
    the tile's height (0: from the row count, `block_m`), the products'
    precision (Triton's `input_precision`: "ieee" fp32, "tf32x3" three TF32
    products), and which copy of the weight it reads: "kn" the stored
    transpose (N contiguous), "nk" the weight as nn.Linear stores it (K
    contiguous, the layout TF32 tensor-core products read directly)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 0
    precision: str = "ieee"
    weight_layout: str = "kn"


# the configurations timed at each shape (a cold build compiles each once per tile
# height): around the winners of sweeps of 50-90 per shape over BERT's and T5's
# shapes at 16-32 rows (the probe scripts/skinny_gemm.py, since removed, H100, 2026-11-26)
CANDIDATES: tuple[SkinnyConfig, ...] = (
    *(SkinnyConfig(n, 64, s) for n in (16, 32, 64) for s in (1, 2, 4, 8)),
    SkinnyConfig(32, 64, 4, num_warps=2),
    SkinnyConfig(32, 64, 8, num_warps=2),
)


# above MAX_ROWS: tensor-core tiles, fp32 accuracy through three TF32 products, on
# either copy of the weight; the chooser keeps one only where it beats cuBLAS (on an
# H200 at 16 of BERT's and T5's 18 shapes at 1,024 and 4,096 rows, 1.14-1.70x,
# docs/benchmarks.md run 24, and the removed probe scripts/skinny_gemm.py --large around them)
LARGE_CANDIDATES: tuple[SkinnyConfig, ...] = tuple(
    SkinnyConfig(n, 32, 1, num_warps=w, num_stages=st, block_m=m, precision="tf32x3", weight_layout=layout)
    for m, n, w, st in ((128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4), (64, 64, 4, 4))
    for layout in ("nk", "kn")
)


def candidates_for(rows: int) -> tuple[SkinnyConfig, ...]:
    return CANDIDATES if rows <= MAX_ROWS else LARGE_CANDIDATES


def block_m(rows: int) -> int:
    """The tile's row count: tl.dot needs at least 16; 64 caps the registers."""
    return min(64, max(16, 1 << max(rows - 1, 0).bit_length()))


def slices(k: int, config: SkinnyConfig) -> tuple[int, int]:
    """(K per slice, rounded up to whole BLOCK_K steps; number of non-empty slices)."""
    per = -(-k // config.split_k)
    per = -(-per // config.block_k) * config.block_k
    return per, -(-k // per)


@functools.cache
def _kernels():
    from opara_core.engine import skinny_kernels

    return skinny_kernels


def skinny_mm(x: torch.Tensor, weight_t: torch.Tensor, config: SkinnyConfig, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] (+ bias [N]) with the kernel (a GPU, fp32, any
    strides: `weight_t` may be the stored transpose or a view of the weight)."""
    (m, k), (k2, n) = x.shape, weight_t.shape
    if k != k2:
        raise ValueError(f"skinny_mm: x is {m}x{k}, the transposed weight {k2}x{n}")
    if x.dtype != torch.float32 or weight_t.dtype != torch.float32:
        raise TypeError(f"skinny_mm takes float32 tensors, got {x.dtype} and {weight_t.dtype}")
    kernels = _kernels()
    out = torch.empty((m, n), device=x.device, dtype=torch.float32)
    per, split = slices(k, config)
    target = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    tile_m = config.block_m or block_m(m)
    kernels.skinny_mm[(-(-n // config.block_n), -(-m // tile_m), split)](
        x, weight_t, out if bias is None else bias, target, m, n, k, per,
        x.stride(0), x.stride(1), weight_t.stride(0), weight_t.stride(1),
        target.stride(0) if split > 1 else 0, target.stride(-2), target.stride(-1),
        HAS_BIAS=bias is not None and split == 1, PRECISION=config.precision, BLOCK_M=tile_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        kernels.sum_splits[(-(-m * n // SUM_BLOCK),)](
            target, out if bias is None else bias, out, m * n, n, SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK
        )
    return out


# ---- timing ------------------------------------------------------------------------------


def weight_copies(n: int, k: int, device: torch.device) -> list[torch.Tensor]:
    """Random weights of this size, enough of them to miss L2 together."""
    count = max(4, min(32, L2_MISS_BYTES // (4 * n * k)))
    return [torch.randn(n, k, device=device) / k**0.5 for _ in range(count)]


def time_shape(m: int, k: int, n: int, device: torch.device, candidates: tuple[SkinnyConfig, ...] | None = None, bias: bool = False) -> dict:
    """ms per call at this shape of cuBLAS on either weight layout (with
    `bias`, each as `addmm` and as `mm` then an add) and of every kernel
    candidate (default: `candidates_for(m)`) that compiles for this GPU and
    answers within the accuracy rule (`accurate_enough`)."""
    x = torch.randn(m, k, device=device)
    b = torch.randn(n, device=device) if bias else None
    weights = weight_copies(n, k, device)
    layouts = {CUBLAS: [w.t() for w in weights], CUBLAS_NN: [w.t().contiguous() for w in weights]}
    timings = {}
    for choice in LIBRARY if bias else (CUBLAS, CUBLAS_NN):
        timings[choice] = per_call_ms([lambda r=r, c=choice: library_mm(x, r, c, b) for r in layouts[choice.removesuffix("+add")]])
    exact = x.double() @ layouts[CUBLAS][0].double() + (0 if b is None else b.double())
    reference = relative_error(library_mm(x, layouts[CUBLAS][0], CUBLAS, b), exact)
    for config in candidates_for(m) if candidates is None else candidates:
        stored = layouts[CUBLAS_NN] if config.weight_layout == "kn" else layouts[CUBLAS]
        error = _answer_error(x, stored[0], config, b, exact)
        if error is None or not accurate_enough(error, reference):
            if error is not None:
                log.warning("skinny GEMM %dx%dx%d: %s is off by %.1e (cuBLAS %.1e): not a candidate", m, k, n, config, error, reference)
            continue
        timings[config] = per_call_ms([lambda w=w, c=config: skinny_mm(x, w, c, b) for w in stored])
    return timings


def accurate_enough(error: float, cublas_error: float) -> bool:
    """A kernel candidate may err at most ACCURACY_SLACK times as much as
    cuBLAS's fp32 GEMM at the same shape (or ACCURACY_FLOOR): tf32x3 passes,
    a plain TF32 product (10 mantissa bits: ~1e-3) would not."""
    return error <= max(ACCURACY_SLACK * cublas_error, ACCURACY_FLOOR)


def _answer_error(x: torch.Tensor, weight_t: torch.Tensor, config: SkinnyConfig, bias: torch.Tensor | None, exact: torch.Tensor) -> float | None:
    """The candidate's relative error at this shape (its first run compiles it),
    or None where Triton cannot build it for this GPU (shared memory, registers)."""
    try:
        return relative_error(skinny_mm(x, weight_t, config, bias), exact)
    except (*triton_failures(), RuntimeError) as error:
        log.info("skinny GEMM candidate %s does not build for %s: %s", config, x.shape, str(error).splitlines()[0][:200])
        return None


def library_mm(x: torch.Tensor, right: torch.Tensor, choice: str, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ right` (+ `bias`) by cuBLAS: `addmm`, or for the `+add` choices `mm` then an add."""
    if bias is None:
        return torch.mm(x, right)
    return torch.mm(x, right).add_(bias) if choice.endswith("+add") else torch.addmm(bias, x, right)


Choice = SkinnyConfig | str  # a kernel configuration or one of LIBRARY


def best_of(timings: dict) -> Choice:
    """The fastest kernel candidate if it beats the fastest cuBLAS way by
    MIN_GAIN, else that way (in LIBRARY's order on a tie)."""
    library = min((c for c in LIBRARY if c in timings), key=timings.get)
    best = min((c for c in timings if isinstance(c, SkinnyConfig)), key=timings.get, default=None)
    return best if best is not None and timings[best] <= MIN_GAIN * timings[library] else library


# ---- choices: per process and on disk ----------------------------------------------------


class Choices(ShapeChoices[Choice]):
    """The kernel configuration or cuBLAS layout per (M, K, N) on this GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        key = [KERNEL_VERSION, MIN_GAIN, ACCURACY_SLACK, ACCURACY_FLOOR, [asdict(c) for c in CANDIDATES + LARGE_CANDIDATES]]
        super().__init__("skinny", key, SkinnyConfig, CUBLAS, software=("gpu", "torch", "triton"), device=device)

    def choose(self, m: int, k: int, n: int, bias: bool = False) -> Choice:
        shape = f"{m},{k},{n}" + ("+bias" if bias else "")

        def time_and_pick() -> Choice:
            timings = time_shape(m, k, n, self.device, bias=bias)
            chosen = best_of(timings)
            log.info("skinny GEMM %s: %s (%.1f us; cuBLAS %.1f us, on the stored transpose %.1f us)", shape, chosen,
                     timings[chosen] * 1e3, timings[CUBLAS] * 1e3, timings[CUBLAS_NN] * 1e3)  # fmt: skip
            return chosen

        return super().choose(shape, time_and_pick)


_choices: dict[str, Choices] = {}


def choices_for(device: torch.device) -> Choices:
    key = str(device)
    if key not in _choices:
        _choices[key] = Choices(device)
    return _choices[key]


def linear_mm(x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T` (+ `bias`; `weight_t` is `weight.t()` stored contiguous):
    the kernel where it was measured faster (adding a bias of one value per
    column as it writes); else cuBLAS on the layout measured faster and, with a
    bias, the faster of `addmm` and `mm` then an add in place (timed apart from
    the bias-free shape)."""
    m, n = x.shape[0], weight.shape[0]
    if not (x.is_cuda and x.dtype == weight_t.dtype == torch.float32 and m > 0):
        return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
    if bias is not None and not (bias.shape == (n,) and bias.is_contiguous() and bias.dtype == torch.float32):
        return linear_mm(x, weight, weight_t) + bias  # a bias the kernels do not take (broadcast, another dtype)
    choice = choices_for(x.device).choose(m, x.shape[1], n, bias is not None)
    if isinstance(choice, SkinnyConfig):
        return skinny_mm(x, weight_t if choice.weight_layout == "kn" else weight.t(), choice, bias)
    return library_mm(x, weight_t if choice.startswith(CUBLAS_NN) else weight.t(), choice, bias)


@functools.cache
def skinny_mm_op():
    """`torch.ops.opara.skinny_mm` (registered on first use: no side effects at
    import): `linear_mm` as a custom op, so that Inductor calls it as one
    opaque kernel with a fake implementation for shapes."""

    @torch.library.custom_op("opara::skinny_mm", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_mm(x, weight, weight_t, bias)

    @op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    # the static cost model counts its FLOPs as mm's (engine.costs)
    from torch.utils.flop_counter import flop_registry

    mm = flop_registry[torch.ops.aten.mm]
    flop_registry.setdefault(torch.ops.opara.skinny_mm, lambda x, weight, *args, out_val=None, **kwargs: mm(x, weight.t(), out_val=out_val))
    return torch.ops.opara.skinny_mm.default


class SkinnyLinear(torch.nn.Module):
    """An nn.Linear's forward through `opara::skinny_mm`, for a graph whose
    weights are inputs rather than frozen constants (`whole_model.WholeModelSaved`
    cannot freeze): the same weight
    and bias parameters, plus the weight stored transposed as a buffer. The
    bias is added outside the op, where Inductor fuses it into the next kernel."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = skinny_mm_op()(x.reshape(-1, x.shape[-1]), self.weight, self.weight_t)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


def with_skinny_linears(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with each fp32 nn.Linear as a SkinnyLinear of the same
    parameters: the modules on the way to one are shallow copies, the rest
    (and every parameter) shared; `module` itself is left as it was."""
    if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
        return SkinnyLinear(module)
    children = {name: with_skinny_linears(child) if child is not None else None for name, child in module._modules.items()}
    if all(children[name] is child for name, child in module._modules.items()):
        return module
    clone = copy.copy(module)
    clone._modules = children
    return clone
