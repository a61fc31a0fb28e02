"""Imports a checkpoint of Kyubyong Park's TensorFlow 1.12 Transformer into a new logdir.

    python import_tf1.py --checkpoint log/1 --subword_model iwslt2016/segmented/bpe.model \
        --logdir log/tf1 --hparams data_dir=../shared/data/iwslt2016

PATH (--checkpoint) is a checkpoint prefix or the folder of its `checkpoint` file; the `hparams`
file that code writes beside it gives the model's sizes (--hparams overrides them and sets the
rest). The logdir gets hparams.json, the subword model and the weights as one checkpoint, no run
state: eval.py and export.py use it as any logdir, train.py with --init_from. What is read and
what is not: kyu_transformer/tf1_checkpoint.py and docs/import_tf1.md. The flags, the hparams file,
the subword model and --logdir are checked before TensorFlow loads; a refusal writes nothing.
"""

import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hparams as hp  # noqa: E402
from kyu_transformer import config, filenames, tf1_checkpoint  # noqa: E402
from kyu_transformer.cli.startup import start_tensorflow  # noqa: E402
from kyu_transformer.safety.writes import staging_beside, stops_cleanly_when_full  # noqa: E402
from kyu_transformer.tf1_checkpoint import TF1ImportError  # noqa: E402


def parse_args(argv):
    """Parses import_tf1.py's flags."""
    parser = hp.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, metavar="PATH",
                        help="checkpoint prefix, or the folder of its `checkpoint` file (the "
                             "latest), with the code's `hparams` file beside it")
    parser.add_argument("--subword_model", default=None, metavar="FILE",
                        help="the code's SentencePiece model (bpe.model); default: the .model "
                             "beside the `vocab` its hparams file names")
    parser.add_argument("--logdir", required=True, metavar="OUT",
                        help="the logdir to write (new, or an empty folder)")
    parser.add_argument("--hparams", default="",
                        help="preset, JSON file or key=value,... over the checkpoint's "
                             "(data_dir, batch_size, lr...; the sizes must match its weights)")
    return parser.parse_args(argv)


def check_logdir(logdir):
    """Refuses a --logdir that is a file or a non-empty folder (TF1ImportError)."""
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise TF1ImportError(f"--logdir {logdir} is a file, not a directory")
    if os.path.isdir(logdir) and os.listdir(logdir):
        raise TF1ImportError(f"--logdir {logdir} already exists and is not empty: import into "
                             "a new logdir")


def check_checkpoint_path(path):
    """Refuses a --checkpoint that is neither a folder with a `checkpoint` file nor a checkpoint
    prefix (TF1ImportError)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, filenames.CHECKPOINT_INDEX)):
            raise TF1ImportError(f"--checkpoint {path}: the folder has no `checkpoint` file; "
                                 "give a checkpoint prefix (PATH, of PATH.index)")
    elif not os.path.isfile(path + ".index"):
        raise TF1ImportError(f"--checkpoint {path}: no such checkpoint (no {path}.index) nor "
                             "folder")


def check_before_tensorflow(args):
    """Checks all that can be checked without TensorFlow; returns ``(hparams, subword model
    path)``, or raises TF1ImportError / HParamsError naming the flag or file."""
    check_checkpoint_path(args.checkpoint)
    check_logdir(args.logdir)
    hparams_path, tf1 = tf1_checkpoint.read_hparams(args.checkpoint)
    # The checkpoint's values as the first key=value parts, so that --hparams overrides them.
    spec = ",".join([f"{key}={value}" for key, value in tf1_checkpoint.project_values(tf1).items()]
                    + [args.hparams])
    hparams = hp.parse(spec, {"logdir": args.logdir})
    problems = tf1_checkpoint.changed_fixed(hparams)
    if problems:
        raise TF1ImportError(f"--hparams: {'; '.join(problems)}")
    subword_model = tf1_checkpoint.subword_model_path(args.subword_model, tf1, hparams_path)
    tf1_checkpoint.check_subword_model(subword_model, hparams["vocab_size"])
    return hparams, subword_model


def read_weights(args, hparams):
    """Reads the checkpoint; returns ``(weights by our path, step, prefix, biases, skipped
    names)``."""
    prefix = tf1_checkpoint.checkpoint_prefix(args.checkpoint)
    shapes, read = tf1_checkpoint.read_checkpoint(prefix)
    expected, biases, skipped = tf1_checkpoint.check_layout(prefix, shapes, hparams)
    weights = tf1_checkpoint.imported_weights(expected, read, hparams, biases)
    step = int(read("global_step")) if "global_step" in shapes else 0
    return weights, step, prefix, biases, skipped


def write_logdir(hparams, subword_model, weights, step):
    """Writes the logdir in a folder beside it, renamed into place once complete."""
    logdir = hparams["logdir"]
    try:
        staging = staging_beside(logdir, "import")
    except OSError as error:
        raise SystemExit(f"error: cannot write beside --logdir {logdir} ({error})") from None
    new = os.path.join(staging, "new")  # made with the umask's mode (mkdtemp's is 0o700)
    try:
        os.mkdir(new)
        config.save(hparams, os.path.join(new, filenames.HPARAMS))
        shutil.copyfile(subword_model, os.path.join(new, filenames.SUBWORDS))
        processor = tf1_checkpoint.check_subword_model(subword_model, hparams["vocab_size"])
        with open(os.path.join(new, filenames.SUBWORDS_VOCABULARY), "w",
                  encoding="utf-8") as handle:
            handle.writelines(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
                              for i in range(processor.get_piece_size()))
        path = tf1_checkpoint.save_weights(hparams, weights,
                                           os.path.join(new, filenames.CHECKPOINTS), step)
        if os.path.isdir(logdir):
            os.rmdir(logdir)  # empty (checked before)
        os.replace(new, logdir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return os.path.join(logdir, os.path.relpath(path, new))


@stops_cleanly_when_full
def main(argv=None):
    """Runs import_tf1.py: checks the inputs, reads the weights and writes the new logdir; returns
    the exit status."""
    args = parse_args(argv)
    try:
        hparams, subword_model = check_before_tensorflow(args)
        start_tensorflow()
        weights, step, prefix, biases, skipped = read_weights(args, hparams)
    except (TF1ImportError, config.HParamsError) as error:
        raise SystemExit(f"error: {error}") from None
    path = write_logdir(hparams, subword_model, weights, step)
    read = len(tf1_checkpoint.layout(hparams, biases))
    print(f"read {read} variables of {prefix} (attention projections "
          f"{'with' if biases else 'without'} biases); skipped {len(skipped)} of the optimizer "
          "(Adam slots, beta1_power, beta2_power, global_step)")
    if not biases:
        print("note: the code of this layout masked padding by all-zero vectors; the imported "
              "model masks it by id, as the code's final version: the same on unpadded "
              "sentences, not always in padded batches")
    print(f"wrote {hparams['logdir']}: {filenames.HPARAMS}, {filenames.SUBWORDS} (from "
          f"{subword_model}), {os.path.relpath(path, hparams['logdir'])}")
    print(f"next: python eval.py --logdir {hparams['logdir']} --src FILE, or python train.py "
          f"--init_from {hparams['logdir']} ... to fine-tune")
    return 0


if __name__ == "__main__":
    sys.exit(main())
