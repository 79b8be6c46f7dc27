"""Seeded request-length distributions for variable-length models (`--lengths`).

SPEC is one of:
  lognormal:mean=50,cap=512,seed=1[,sigma=1.0]  log-normal with that mean (before the cap),
                                                  rounded, clipped to 1..cap: short-text
                                                  traffic with a long tail
  fixed:N                                         every request N tokens
  file:PATH                                       lengths from a file (integers separated by
                                                  spaces, commas or newlines), in order, cycled
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.inputs import InputError


@dataclass(frozen=True)
class LengthSpec:
    """A parsed SPEC; `lengths(n)` draws the same n lengths every time."""

    kind: str
    mean: float = 0.0
    sigma: float = 1.0
    cap: int = 0
    seed: int = 0
    values: tuple[int, ...] = ()

    def lengths(self, n: int) -> np.ndarray:
        if self.kind == "lognormal":
            # E[exp(N(mu, s^2))] = exp(mu + s^2/2): choose mu for the asked mean
            mu = np.log(self.mean) - self.sigma**2 / 2
            drawn = np.random.default_rng(self.seed).lognormal(mu, self.sigma, n)
            return np.clip(np.rint(drawn), 1, self.cap).astype(np.int64)
        return np.resize(np.asarray(self.values, dtype=np.int64), n)

    def describe(self) -> str:
        if self.kind == "lognormal":
            return f"lognormal(mean {self.mean:g}, sigma {self.sigma:g}, cap {self.cap}, seed {self.seed})"
        return f"{self.kind} ({len(self.values)} lengths)"


def parse(spec: str) -> LengthSpec:
    """A LengthSpec from SPEC; an InputError names what is wrong."""
    kind, _, rest = spec.partition(":")
    if kind == "fixed":
        return LengthSpec("fixed", values=(_positive(rest, "fixed:N"),))
    if kind == "file":
        try:
            text = Path(rest).read_text()
        except OSError as error:
            raise InputError(f"--lengths {spec}: cannot read {rest}: {error}") from None
        values = tuple(_positive(v, f"--lengths file {rest}") for v in re.split(r"[\s,]+", text.strip()) if v)
        if not values:
            raise InputError(f"--lengths {spec}: {rest} holds no lengths")
        return LengthSpec("file", values=values)
    if kind == "lognormal":
        fields = dict(item.partition("=")[::2] for item in rest.split(",") if item)
        unknown = sorted(set(fields) - {"mean", "cap", "seed", "sigma"})
        if unknown or not {"mean", "cap"} <= set(fields):
            raise InputError(f"--lengths {spec}: give lognormal:mean=M,cap=C[,seed=S][,sigma=X]")
        try:
            mean, sigma = float(fields["mean"]), float(fields.get("sigma", 1.0))
        except ValueError:
            raise InputError(f"--lengths {spec}: mean and sigma must be numbers") from None
        if not mean >= 1 or not sigma > 0:
            raise InputError(f"--lengths {spec}: mean must be >= 1 and sigma > 0")
        return LengthSpec("lognormal", mean, sigma, _positive(fields["cap"], "cap"), _positive(fields.get("seed", "0"), "seed", low=0))
    raise InputError(f"--lengths {spec!r}: use lognormal:mean=M,cap=C[,seed=S], fixed:N or file:PATH")


def _positive(text: str, what: str, low: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"{what}: {text!r} is not an integer") from None
    if value < low:
        raise InputError(f"{what}: {value} is below {low}")
    return value
