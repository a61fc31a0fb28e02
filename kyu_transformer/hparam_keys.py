"""Every hyperparameter key: its default, its role in a run and its help, in one table.

`hparams.py` (at the top, beside the programs) holds the presets and the parsing and checking of
`--hparams`; the package reads the keys here, as it imports no top-level file. A key's role says
what may change it once a logdir exists:

- `ARCHITECTURE`: the weights' shapes and the subword model depend on it. A fine-tuning run takes
  the source run's value; the TensorFlow 1 import reads it from that code's checkpoint.
- `RUN`: fixed for a run's life (a resumed run must give the same), free for a fine-tuning run.
- `RESUMABLE`: may change when a run resumes: none changes the model or the data.
"""

from kyu_transformer.conventions import LAYER_NORM_EPSILON, NORM_POSITIONS

ARCHITECTURE, RUN, RESUMABLE = "architecture", "run", "resumable"

# name: (default, role, help). Kyubyong's names where they exist.
SPEC = {
    # data
    "data_dir": ("data/multi30k", RUN, "folder with train/val/test files <split>.<lang>[.gz]"),
    "src_lang": ("de", RUN, "source language suffix"),
    "tgt_lang": ("en", RUN, "target language suffix"),
    "vocab_size": (8000, ARCHITECTURE, "size of the joint SentencePiece vocabulary"),
    "subword_model_type": ("unigram", ARCHITECTURE, "SentencePiece model type: unigram or bpe"),
    "subword_alpha": (0.0, RUN, "subword regularization (unigram only): each epoch draws a training "
                           "sentence's segmentation among its 16 best, ~ p^alpha; 0: the best"),
    "maxlen1": (100, ARCHITECTURE, "longest source, in subwords with EOS; longer pairs are dropped"),
    "maxlen2": (100, ARCHITECTURE, "longest target, in subwords with BOS/EOS; longer pairs are dropped"),
    "batch_size": (128, RUN, "most sentence pairs in a batch"),
    "batch_tokens": (4096, RUN, "most (padded) tokens on either side of a batch; 0: no limit"),
    # model
    "d_model": (512, ARCHITECTURE, "model width"),
    "d_ff": (2048, ARCHITECTURE, "inner width of the feed-forward nets"),
    "num_blocks": (6, ARCHITECTURE, "encoder blocks, and as many decoder blocks"),
    "num_heads": (8, ARCHITECTURE, "attention heads"),
    "dropout_rate": (0.1, RUN, "dropout on the embeddings and before each residual sum"),
    "attention_dropout": (-1.0, RUN, "dropout on the attention weights; -1: dropout_rate"),
    "relu_dropout": (0.0, RUN, "dropout on the feed-forward nets' inner (ReLU) activations"),
    "word_dropout": (0.0, RUN, "dropout of whole token embeddings, source and target"),
    "norm_position": (NORM_POSITIONS[0], ARCHITECTURE, "layer norm after (post) or before (pre) each sub-layer"),
    "sinusoid": (True, ARCHITECTURE, "sinusoid (true) or learned (false) positions"),
    "share_embeddings": (True, ARCHITECTURE, "one embedding table for source, target and output"),
    "epsilon": (LAYER_NORM_EPSILON, ARCHITECTURE, "layer-norm epsilon"),
    "fast_paths": (True, RESUMABLE, "CPU fast paths (fast_paths.py, the loss's stated gradient, fused Adam, "
                         "XLA loss); false: Keras' own, the same function on any device"),
    # training
    "lr": (1.0, RUN, "scale of the Noam learning-rate schedule"),
    "warmup_steps": (4000, RUN, "warm-up steps of the Noam schedule"),
    "decay_steps": (0, RUN, "from the warm-up's end, scale the Noam rate down linearly to 0 at this "
                       "step; 0: no such decay"),
    "smoothing": (0.1, RUN, "label smoothing"),
    "num_epochs": (20, RESUMABLE, "epochs to train"),
    "steps_per_epoch": (0, RESUMABLE, "cap on the steps (updates) of an epoch; 0: the whole training set"),
    "accumulate_steps": (1, RUN, "batches per update (gradient accumulation), as one batch that many "
                            "times as large: the loss normalized by all their tokens"),
    "max_minutes": (0.0, RESUMABLE, "stop cleanly after this many minutes of training; 0: no limit"),
    "seed": (42, RUN, "seed of initialization, shuffling and dropout"),
    "mixed_precision": ("no", RUN, "no, bf16 (CPU/TPU), fp16 (GPU, with loss scaling), or auto: "
                              "chosen for this machine (README) and saved as chosen"),
    "jit_compile": (False, RESUMABLE, "compile the training step with XLA"),
    "xla_loss": (True, RESUMABLE, "compile the loss alone with XLA (a fast path: off without fast_paths)"),
    "logdir": ("log/default", RESUMABLE, "where checkpoints, summaries, plots and the subword model go"),
    "keep_checkpoints": (5, RESUMABLE, "how many recent checkpoints to keep"),
    "checkpoint_every": (500, RESUMABLE, "also checkpoint every this many steps; 0: only per epoch"),
    "log_every": (50, RESUMABLE, "write summaries every this many steps"),
    # evaluation during training
    "eval_sentences": (200, RESUMABLE, "validation sentences scored with BLEU after each epoch; 0: none"),
    "eval_batch_size": (128, RESUMABLE, "sentences per decoding batch"),
}

DEFAULTS = {name: default for name, (default, _, _) in SPEC.items()}
HELP = {name: text for name, (_, _, text) in SPEC.items()}


def keys_of(role):
    """The keys of `role`, in the table's order."""
    return tuple(name for name, (_, key_role, _) in SPEC.items() if key_role == role)
