"""Target prefixes: every strategy of the one search loop, `Translator`, CTranslate2 and the
SavedModel start each output with its prefix, score it as forced decoding does, and decode a
sentence alike in any batch."""

import numpy as np
import pytest

from kyu_transformer.conventions import EOS_ID
from kyu_transformer.data.text import load_split
from kyu_transformer.decoding.translator import Translator
from tests.conftest import load_logdir
from tests.test_data import MULTI30K

pytestmark = pytest.mark.slow  # decodes with the session's logdirs

STRATEGIES = {"greedy": {"beam_size": 1}, "beam": {"beam_size": 4, "alpha": 1.0},
              "sampling": {"sampling_topk": 0, "seed": 3}}


@pytest.fixture(scope="module")
def loaded(trained_tiny_logdir):
    """The trained model, 48 val sources and prefixes of 0 to 5 subwords of their references
    (the long ones beyond many sentences' output limits)."""
    _, model, subwords = load_logdir(trained_tiny_logdir)
    sources, references, _ = load_split(MULTI30K, "val")
    source_ids, reference_ids = subwords.encode(sources[:48]), subwords.encode(references[:48])
    prefixes = [ids[:row % 6] for row, ids in enumerate(reference_ids)]
    prefixes[7] = reference_ids[7] * 8  # longer than any limit
    source_ids[9] = []  # an empty source with a prefix is decoded
    return {"model": model, "subwords": subwords, "sources": source_ids, "prefixes": prefixes,
            "texts": (sources[:48], references[:48])}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_outputs_start_with_their_prefix_and_score_as_forced_decoding(loaded, strategy):
    translator = Translator(loaded["model"], **STRATEGIES[strategy])
    n_best = 1 if strategy == "greedy" else 3
    found = translator.translate_ids(loaded["sources"], n_best=n_best,
                                     prefix_ids=loaded["prefixes"])
    limits = translator.output_limits(np.array([len(ids) for ids in loaded["sources"]]))
    for row, (prefix, limit) in enumerate(zip(loaded["prefixes"], limits)):
        kept = prefix[:limit]
        # (beam search finds one hypothesis where the prefix fills the output: no other exists)
        only_one = strategy == "beam" and len(prefix) >= limit
        assert len(found.hypotheses[row]) == (1 if only_one else n_best)
        for hypothesis in found.hypotheses[row]:
            assert hypothesis[:len(kept)] == kept, (row, hypothesis, kept)
    # the prefix cut to its limit: the output is the cut prefix, at its limit, not ended
    assert found.truncated_prefixes == 1
    assert found.hypotheses[7][0] == loaded["prefixes"][7][:limits[7]]
    assert not found.ended[7][0]
    # each ended hypothesis scores as its full output forced (EOS included), prefix and all
    ended = [(row, j) for row in range(48) for j in range(len(found.ended[row]))
             if found.ended[row][j]]
    assert len(ended) > 40
    scored, _ = translator.score_ids([loaded["sources"][row] for row, _ in ended],
                                     [found.hypotheses[row][j] for row, j in ended])
    np.testing.assert_allclose([found.scores[row][j] for row, j in ended],
                               [result.score for result in scored], rtol=2e-5, atol=2e-5)


@pytest.mark.cpu_exact
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sentence_decodes_alike_in_any_batch_and_without_a_prefix_as_before(loaded,
                                                                              strategy):
    translator = Translator(loaded["model"], batch_size=16, **STRATEGIES[strategy])
    sources, prefixes = loaded["sources"], loaded["prefixes"]
    batched = translator.translate_ids(sources, n_best=1, prefix_ids=prefixes)
    # (a sample draws by its sentence's place in the call: sampled alone, it is sentence 0)
    fives = translator.replaced(batch_size=5).translate_ids(sources, n_best=1,
                                                            prefix_ids=prefixes)
    assert fives.hypotheses == batched.hypotheses
    np.testing.assert_allclose(fives.scores, batched.scores, rtol=1e-5)
    for row in () if strategy == "sampling" else (1, 4, 7, 9, 30):
        alone = translator.translate_ids([sources[row]], n_best=1, prefix_ids=[prefixes[row]])
        assert alone.hypotheses[0] == batched.hypotheses[row]
        np.testing.assert_allclose(alone.scores[0], batched.scores[row], rtol=1e-5)
    unprefixed = translator.translate_ids(sources, n_best=1)
    for row, prefix in enumerate(prefixes):
        if not prefix and sources[row]:  # a free sentence beside forced ones: as without any
            assert batched.hypotheses[row] == unprefixed.hypotheses[row]
            assert batched.scores[row] == pytest.approx(unprefixed.scores[row], rel=1e-5)
    # an empty source without a prefix stays undecoded; with one it is decoded
    assert unprefixed.hypotheses[9] == [[]] and batched.hypotheses[9][0][:1] == prefixes[9][:1]


def test_text_prefixes_start_the_text_and_bad_prefixes_are_refused(loaded):
    translator = Translator(loaded["model"], beam_size=4)
    sources, references = loaded["texts"]
    prefixes = [" ".join(reference.split()[:2]) for reference in references[:12]]
    texts, _ = translator.translate_texts(sources[:12], loaded["subwords"], prefixes)
    assert all(best.startswith(prefix) for (best, *_), prefix in zip(texts, prefixes)), texts
    with pytest.raises(ValueError, match="12 sources but 11 prefixes"):
        translator.translate_ids(loaded["sources"][:12], prefix_ids=loaded["prefixes"][:11])
    with pytest.raises(ValueError, match=r"prefix 0: holds padding, BOS or EOS"):
        translator.translate_ids(loaded["sources"][:1], prefix_ids=[[5, EOS_ID]])
