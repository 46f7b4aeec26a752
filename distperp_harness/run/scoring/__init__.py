"""One batch of rows scored exactly: the forward and float64 log-probabilities (``forward``), the tree attention
mask (``masks``) and the key/value cache of a shared prefix (``kvcache``, also used by generation)."""
