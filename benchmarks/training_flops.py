"""Counts a recipe's training compute: the matrix-multiply FLOPs of every batch its run trains on.

    python benchmarks/training_flops.py --hparams small,d_model=128 [--budget small]
        [--data_dir DIR] [--scratch DIR] [--json FILE]

The run's batches are the ones train.py would make: the corpus prepared with the recipe's subword
model (trained once into `--scratch`, as train.py trains it into a logdir), each epoch's plan
from the pairs' lengths (`Corpus.train_batch_shapes`: the same buckets, shuffles and padding),
at most `steps_per_epoch` updates an epoch. Each batch counts `train_comparison.training_flops`
at its padded shape (forward and backward of every matrix product, attention's and the output
layer's included). With `--budget H`, recipe H is counted too and the ratio printed; a recipe
over its budget ends with an error (exit 1) after the counts are written.
"""

import argparse
import hashlib
import json
import os
import sys

from prerequisites import DEFAULT_DATA, ROOT, recipe, require_data
from train_comparison import training_flops

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hparams as hp  # noqa: E402
from kyu_transformer.data.corpus import Corpus  # noqa: E402
from kyu_transformer.safety.writes import write_text  # noqa: E402
from kyu_transformer.training.clock import epoch_updates  # noqa: E402

# What the subword model depends on: recipes alike in these share a scratch folder.
SUBWORD_KEYS = ("vocab_size", "subword_model_type", "seed", "src_lang", "tgt_lang")


def count(spec, data_dir, scratch):
    """Returns the run of recipe `spec` counted: its batches, updates and FLOPs."""
    hparams = hp.parse(spec)
    key = json.dumps([os.path.abspath(data_dir)] + [hparams[name] for name in SUBWORD_KEYS])
    model_dir = os.path.join(scratch, hashlib.sha256(key.encode()).hexdigest()[:12])
    corpus = Corpus(data_dir, model_dir, hparams, log=lambda line: None)
    # The model's sizes: its output layer has `vocab_size` rows, whatever the pieces' count.
    shape = {name: hparams[name] for name in ("vocab_size", "d_model", "d_ff", "num_blocks")}
    batches = updates = flops = 0
    for epoch in range(hparams["num_epochs"]):
        shapes = corpus.train_batch_shapes(epoch)
        trained, made = epoch_updates(len(shapes), hparams["steps_per_epoch"],
                                      hparams["accumulate_steps"])
        shapes = shapes[:trained]
        batches, updates = batches + trained, updates + made
        flops += sum(training_flops(shape, int(rows), int(source), int(target))
                     for rows, source, target in shapes)
    return {"hparams": spec, "shape": shape, "epochs": hparams["num_epochs"],
            "batches": batches, "updates": updates, "flops": flops}


def describe(counted):
    return (f"{counted['hparams']}: {counted['updates']:,} updates ({counted['batches']:,} "
            f"batches, {counted['epochs']} epochs), {counted['flops'] / 1e15:.2f} PFLOP")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hparams", required=True, help="the recipe, as train.py's --hparams")
    parser.add_argument("--budget", default=None, metavar="H", type=recipe,
                        help="also count recipe H and print the ratio")
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--scratch", default=os.path.join(ROOT, "runs", "flops"),
                        help="where the recipes' subword models and prepared corpora are kept")
    parser.add_argument("--json", default=None, help="also write the counts to this file")
    args = parser.parse_args(argv)
    data_dir = require_data(args.data_dir)
    try:
        counted = {"candidate": count(args.hparams, data_dir, args.scratch)}
        if args.budget:
            counted["budget"] = count(args.budget, data_dir, args.scratch)
    except ValueError as error:  # HParamsError and DataError among them
        sys.exit(f"error: {error}")
    except OSError as error:  # a scratch folder or disk that cannot take the corpus
        sys.exit(f"error: --scratch {args.scratch}: {error}")
    except KeyboardInterrupt:
        sys.exit("error: stopped by a signal before the counts were done; nothing written")
    print(f"training FLOPs of {describe(counted['candidate'])}")
    if args.budget:
        counted["ratio"] = counted["candidate"]["flops"] / counted["budget"]["flops"]
        print(f"budget, {describe(counted['budget'])}; ratio {counted['ratio']:.3f}")
    if args.json:
        try:
            write_text(args.json, json.dumps(counted, indent=2))
        except OSError as error:
            sys.exit(f"error: --json {args.json}: {error}")
    if counted.get("ratio", 0) > 1:
        sys.exit(f"error: {args.hparams} would train on {counted['ratio']:.3f} times the FLOPs "
                 f"of --budget {args.budget}: fewer epochs or a smaller model")


if __name__ == "__main__":
    main()
