"""The ids of padding, unknown piece, start and end of a sentence, which the subword model is
trained to give (`data.Subwords`) and the searches use: here, so that decoding needs no corpus
code. Padding is 0 because the layers tell padding by it (`Embedding`'s mask)."""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
