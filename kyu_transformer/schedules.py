"""The learning-rate schedule of "Attention Is All You Need"."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="kyu_transformer")
class NoamSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``lr * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``.

    Linear warm-up, then inverse square root decay; the optimizer's iteration 0 is step 1.

    Args:
      d_model: Model width.
      warmup_steps: Steps of linear warm-up.
      lr: Overall scale (the paper's is 1).
    """

    def __init__(self, d_model, warmup_steps=4000, lr=1.0):
        self.d_model, self.warmup_steps, self.lr = int(d_model), int(warmup_steps), float(lr)

    def __call__(self, step):
        step = ops.cast(step, "float32") + 1.0
        decay = ops.minimum(ops.rsqrt(step), step * self.warmup_steps ** -1.5)
        return self.lr * self.d_model ** -0.5 * decay

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "lr": self.lr}
