"""The process group: collectives over Accelerate/torch.distributed (``collective``), the store-backed control
plane (``controlplane``), stopping every rank together when one fails (``failfast``) and the fault injection the
failure tests use (``testfaults``). Knows nothing of models or requests."""
