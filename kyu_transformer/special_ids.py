"""The ids every part agrees on: padding, unknown piece, start and end of a sentence.

The subword model (`data.Subwords`) is trained to give these pieces these
ids; the searches (`decoding`) start from BOS, stop at EOS and pad with 0.
They live here, apart from both, so that decoding needs no corpus code.
Padding is id 0 because the layers tell padding by it (`Embedding`'s mask).
"""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
