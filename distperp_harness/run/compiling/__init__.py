"""``compile=``: the decoder layers compiled once, the same graphs on every rank (``regional``), what it did and the
warm-ups' settings (``state``), every rank compiling in turn and agreeing on the outcome (``agreement``), and the CPU
weight prepacking that gives most of the gain on CPU (``prepack``)."""
