"""Reads and prepares the corpus: parallel text from disk (`text`), SentencePiece subwords
(`subwords`), a corpus made ready for training (`corpus`) and the tf.data pipeline that batches it
(`pipeline`)."""
