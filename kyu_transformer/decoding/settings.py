"""Says how to search (`SearchSettings`, one validated value for every engine and program) and
how long an output may be (`checked_max_length`).

It imports no Keras or TensorFlow, so that a program checks its flags before TensorFlow loads.
"""

import dataclasses

import numpy as np

SEED_LIMIT = 2**32 - 1
_TINY = float(np.finfo(np.float32).tiny)


def checked_max_length(max_length, maxlen2=None):
    """Returns `max_length`, the most output tokens of a sentence (EOS included), after checking
    that it is at least 1 and, where the model's `maxlen2` is given, at most that: the model has
    no target position beyond it."""
    if maxlen2 is None:
        if max_length < 1:
            raise ValueError(f"`max_length` must be at least 1, got {max_length}")
    elif not 1 <= max_length <= maxlen2:
        raise ValueError(f"`max_length` must be in [1, {maxlen2}] (the model's maxlen2), "
                         f"got {max_length}")
    return max_length


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """Holds how to search, checked when made (ValueError naming the setting).

    The fields are the flags of `flags.add_search_arguments`, and `max_length`: the most output
    tokens of any sentence (default the model's maxlen2). `sampling_topk` 1 is no sampling, as in
    OpenNMT-tf and CTranslate2; `seed` is below 2**32 - 1 (CTranslate2's seeds are 32-bit,
    its last value "none").
    """

    beam_size: int = None
    alpha: float = 0.6
    n_best: int = 1
    length_margin: int = 16
    batch_size: int = 128
    max_length: int = None
    sampling_topk: int = 1
    sampling_topp: float = 1.0
    sampling_temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.beam_size is None:
            object.__setattr__(self, "beam_size", 1 if self.sampling else 4)
        least = {"beam_size": 1, "n_best": 1, "length_margin": 0, "batch_size": 1,
                 "sampling_topk": 0, "seed": 0}
        for name, value in least.items():
            if getattr(self, name) < value:
                raise ValueError(f"`{name}` must be at least {value}, got {getattr(self, name)}")
        if self.seed >= SEED_LIMIT:
            raise ValueError(f"`seed` must be below {SEED_LIMIT}, got {self.seed}")
        if self.max_length is not None:
            checked_max_length(self.max_length)
        if not 0.0 < self.sampling_topp <= 1.0:
            raise ValueError(f"`sampling_topp` must be in (0, 1], got {self.sampling_topp}")
        if not self.sampling_temperature >= _TINY:
            raise ValueError(f"`sampling_temperature` must be at least {_TINY:.2g} (float32's "
                             f"smallest normal number), got {self.sampling_temperature}")
        for name in ("sampling_topp", "sampling_temperature"):
            if not self.sampling and getattr(self, name) != 1.0:
                raise ValueError(f"`{name}` applies to sampling: give `sampling_topk` K (0 for "
                                 "all tokens, 1 does not sample)")
        if self.sampling and self.beam_size > 1:
            raise ValueError(f"`sampling_topk` {self.sampling_topk} samples one token at a "
                             f"time: `beam_size` must be 1 with it, got {self.beam_size}")
        if not self.sampling and self.n_best > self.beam_size:
            raise ValueError(f"`n_best` ({self.n_best}) must be at most `beam_size` "
                             f"({self.beam_size}): the search keeps only `beam_size` hypotheses")

    @property
    def sampling(self):
        """Tells whether these settings sample (`sampling_topk` is not 1)."""
        return self.sampling_topk != 1

    def replace(self, **fields):
        """Returns these settings with `fields` changed (the beam's default follows
        sampling's)."""
        if "sampling_topk" in fields:
            fields.setdefault("beam_size", None)
        return dataclasses.replace(self, **fields)
