"""README.md's Python examples, run as written, and the references of README.md and docs/*.md:
every relative link leads to a file (and heading) that exists, every path and dotted name of the
package they quote is there. The first example needs no TensorFlow: it runs on either backend;
the second translates (TensorFlow), with the session's trained logdir for README's."""

import ast
import contextlib
import os
import re

import keras
import numpy as np
import pytest

from kyu_transformer import fast_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
PAGES = [README] + sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS)
                          if name.endswith(".md"))

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def read(path):
    with open(path, encoding="utf-8") as file:
        return file.read()


def code_blocks(text, language):
    return [body for lang, body in FENCE.findall(text) if lang == language]


def prose(text):
    """`text` without its fenced code blocks (whose brackets are code, not links)."""
    return FENCE.sub("", text)


def anchors(text):
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    found = set()
    for line in prose(text).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@contextlib.contextmanager
def defaults():
    """Keras' float32 policy, the fast paths on and a fixed seed, as a fresh process has them."""
    policy, switch = keras.config.dtype_policy(), fast_paths.enabled()
    keras.config.set_dtype_policy("float32")
    fast_paths.set_enabled(True)
    keras.utils.set_random_seed(0)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(policy)
        fast_paths.set_enabled(switch)


def run_examples(replacements=None):
    """Runs README's Python examples in one namespace (the first, or both with `replacements`
    ``{written: replaced}`` of the second's text); returns the names they leave."""
    first, *rest = code_blocks(read(README), "python")
    namespace = {"__name__": "readme_example"}
    with defaults():
        exec(compile(first, README, "exec"), namespace)  # noqa: S102
        if replacements is not None:
            (second,) = rest
            for written, replaced in replacements.items():
                assert written in second, written
                second = second.replace(written, replaced)
            exec(compile(second, README, "exec"), namespace)  # noqa: S102
    return namespace


@pytest.fixture(scope="module")
def example():
    """The names README's first Python example leaves, run once as written."""
    return run_examples()


@pytest.mark.tensorflow_only("decoding")
@pytest.mark.slow
def test_the_translation_example_runs_on_a_trained_logdir(trained_tiny_logdir, tmp_path,
                                                          capsys):
    """README's second example, on the session's trained logdir (3 checkpoints: the last 2
    averaged) and its .keras export."""
    from tests import programs

    keras_file = tmp_path / "small.keras"
    exported = programs.run("export.py", "--logdir", trained_tiny_logdir, "--out", keras_file,
                            "--format", "keras")
    assert exported.returncode == 0, exported.stderr
    names = run_examples({'"log/small"': repr(str(trained_tiny_logdir)),
                          "average_last=8": "average_last=2",
                          '"small.keras"': repr(str(keras_file)),
                          '"log/toy"': repr(str(tmp_path / "toy"))})
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert printed[1].startswith("['Two puppies") and printed[2].startswith("[[Hypothesis(")
    assert len(names["history"].history["val_bleu"]) == 2
    assert os.listdir(tmp_path / "toy" / "validation")


def test_the_example_user_model_hides_padding(example):
    encoder, padded, alone = example["encoder"], example["padded"], example["alone"]
    assert tuple(padded.shape) == (1, 5, 32) and tuple(alone.shape) == (1, 3, 32)
    # The example's own check held (padding changes nothing); real tokens in the same places
    # do change the first three states, so that check is not vacuous.
    np.testing.assert_allclose(np.asarray(padded)[:, :3], np.asarray(alone), atol=1e-5)
    unpadded = np.asarray(encoder(np.array([[5, 6, 7, 8, 9]])))[:, :3]
    assert np.abs(unpadded - np.asarray(alone)).max() > 1e-3


def test_the_example_transformer_learns_with_fit(example):
    losses = example["history"].history["loss"]
    assert len(losses) == 5 and all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.3, losses
    logits = np.asarray(example["logits"])
    assert logits.shape == (2, 8, 100) and np.isfinite(logits).all()


def test_the_example_data_is_as_its_comments_say(example):
    source, target_in, labels = (example[name] for name in
                                 ("source_ids", "target_in_ids", "label_ids"))
    assert source.min() == 0 and (source[1::2] >= 4).all()  # padding in every other sentence
    assert (target_in[:, 0] == 2).all()  # BOS first
    np.testing.assert_array_equal(target_in[:, 1:], labels[:, :-1])  # then the target


@pytest.mark.parametrize("page", PAGES, ids=lambda path: os.path.relpath(path, ROOT))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(prose(read(page))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            broken.append(f"{target}: no file {os.path.relpath(resolved, ROOT)}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(read(resolved)):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{os.path.relpath(page, ROOT)}: " + "; ".join(broken)


def defines(module_path, name):
    """Whether the module file defines `name` at its top (class, function or assignment)."""
    for node in ast.parse(read(module_path)).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return True
    return False


def module_file(parts):
    """The file of the module ``kyu_transformer.<parts>``, or None."""
    base = os.path.join(ROOT, *parts)
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(candidate):
            return candidate
    return None


def quoted_problems(text):
    """The package paths and dotted names quoted in `text` that do not exist."""
    problems = []
    for span in CODE_SPAN.findall(prose(text)):
        for path in re.findall(r"\b(?:kyu_transformer|tests|benchmarks|examples)/[\w/.]*", span):
            if not os.path.exists(os.path.join(ROOT, path)):
                problems.append(path)
        for dotted in re.findall(r"\bkyu_transformer(?:\.\w+)+", span):
            parts = dotted.split(".")
            # The longest prefix that is a module; what follows is a name in it (or an
            # attribute of that name, not checked).
            for end in range(len(parts), 0, -1):
                found = module_file(parts[:end])
                if found:
                    if end < len(parts) and not defines(found, parts[end]):
                        problems.append(dotted)
                    break
            else:
                problems.append(dotted)
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda path: os.path.relpath(path, ROOT))
def test_every_quoted_path_and_name_of_the_package_exists(page):
    assert not quoted_problems(read(page)), os.path.relpath(page, ROOT)


def test_ci_runs_readmes_test_command():
    """`.ci/run` ends with README's test command, as written there."""
    with open(README, encoding="utf-8") as handle:
        readme = [line.split("  #")[0].strip() for line in handle if "# the tests" in line]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as handle:
        ci = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    assert len(readme) == 1 and ci[-1] == readme[0]
