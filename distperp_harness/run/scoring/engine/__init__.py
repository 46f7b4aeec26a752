"""One batch of rows scored exactly, below scoring's plan: the forward and float64 log-probabilities (``forward``,
``logprobs``), the tree attention mask (``masks``), what a model type supports for them (``support``) and the
key/value cache of a shared prefix (``kvcache``, also used by generation)."""
