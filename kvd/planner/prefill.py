"""Load a hit or compute it again: the engine's prefill profile and the rule that weighs a hit's load
time against it (issue 38, item 1).

A hit is worth loading only while it arrives sooner than the engine could compute the same tokens.
The profile says what computing costs on the served model and engine: seconds to prefill `new`
prompt tokens after `prefix` tokens already in the KV cache, measured on a grid (make
prefill-profile, bench/prefill_profile.py), plus the seconds per token a host-memory hit costs to
bring into the engine (measured the same way, through kvd). Lookup(load_times) says what loading
costs now: per matched block, the seconds until it and the blocks before it are in kvd's host
memory (kvd.planner.load_time).

`best_stop` then picks how many of the matched blocks to load: the number whose time to first
token, load then compute the rest, is least. Loading nothing is always a candidate, so the rule
never does worse than recomputing by its own estimates.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "kvd-prefill-profile/1"


@dataclass(frozen=True, slots=True)
class PrefillProfile:
    """seconds[i][j]: prefill of new_tokens[i] prompt tokens after prefixes[j] cached ones."""

    model: str
    engine: str
    new_tokens: np.ndarray  # increasing, > 0
    prefixes: np.ndarray  # increasing, from 0
    seconds: np.ndarray  # (len(new_tokens), len(prefixes)), > 0
    host_load_s_per_token: float = 0.0  # a host-memory hit's copy into the engine

    @classmethod
    def load(cls, path: str | Path) -> PrefillProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"prefill profile {path}: cannot read it: {error}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "prefill profile") -> PrefillProfile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source}: not a {FORMAT} file (its format is "
                             f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r})")
        try:
            new = np.asarray(data["new_tokens"], dtype=np.float64)
            prefixes = np.asarray(data["prefixes"], dtype=np.float64)
            seconds = np.asarray(data["seconds"], dtype=np.float64)
            per_token = float(data.get("host_load_s_per_token", 0.0))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{source}: {error.__class__.__name__}: {error}") from None
        problem = _grid_problem(new, prefixes, seconds, per_token)
        if problem:
            raise ValueError(f"{source}: {problem}")
        return cls(str(data.get("model", "")), str(data.get("engine", "")), new, prefixes, seconds, per_token)

    def prefill_s(self, new: np.ndarray, prefix: np.ndarray) -> np.ndarray:
        """Seconds to prefill new[k] tokens after prefix[k] cached ones: linear between grid points,
        at the grid's edge value below its first point and outside its prefixes, and along the last
        step's slope past its last number of new tokens."""
        new = np.asarray(new, dtype=np.float64)
        prefix = np.clip(np.asarray(prefix, dtype=np.float64), self.prefixes[0], self.prefixes[-1])
        columns = np.stack([_extend(new, self.new_tokens, self.seconds[:, j]) for j in range(len(self.prefixes))])
        if len(self.prefixes) == 1:
            return columns[0]
        right = np.clip(np.searchsorted(self.prefixes, prefix, side="right"), 1, len(self.prefixes) - 1)
        left = right - 1
        # prefix lies in [prefixes[left], prefixes[right]] (clipped above), and prefixes increase strictly
        weight = (prefix - self.prefixes[left]) / (self.prefixes[right] - self.prefixes[left])
        index = np.arange(len(new))
        return columns[left, index] * (1 - weight) + columns[right, index] * weight


def _grid_problem(new: np.ndarray, prefixes: np.ndarray, seconds: np.ndarray, per_token: float) -> str:
    if new.ndim != 1 or len(new) < 2 or not np.all(np.diff(new) > 0) or new[0] <= 0:
        return f"new_tokens must be 2 or more increasing counts above 0, not {new.tolist()}"
    if prefixes.ndim != 1 or len(prefixes) < 1 or not np.all(np.diff(prefixes) > 0) or prefixes[0] != 0:
        return f"prefixes must be increasing counts from 0, not {prefixes.tolist()}"
    if seconds.shape != (len(new), len(prefixes)):
        return f"seconds must be {len(new)} rows of {len(prefixes)} (new_tokens x prefixes), not {seconds.shape}"
    if not np.all(np.isfinite(seconds)) or not np.all(seconds > 0):
        return "every entry of seconds must be a positive number"
    if not math.isfinite(per_token) or per_token < 0:
        return f"host_load_s_per_token must be a number >= 0, not {per_token}"
    return ""


def _extend(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """np.interp, continued past the last point along the last segment's slope."""
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * max(slope, 0.0), np.interp(x, xs, ys))


@dataclass(frozen=True, slots=True)
class LoadChoice:
    stop: int  # load blocks [first, stop); compute the rest
    load_s: float  # expected seconds of that load
    compute_s: float  # expected seconds of the prefill after it
    recompute_s: float  # expected seconds, loading nothing
    load_all_s: float  # expected seconds, loading every matched block


def best_stop(profile: PrefillProfile, first: int, stop: int, block_tokens: int, prompt_tokens: int,
              load_s: np.ndarray | None, before_tokens: int = 0) -> LoadChoice:
    """How many of the matched blocks [first, stop) to load. load_s: Lookup's seconds until blocks
    [0, i] are in host memory (NaN: a tier not measured yet, priced as free so that it gets measured);
    None prices every block as a host hit. Each loaded block adds the profile's host copy into the
    engine. before_tokens: tokens the engine holds ahead of block 0 (a Lookup from a parent key);
    prompt_tokens counts them too. Ties go to the longer load."""
    candidates = np.arange(first, stop + 1)
    ready = np.zeros(stop + 1)  # ready[k]: seconds until blocks [0, k) are in host memory
    if load_s is not None and stop > 0:
        ready[1:] = np.maximum.accumulate(np.nan_to_num(np.asarray(load_s[:stop], dtype=np.float64), nan=0.0))
    loading = ready[candidates] - ready[first] + (candidates - first) * block_tokens * profile.host_load_s_per_token
    cached = before_tokens + candidates * block_tokens
    computing = profile.prefill_s(prompt_tokens - cached, cached)
    total = loading + computing
    best = len(total) - 1 - int(np.argmin(total[::-1]))
    return LoadChoice(int(candidates[best]), float(loading[best]), float(computing[best]), float(total[0]),
                      float(total[-1]))
