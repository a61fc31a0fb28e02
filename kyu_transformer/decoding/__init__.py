"""Decodes with a trained `Transformer`: this package holds the one `search` loop and its
strategies (greedy, beam, sampling), their `settings`, the `translator` front end every engine
shares, and sacreBLEU's scores (`bleu`)."""
