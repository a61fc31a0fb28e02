"""Defines the learning-rate schedule of "Attention Is All You Need"."""

import keras
from keras import ops

from kyu_transformer.conventions import check_decay


@keras.saving.register_keras_serializable(package="kyu_transformer")
class NoamSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Computes the rate ``lr * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``:
    linear warm-up, then inverse square root decay; the optimizer's iteration 0 is step 1. With
    `decay_steps`, from the warm-up's end the rate is also scaled by a line from 1 down to 0 at
    step `decay_steps` (the plain schedule is still at half its peak after four times its
    warm-up).

    Args:
      d_model: Model width; warmup_steps: steps of linear warm-up.
      lr: Overall scale (the paper's is 1).
      decay_steps: The step where the rate reaches 0; 0: no such decay.
    """

    def __init__(self, d_model, warmup_steps=4000, lr=1.0, decay_steps=0):
        self.d_model, self.warmup_steps, self.lr = int(d_model), int(warmup_steps), float(lr)
        self.decay_steps = int(decay_steps)
        check_decay(self.decay_steps, self.warmup_steps)

    def __call__(self, step):
        step = ops.cast(step, "float32") + 1.0
        decay = ops.minimum(ops.rsqrt(step), step * self.warmup_steps ** -1.5)
        if self.decay_steps:
            left = (self.decay_steps - step) / (self.decay_steps - self.warmup_steps)
            decay = decay * ops.clip(left, 0.0, 1.0)
        return self.lr * self.d_model ** -0.5 * decay

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "lr": self.lr,
                "decay_steps": self.decay_steps}
