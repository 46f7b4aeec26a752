"""``compile=``: the decoder layers compiled once, the same graphs on every rank (``regional``), and the CPU weight
prepacking that gives most of the gain on CPU (``prepack``)."""
