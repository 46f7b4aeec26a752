"""The model on the machine: loading (``loading``), torchao quantization (``quantize``), FSDP2 sharding
(``sharding``), device choice and identity (``devices``) and memory facts (``memory``)."""
