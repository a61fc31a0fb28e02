"""Holds every file and folder name the programs write (and the libraries' names they look for).

A training logdir holds most of the names down to `EVAL` (eval.py's folder of the files
`evaluation_file` names); comments say where the others live. Temporary names stay beside the code
that makes and renames them."""

import os

HPARAMS = "hparams.json"  # the run's hyperparameters, read by eval.py and export.py
INIT_FROM = "init_from.json"  # a fine-tuning run's source: logdir, checkpoint, sha256s
CORPUS = "corpus.json"  # digests of the training files, checked when a run resumes
SUBWORDS = "subwords.model"  # the sentencepiece model
SUBWORDS_VOCABULARY = "subwords.vocab"  # its pieces and scores, readable, beside it
SUBWORDS_PREFIX = "subwords"  # sentencepiece's model_prefix while it trains
PREPARED = "prepared"  # the training split's subword ids (`data.prepared`), unless corpus_cache
BATCH_ORDER = "batch_order.json"  # how the run orders its batches (`training.logdir`)
CHECKPOINTS = "checkpoints"  # the rolling checkpoints
CHECKPOINT_PREFIX = "ckpt"  # TensorFlow's CheckpointManager names them ckpt-<step>
CHECKPOINT_INDEX = "checkpoint"  # ... and lists them in this file
CORRUPT = "corrupt"  # inside CHECKPOINTS: unreadable checkpoints moved aside as <name>.<time>
BEST_WEIGHTS = "best.weights.h5"  # the weights of the best validation BLEU
BEST = "best"  # the name --ckpt gives them
BEST_RECORD = "best.json"  # which step and BLEU they are
HISTORY = "history.jsonl"  # one record per logged step and evaluation
TENSORBOARD = "train"  # TensorBoard's event files
MODEL = "model.keras"  # the trained model, saved by Keras
PLOTS = {"loss": "loss.png", "lr": "lr.png", "bleu": "bleu.png"}
LOCK = ".lock"  # held while a run writes the logdir
ASIDE = "{}.old-{}"  # train.py --overwrite moves a logdir's contents to <logdir>.old-<time>
EVAL = "eval"  # eval.py's outputs

# eval.py's files for an evaluation <name> (`evaluation_file`).
HYPOTHESES = "hyp.txt"
RESULT = "json"  # BLEU and the settings of the run
N_BEST = "nbest.jsonl"
SCORES = "scores.jsonl"  # eval.py --score
ATTENTION_PLOT = "attention.{}.png"  # --plot_attention, one per sentence

# Exports (export.py). SavedModel and CTranslate2 write the graph and model files themselves.
SAVED_MODEL_GRAPH = "saved_model.pb"
SAVED_MODEL_SETTINGS = os.path.join("assets.extra", "export.json")
CTRANSLATE2_MODEL = "model.bin"
CTRANSLATE2_VOCABULARY = "shared_vocabulary.json"
CTRANSLATE2_SETTINGS = "kyu_transformer.json"  # what CTranslate2 does not keep (maxlen1, ...)


def evaluation_file(out_dir, name, kind):
    """Returns the path ``<out_dir>/<name>.<kind>``; `kind` is one of the names above, e.g.
    `HYPOTHESES`."""
    return os.path.join(out_dir, f"{name}.{kind}")
